"""A vector env in a worker subprocess, restarted when it hangs or dies (`env.isolation=process`).

A simulator can fail in ways no Python `except` catches: a step caught in a MuJoCo/EGL
deadlock never returns, a segfault or the OOM killer ends the process. In-process
(`env.isolation=inline`, the default) such a fault takes its rank down and the step watchdog
(hpcvla/process/watchdog.py) stops the job loudly. `IsolatedEnv` runs the shard's vector env in a
worker process of its own instead, so the rank can wait for each call with a deadline and
replace the worker:

    parent (simulator rank)                    worker (python -m hpcvla.envs.isolated FD RANK_PID)
    step(actions) --- ("step", actions) --->   env.step(actions)
                  <-- ("ok", result, ...) ---
    no answer within `timeout_s`, the socket closed (the worker died), or an exception
    escaped the vector env: kill the worker, log it with the rank and env ids, start a
    new one, reset it; the shard's episodes end truncated, flagged `env_fault` (no success, not
    trained), and the run goes on.

`step_async` / `step_wait` split a step (envs/base.py): the simulator loop starts every shard
whose actions are in, then collects them, so a rank's workers step concurrently, one core each
(`hpcvla bench shards` measures it), and a hung shard holds up only itself.

More than `max_restarts` restarts of one shard within `restart_window_s`, or in a row without
a step between, raise (a fault that always recurs is a bug to fix, not to retry:
envs/base.RestartBudget). The worker's own code imports no MPI and no torch (a ManiSkill env
brings torch); it is a helper process of its rank (process/worker.py: it dies with the rank,
leaves stop signals to it). Cost: one more process per shard (~30 MB with `reach`, a simulator's own
footprint with the others), and a pickled observation batch per step over a local socket (~0.1
ms for 8 64-px images).
"""

from __future__ import annotations

import subprocess
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

from hpcvla.envs.base import RestartBudget, StepResult, VectorEnv
from hpcvla.process import worker
from hpcvla.seeds import restart_seed

# fault-injection settings of the envs (reach): they fire in a worker's first life only, as a
# transient fault would; a restarted worker is built without them
INJECTED_FAULTS = ("hang_at_step", "crash_at_step")
KILLED_WAIT_S = 10.0  # how long a killed worker is waited for before it is left behind


class EnvWorkerFailed(RuntimeError):
    """The worker hung, died or raised; the message says which and how."""


class IsolatedEnv(VectorEnv):
    def __init__(self, name: str, num_envs: int, seed: int, kwargs: dict, timeout_s: float,
                 max_restarts: int, first_env: int = 0, owner: str = "this rank",
                 build_timeout_s: float | None = None, restart_window_s: float = 0.0):
        """`timeout_s`: a call's deadline (env.step_timeout_s); `build_timeout_s`: the
        worker's build's (env.build_timeout_s; default timeout_s); 0: none.
        `max_restarts` within `restart_window_s`: RestartBudget's."""
        self.name, self.num_envs, self.seed, self.kwargs = name, num_envs, seed, dict(kwargs)
        self.timeout_s, self.budget = timeout_s or None, RestartBudget(max_restarts,
                                                                      restart_window_s)
        self.build_timeout_s = (timeout_s if build_timeout_s is None else build_timeout_s) \
            or None
        self.where = f"{owner}, {name} envs {first_env}-{first_env + num_envs - 1}"
        self.latency_sleep = kwargs.get("latency_sleep", True)
        self.keep_final_obs = kwargs.get("keep_final_obs", False)  # the worker's env keeps them
        self.last_latency_s = 0.0
        self.failures: list[tuple[int, str]] = []  # (first env id, what happened) per fault
        self.restarts = 0  # over the worker's whole life: each restart's seed differs
        self.first_env = first_env
        self._chunks = np.zeros(num_envs, np.int32)  # for the lengths of cut-short episodes
        self._return = np.zeros(num_envs, np.float32)
        self._proc = self._conn = None
        self._method, self._sent_at = None, 0.0  # the request in flight
        self._closing = False
        try:
            self.spec = self._start(self.kwargs, seed)
        except EnvWorkerFailed as error:  # whose build it was
            self._stop()
            raise EnvWorkerFailed(f"{self.where}: {error}") from None
        except BaseException:  # a worker that cannot build its envs must not linger
            self._stop()
            raise

    # ---- the worker ---------------------------------------------------------------------

    def _start(self, kwargs: dict, seed: int):
        self._proc, self._conn = worker.start("hpcvla.envs.isolated")
        return self._call("init", self.name, self.num_envs, seed, kwargs)

    def _call(self, *message):
        """Send one request and wait for its answer; EnvWorkerFailed on hang, death or error."""
        self._send(message)
        return self._receive()

    def _deadline(self) -> float | None:
        """The request in flight's: the envs' build ("init") has its own."""
        return self.build_timeout_s if self._method == "init" else self.timeout_s

    def _send(self, message: tuple) -> None:
        self._method, self._sent_at = message[0], time.monotonic()
        try:
            self._conn.send(message)
        except OSError:  # the worker is gone; _receive says how
            pass

    def _receive(self):
        """The answer to the request `_send` sent, waiting until its deadline."""
        method, wait, timeout = self._method, None, self._deadline()
        if timeout is not None:
            wait = max(0.0, timeout - (time.monotonic() - self._sent_at))
        try:
            if not self._conn.poll(wait):
                setting = "build_timeout_s" if method == "init" else "step_timeout_s"
                raise EnvWorkerFailed(f"{method} did not return within {timeout:g} s "
                                      f"(env.{setting})")
            status, *answer = self._conn.recv()
        except (EOFError, OSError):
            how = worker.exit_status(self._proc)
            raise EnvWorkerFailed(f"{method}: the worker died ({how})") from None
        if status == "error":
            raise EnvWorkerFailed(f"{method} raised {answer[0]}")
        new_failures, self.last_latency_s, value = answer
        self.failures += new_failures  # slots the vector env isolated itself (envs/serial.py)
        return value

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            try:  # a worker in uninterruptible sleep (a hung driver or file system) outlives
                self._proc.wait(timeout=KILLED_WAIT_S)  # SIGKILL: the rank must not wait on it
            except subprocess.TimeoutExpired:
                print(f"hpcvla: env worker pid {self._proc.pid} (envs {self.first_env}..) did "
                      f"not die {KILLED_WAIT_S:g} s after SIGKILL (uninterruptible?); left "
                      "behind", file=sys.stderr, flush=True)
        if self._conn is not None:
            self._conn.close()

    def _restart(self, error: EnvWorkerFailed) -> dict:
        """Replace the worker (again, if the new one fails too); returns its first
        observations."""
        begin = time.monotonic()
        while True:
            self.failures.append((self.first_env, str(error)))
            self._stop()
            if not self.budget.spend():
                raise EnvWorkerFailed(f"{self.where}: {error}; restarted "
                                      f"{self.budget.spent()}, giving up")
            self.restarts += 1
            print(f"hpcvla: {self.where}: {error}; restarting the worker "
                  f"({self.budget.tally()}); their episodes end truncated", file=sys.stderr,
                  flush=True)
            kwargs = {k: v for k, v in self.kwargs.items() if k not in INJECTED_FAULTS}
            try:  # a fresh seed: the new worker does not replay the run's first episodes
                self._start(kwargs, restart_seed(self.seed, self.restarts))
                obs = self._call("reset", None, None)
            except EnvWorkerFailed as again:
                error = again
                continue
            print(f"hpcvla: {self.where}: worker restarted in {time.monotonic() - begin:.1f} s",
                  file=sys.stderr, flush=True)
            return obs

    # ---- VectorEnv ----------------------------------------------------------------------

    def reset(self, seeds=None, init_state_ids=None):
        self._chunks[:], self._return[:] = 0, 0.0
        try:
            return self._call("reset", seeds, init_state_ids)
        except EnvWorkerFailed as error:
            return self._restart(error)

    def step(self, actions) -> StepResult:
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions) -> None:
        self._send(("step", np.asarray(actions)))  # the worker steps while the rank goes on

    def step_ready(self) -> bool:
        timeout = self._deadline()
        overdue = timeout is not None and time.monotonic() - self._sent_at >= timeout
        try:  # an answer, or EOF from a dead worker
            return overdue or self._conn.poll(0)
        except OSError:
            return True

    def step_wait(self) -> StepResult:
        try:
            result = self._receive()
        except EnvWorkerFailed as error:  # every episode of the shard ends here, truncated
            obs, n = self._restart(error), self.num_envs
            result = StepResult(obs, np.zeros(n, np.float32), np.zeros(n, bool),
                                np.ones(n, bool), np.zeros(n, bool), self._return.copy(),
                                self._chunks.copy(), env_fault=np.ones(n, bool),
                                chunk_steps=np.zeros(n, np.int32),  # none known to have run
                                metrics={name: np.zeros(n, np.float32)
                                         for name in self.spec.episode_metrics} or None)
            self._chunks[:], self._return[:] = 0, 0.0
            return result
        self.budget.worked()
        done = result.terminated | result.truncated
        self._chunks = np.where(done, 0, self._chunks + 1).astype(np.int32)
        self._return = np.where(done, 0.0, self._return + result.reward).astype(np.float32)
        return result

    def instructions(self) -> list[str]:
        return self._call("instructions")

    def hold_resets(self, hold: bool) -> None:
        """The worker's env holds them (a worker restarted meanwhile resets as usual)."""
        self.holding_resets = hold
        try:
            self._call("hold_resets", hold)
        except EnvWorkerFailed:  # stopped, so that no late answer is taken for a step's: the
            self._stop()  # next step finds it gone and restarts it (an env fault)

    def begin_close(self) -> None:
        """Tell the worker to close its env and end; `close` waits for it."""
        if not self._closing:
            self._closing = True
            try:
                self._conn.send(("close",))
            except OSError:
                pass

    def close(self) -> None:
        self.begin_close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._stop()


def _serve(conn: Connection) -> None:
    """The worker: build the env on "init", then answer calls until "close" or EOF."""
    from hpcvla.envs.registry import make_env
    env, reported = None, 0
    while True:
        try:
            method, *args = conn.recv()
        except EOFError:  # the rank is gone
            break
        if method == "close":
            break
        try:
            if method == "init":
                env = make_env(*args[:3], **args[3])
                value = env.spec
            elif method == "instructions":
                value = env.instructions()
            else:
                value = getattr(env, method)(*args)
        except Exception as err:  # noqa: BLE001 - the rank decides: restart or give up
            conn.send(("error", repr(err)))
            continue
        failures = env.failures
        conn.send(("ok", failures[reported:], env.last_latency_s, value))
        reported = len(failures)
    if env is not None:
        env.close()


def _main(fd: int, rank_pid: int) -> None:
    if worker.entered(rank_pid):
        _serve(Connection(fd))
    worker.leave()


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[2]))
