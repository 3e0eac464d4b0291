"""Weight control plane: versioned weights from the learner root to every inference rank,
crossing the network once per node (D-VLA section 3.3).

    plane = WeightPlane(comms.control, comms.node, is_leader, manifest)
    plane.publish(version, flat)        # learner root: returns at once, a thread sends it
    plane.latest_version()              # any rank on a node with a leader: never blocks
    version = plane.read_into(out)      # a consistent copy of the newest version

Path of one version: the root's background thread broadcasts (version, manifest hash, flat
buffer) on its own duplicate of the control communicator (root + one leader per node), so a
publish never blocks the data plane; each node leader's thread receives it straight into the
spare half of a double buffer in a node-shared window (`Win.Allocate_shared` on the node
communicator), then flips the "current" index. Readers copy the current half under a
per-half sequence lock (odd while being written), retrying if it changed underneath, so a
reader never sees a half-written update. Versions only go up; a publish that finds the
previous one still in flight replaces the pending one (readers want the newest, not all).
(Copying straight into the root node's spare half and broadcasting from there saves a copy
but measured slower: a broadcast out of the shared window, racing that node's readers.)
"""

from __future__ import annotations

import math
import sys
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from hpcvla.transport.backoff import Backoff, idle_barrier, wait_until
from hpcvla.transport.records import aligned

# node window header, int64 words
_SEQ0, _SEQ1, _VER0, _VER1, _CURRENT, _NEWEST, _FINISHED = range(7)
_HEADER_BYTES = 64
_STOP = -1


@dataclass(frozen=True)
class Manifest:
    """Names, dtypes (torch's names: float32, bfloat16, ...) and shapes of the tensors in a
    flat weight buffer, in order, each at a 64-byte aligned offset. Torch, not numpy, reads
    and writes it: numpy has no bfloat16, the dtype GPU policies train and act in, and a
    GPU tensor copies to and from the host buffer directly."""
    entries: tuple[tuple[str, str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, tensors: dict) -> "Manifest":
        return cls(tuple((name, str(torch.as_tensor(t).dtype).removeprefix("torch."),
                          tuple(t.shape)) for name, t in tensors.items()))

    def offsets(self) -> list[tuple[str, torch.dtype, tuple, int]]:
        out, offset = [], 0
        for name, dtype, shape in self.entries:
            dt = getattr(torch, dtype)
            out.append((name, dt, shape, offset))
            offset += aligned(dt.itemsize * math.prod(shape))
        return out

    @property
    def nbytes(self) -> int:
        return sum(aligned(getattr(torch, dt).itemsize * math.prod(shape))
                   for _, dt, shape in self.entries)

    @property
    def hash(self) -> int:
        return zlib.crc32(repr(self.entries).encode())

    def views(self, flat: np.ndarray) -> dict[str, torch.Tensor]:
        """Tensors viewing `flat` (uint8, at least nbytes long), by name."""
        return {name: torch.from_numpy(flat[off:off + dt.itemsize * math.prod(shape)])
                .view(dt).reshape(shape) for name, dt, shape, off in self.offsets()}

    def flatten(self, tensors: dict, out: np.ndarray | None = None) -> np.ndarray:
        """Copy `tensors` (on any device; numpy arrays too) into a flat host buffer."""
        out = np.zeros(self.nbytes, np.uint8) if out is None else out
        with torch.no_grad():
            for name, view in self.views(out).items():
                view.copy_(torch.as_tensor(tensors[name]))
        return out


class WeightPlane:
    """Create collectively on every rank: `control` is the control-plane communicator (root =
    rank 0; COMM_NULL elsewhere), `node` this rank's node communicator, `is_leader` whether
    this rank is its node's leader (receives for the node)."""

    def __init__(self, control: MPI.Comm, node: MPI.Comm, is_leader: bool, manifest: Manifest):
        self.manifest, self.nbytes = manifest, manifest.nbytes
        self.is_root = control != MPI.COMM_NULL and control.Get_rank() == 0
        self.is_leader = is_leader
        self.node = node
        # Node window: the leader allocates the header and both halves; nodes without a
        # leader (learner-only) allocate nothing.
        leader = node.allreduce(node.Get_rank() if is_leader else -1, op=MPI.MAX)
        self.has_window = leader >= 0
        half = aligned(self.nbytes)
        size = _HEADER_BYTES + 2 * half if is_leader else 0
        self.win = MPI.Win.Allocate_shared(size, 1, comm=node)
        if self.has_window:
            buf, _ = self.win.Shared_query(leader)
            memory = np.frombuffer(buf, np.uint8)
            self._words = memory[:_HEADER_BYTES].view(np.int64)
            self._halves = [memory[_HEADER_BYTES + i * half:_HEADER_BYTES + i * half
                                   + self.nbytes] for i in (0, 1)]
            if is_leader:
                self._words[:] = 0
                self._words[_CURRENT] = self._words[_NEWEST] = -1
        self.win.Lock_all(MPI.MODE_NOCHECK)
        node.Barrier()

        self._control = control.Dup() if control != MPI.COMM_NULL else MPI.COMM_NULL
        self._header = np.zeros(3, np.int64)  # version (or _STOP), manifest hash, nbytes
        self._lock = threading.Condition()
        self._pending: int | None = None   # version waiting in _staging
        self._in_flight = False  # the root's thread is sending (or storing) a version
        self._stopping = False
        self._last_published = -1
        self._error: BaseException | None = None
        self._thread = None
        if self._control != MPI.COMM_NULL:
            target = self._send_loop if self.is_root else self._receive_loop
            if self.is_root:  # publish() fills one while the thread sends the other
                self._staging = np.zeros(self.nbytes, np.uint8)
                self._sending = np.zeros(self.nbytes, np.uint8)
            self._thread = threading.Thread(target=self._guard, args=(target,),
                                            name="hpcvla-weights", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ learner root
    def publish(self, version: int, flat: np.ndarray) -> None:
        """Queue `flat` (uint8, manifest.nbytes) as `version`; returns after one local copy."""
        self._raise_thread_error()
        if not self.is_root:
            raise RuntimeError("only the weight root (learner 0) publishes weights")
        if version <= self._last_published:
            raise ValueError(f"version {version} after {self._last_published}: versions must "
                             "increase")
        if flat.nbytes != self.nbytes:
            raise ValueError(f"flat weights of {flat.nbytes} bytes, manifest says {self.nbytes}")
        with self._lock:  # the sender only holds the lock to swap buffers, never while sending
            self._staging[...] = flat.reshape(-1).view(np.uint8)
            self._pending = version
            self._last_published = version
            self._lock.notify()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending is not None or self._stopping)
                if self._pending is None:  # stopping, and everything published was sent
                    version = _STOP
                else:
                    version, self._pending = self._pending, None
                    self._staging, self._sending = self._sending, self._staging
                    self._in_flight = True
            self._header[:] = (version, self.manifest.hash, self.nbytes)
            # Ibcast: leaders wait for headers with a nonblocking broadcast, and a nonblocking
            # collective only matches a nonblocking one.
            self._control.Ibcast(self._header, root=0).Wait()
            if version == _STOP:
                if self.is_leader:
                    self._mark_finished()
                return
            self._control.Bcast(self._sending, root=0)
            if self.is_leader:  # the root's own node
                self._store(version, lambda half: np.copyto(half, self._sending))
            with self._lock:
                self._in_flight = False

    def sent(self) -> bool:
        """Root: whether every version published so far reached every node leader (a
        learner that must not race ahead waits on this asleep); never blocks."""
        self._raise_thread_error()
        with self._lock:
            return self._pending is None and not self._in_flight

    # ------------------------------------------------------------ node leaders
    def _receive_loop(self) -> None:
        while True:
            request = self._control.Ibcast(self._header, root=0)
            backoff = Backoff(cap=5e-4, what="the next weight version")
            while not request.Test():  # idle wait that does not burn a core
                backoff.wait()
            version, digest, nbytes = (int(x) for x in self._header)
            if version == _STOP:
                self._mark_finished()
                return
            if digest != self.manifest.hash or nbytes != self.nbytes:
                raise RuntimeError(f"weight manifest mismatch: root sends {nbytes} bytes, hash "
                                   f"{digest:#x}; this rank expects {self.nbytes}, "
                                   f"{self.manifest.hash:#x}")
            self._store(version, lambda half: self._control.Bcast(half, root=0))

    def _store(self, version: int, fill) -> None:
        """Fill the spare half under its sequence lock, then make it current."""
        words = self._words
        spare = 0 if words[_CURRENT] != 0 else 1
        seq = _SEQ0 + spare
        words[seq] += 1            # odd: being written
        self.win.Sync()
        fill(self._halves[spare])
        self.win.Sync()
        words[_VER0 + spare] = version
        words[seq] += 1            # even: consistent
        self.win.Sync()
        words[_CURRENT] = spare
        words[_NEWEST] = version
        self.win.Sync()

    def _mark_finished(self) -> None:
        self.win.Sync()
        self._words[_FINISHED] = 1
        self.win.Sync()

    # ------------------------------------------------------------ readers
    def finished(self) -> bool:
        """True once the root stopped publishing (the run is over); never blocks."""
        self._raise_thread_error()
        self.win.Sync()
        return self.has_window and bool(self._words[_FINISHED])

    def latest_version(self) -> int:
        """Newest version available on this node (-1 if none yet); never blocks."""
        self._raise_thread_error()
        if not self.has_window:
            raise RuntimeError("this node runs no inference rank, so it holds no weight copy")
        self.win.Sync()
        return int(self._words[_NEWEST])

    def read_into(self, out: np.ndarray) -> int:
        """Copy the newest version into `out` (uint8, nbytes); returns its version, -1 if none."""
        out = out.view(np.uint8)
        while True:
            self.win.Sync()
            current = int(self._words[_CURRENT])
            if current < 0:
                return -1
            before = int(self._words[_SEQ0 + current])
            if before % 2 == 0:
                self.win.Sync()
                version = int(self._words[_VER0 + current])
                np.copyto(out, self._halves[current])
                self.win.Sync()
                if int(self._words[_SEQ0 + current]) == before:
                    return version
            # the writer lapped us: retry (rare; it writes the other half first)

    def wait_for(self, version: int, timeout: float | None = None) -> None:
        """Wait (back-off) until `version` or a newer one is on this node."""
        wait_until(lambda: self.latest_version() >= version, f"weight version {version}",
                   timeout, cap=5e-4)

    # ------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """Root: send what is pending, then tell every node the run is over (`finished()`)."""
        if self.is_root and not self._stopping:
            with self._lock:
                self._stopping = True
                self._lock.notify()
            self._thread.join()

    def close(self) -> None:
        """Collective over all ranks that built the plane: stop the threads, free windows."""
        self.stop()
        if self._thread is not None:
            self._thread.join()
            self._control.Free()
            self._thread = None
        self._raise_thread_error()
        idle_barrier(self.node)  # nobody reads the window any more
        self.win.Unlock_all()
        self.win.Free()

    def _guard(self, loop) -> None:
        """A failed control-plane thread takes the job down: peers would wait for it forever."""
        try:
            loop()
        except BaseException as err:  # noqa: BLE001
            self._error = err
            print(f"hpcvla: weight plane thread of rank {MPI.COMM_WORLD.Get_rank()} failed: "
                  f"{err!r}", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(1)

    def _raise_thread_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"weight plane thread failed: {self._error!r}") from self._error
