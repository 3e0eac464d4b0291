"""Progress of one-sided transfers that target this rank.

Inside a host, MPI completes a `Put`/`Fetch_and_op`/`Accumulate` into a `Win.Allocate` window
in shared memory: the target needs to do nothing. Across hosts without hardware RMA (TCP, and
InfiniBand for atomics in some MPIs) the *target's* progress engine completes them, and it
runs only while the target is inside an MPI call. A learner that reads its ring with
`Win.Sync()` and plain loads, or that spends a minute in a training step, would leave such
remote producers waiting. The ring uses no atomics (a lane per producer), and over TCP both
MPIs tested complete its plain `Put`s without the target (tests/multihost); fabrics and MPIs
that route `Put` through the target need this module (docs/results.md has the measurements).

So a ring target drives progress itself, two ways:

* **on every poll**: one `Iprobe` on a private duplicate of the ring's communicator (it never
  matches a message; its only effect is a pass of the progress engine), so a polling consumer
  serves remote producers at its polling rate;
* **between polls**, a `ProgressAgent` thread does the same every `interval` seconds (sleeping
  in between), so producers on other hosts complete within milliseconds while the learner is
  inside a training step. The thread holds the GIL only for the `Iprobe` (torch and numpy
  release it while they compute); mpi4py initialises MPI with `MPI_THREAD_MULTIPLE`.

The alternatives, measured (docs/results.md): MPI's own asynchronous progress
(`MPICH_ASYNC_PROGRESS=1`) spins a core per rank and made every MPI call 10-60x slower when
ranks share cores; a helper rank would hold a core and cannot progress
another process's window. The agent is started only where it is needed: when the window's
producers are on other hosts (`spans_hosts`), or always with `mode="thread"`.
"""

from __future__ import annotations

import sys
import threading

from mpi4py import MPI

# One progress pass per millisecond: a remote fragment takes ~2 round trips to the target
# (payload, publish, flushes), so a put completes in a few ms while the target
# computes; 1000 short wake-ups a second cost a fraction of a percent of a core.
DEFAULT_INTERVAL = 1e-3


def spans_hosts(comm: MPI.Comm) -> bool:
    """Collective: whether `comm`'s ranks sit on more than one shared-memory node."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # [dist]
    try:
        return node.Get_size() < comm.Get_size()
    finally:
        node.Free()  # [dist]


class ProgressAgent:
    """Drives this process's MPI progress engine on a private communicator: `poke()` once,
    or `start()` a thread that pokes every `interval` seconds until `stop()`."""

    def __init__(self, comm: MPI.Comm, interval: float = DEFAULT_INTERVAL):
        self.comm = comm.Dup()  # [dist] no message is ever sent on it
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what ended the thread, if it failed

    def poke(self) -> None:
        self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def start(self) -> "ProgressAgent":
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="hpcvla-rma-progress",
                                            daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self.error is None

    def _serve(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self.poke()
        except Exception as err:  # noqa: BLE001 - said; polls still drive progress
            self.error = err
            print(f"hpcvla: rank {MPI.COMM_WORLD.Get_rank()}: the ring's progress thread failed"
                  f" ({type(err).__name__}: {err}); remote producers' writes complete only "
                  "while this rank polls from now on", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def free(self) -> None:
        """Collective over the communicator it was made on."""
        self.stop()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()  # [dist]
