"""Weight control plane: versioned weights from the learner root to every inference rank,
crossing the network once per node (D-VLA section 3.3).

    plane = WeightPlane(comms.control, comms.node, is_leader, manifest)
    plane.publish(version, tensors)     # learner root: returns at once, a thread sends it
    plane.latest_version()              # any rank on a node with a leader: never blocks
    version = plane.read_into(out)      # a consistent copy of the newest version
    version = plane.read_into(out, trainable_only=True)   # ... of what training changes

Path of one version: the root's background thread broadcasts (version, manifest hash, flat
buffer) on its own duplicate of the control communicator (root + one leader per node), so a
publish never blocks the data plane; each node leader's thread receives it straight into the
spare half of a double buffer in a node-shared window (`Win.Allocate_shared` on the node
communicator), then flips the "current" index. The root copies the version into its own
node's half while the broadcast is under way (an `Ibcast`, waited for after the copy, so the
copy hides behind the broadcast). Readers copy the current half under
a per-half sequence lock (odd while being written), retrying if it changed underneath, so a
reader never sees a half-written update. Versions only go up; a publish that finds the
previous one still in flight replaces the pending one (readers want the newest, not all).
(Copying straight into the root node's spare half and broadcasting from there saves a copy
but measured slower: a broadcast out of the shared window, racing that node's readers.)

Frozen parameters (a π0 whose vision-language prefix is frozen: most of its bytes) cross the
network once: the manifest names them (`frozen`), the first version a plane publishes is
whole, and every later one carries only the other tensors (RLinf's patch syncer sends only
trained parameters too), packed: the root copies them one after another into its buffer
(`Manifest.views(packed=True)`: no copy of the flat layout to pack) and each leader unpacks
them into its half, one memcpy, 2.5x (Open MPI) to 8x (MPICH) faster per GiB than a
broadcast of an MPI indexed datatype over their places (docs/results.md).
Every broadcast goes in pieces of at most `max_message` bytes (pieces.py: MPI-3 libraries
count in C ints, and Open MPI 4.1 refuses a 2^31-byte broadcast), all posted at once. Both
halves of a node's double buffer receive the whole first version, so a half being rewritten
always holds the frozen bytes, and readers copy only the trainable places after their first
read. A publish that replaces a pending whole version goes whole, written over it in the
flat layout (its frozen bytes are there).
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from hpcvla.process import deathwatch
from hpcvla.transport import pieces
from hpcvla.transport.backoff import Backoff, Reminder, idle_barrier, wait_until
from hpcvla.transport.manifest import Manifest
from hpcvla.transport.records import aligned
from hpcvla.transport.windows import allocate_shared, window_bytes

if TYPE_CHECKING:
    import torch

# node window header, int64 words
_SEQ0, _SEQ1, _VER0, _VER1, _CURRENT, _NEWEST, _FINISHED = range(7)
_HEADER_BYTES = 64
_STOP = -1


class WeightPlane:
    """Create collectively on every rank: `control` is the control-plane communicator (root =
    rank 0; COMM_NULL elsewhere), `node` this rank's node communicator, `is_leader` whether
    this rank is its node's leader (receives for the node). `max_message`: the most bytes
    one broadcast call moves (pieces.py; tests make it small)."""

    def __init__(self, control: MPI.Comm, node: MPI.Comm, is_leader: bool, manifest: Manifest,
                 max_message: int = pieces.MAX_MESSAGE, who: str = ""):
        self.manifest, self.nbytes = manifest, manifest.nbytes
        self.who = who or f"rank {MPI.COMM_WORLD.Get_rank()} (host {MPI.Get_processor_name()})"
        self.is_root = control != MPI.COMM_NULL and control.Get_rank() == 0
        self.is_leader = is_leader
        self.node = node
        # Node window: the leader allocates the header and both halves; nodes without a
        # leader (learner-only) allocate nothing.
        leader = node.allreduce(node.Get_rank() if is_leader else -1, op=MPI.MAX)  # [dist]
        self.has_window = leader >= 0
        half = aligned(self.nbytes)
        size = _HEADER_BYTES + 2 * half if is_leader else 0
        self.win = allocate_shared(size, node, "the weight plane's node window (two copies of "
                                   "the weights)")  # [dist]
        if self.has_window:
            buf, _ = self.win.Shared_query(leader)
            memory = window_bytes(buf)
            self._words = memory[:_HEADER_BYTES].view(np.int64)
            self._halves = [memory[_HEADER_BYTES + i * half:_HEADER_BYTES + i * half
                                   + self.nbytes] for i in (0, 1)]
            if is_leader:
                self._words[:] = 0
                self._words[_CURRENT] = self._words[_NEWEST] = -1
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.win.Sync()  # the leader's header stores before the barrier (MPI-3.1 11.7)
        node.Barrier()  # [dist]

        self._control = control.Dup() if control != MPI.COMM_NULL else MPI.COMM_NULL  # [dist]
        self._header = np.zeros(3, np.int64)  # version (or _STOP), manifest hash, whole?
        self._max_message = max_message
        # the trainable places of the flat layout, packed for versions after the first
        # (nothing frozen, or nothing trainable: every version is whole)
        self._regions = manifest.regions(manifest.trainable)
        self._packs = bool(manifest.frozen and self._regions)
        # what one version after the first moves (the first moves nbytes)
        self.bytes_per_version = sum(n for _, n in self._regions) if self._packs \
            else self.nbytes
        # where a leader receives a packed version (the root packs into its own buffers)
        self._packed = np.empty(self.bytes_per_version if self._packs and not self.is_root
                                and control != MPI.COMM_NULL else 0, np.uint8)
        self._lock = threading.Condition()
        self._pending: int | None = None   # version waiting in _staging
        self._pending_whole = False  # it carries every tensor (the plane's first version)
        self._in_flight = False  # the root's thread is sending (or storing) a version
        self._stopping = False
        self._last_published = -1
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if self._control != MPI.COMM_NULL:
            target = self._send_loop if self.is_root else self._receive_loop
            if self.is_root:  # publish() fills one while the thread sends the other
                self._staging = np.zeros(self.nbytes, np.uint8)
                self._sending = np.zeros(self.nbytes, np.uint8)
            self._thread = threading.Thread(target=self._guard, args=(target,),
                                            name="hpcvla-weights", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ learner root
    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Queue `tensors` (the manifest's names, on any device) as `version`; returns after
        one copy into a host buffer: of every tensor the first time, then of the trainable."""
        self._raise_thread_error()
        if not self.is_root:
            raise RuntimeError("only the weight root (learner 0) publishes weights")
        if version <= self._last_published:
            raise ValueError(f"version {version} after {self._last_published}: versions must "
                             "increase")
        first = self._last_published < 0
        with self._lock:  # the sender only holds the lock to swap buffers, never while sending
            # whole: the first version; every one where nothing packs (all of it copied);
            # one that replaces a pending whole version, whose frozen bytes staging holds
            whole = first or not self._packs or self._pending_whole
            self.manifest.flatten(tensors, self._staging,
                                  None if first or not self._packs else self.manifest.trainable,
                                  packed=not whole)
            self._pending_whole = whole
            self._pending = version
            self._last_published = version
            self._lock.notify()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending is not None or self._stopping)
                if self._pending is None:  # stopping, and everything published was sent
                    version, whole = _STOP, False
                else:
                    version, self._pending = self._pending, None
                    whole, self._pending_whole = self._pending_whole, False
                    self._staging, self._sending = self._sending, self._staging
                    self._in_flight = True
            self._header[:] = (version, self.manifest.hash, whole)
            # Ibcast: leaders wait for headers with a nonblocking broadcast, and a nonblocking
            # collective only matches a nonblocking one.
            self._control.Ibcast(self._header, root=0).Wait()  # [dist]
            if version == _STOP:
                if self.is_leader:
                    self._mark_finished()
                return
            # whole in the flat layout, or the trainable tensors packed at its start
            sent = self._sending if whole else self._sending[:self.bytes_per_version]
            requests = pieces.ibcast(self._control, sent, 0, self._max_message)  # [dist]
            if self.is_leader:  # the root's own node, while the leaders receive
                self._store(version, whole, lambda half: self._unpack(sent, half, whole))
            MPI.Request.Waitall(requests)
            with self._lock:
                self._in_flight = False

    def sent(self) -> bool:
        """Root: whether every version published so far has been sent: none pending, and
        the root's side of its broadcast complete (a learner that must not race ahead waits
        on this asleep); never blocks."""
        self._raise_thread_error()
        with self._lock:
            return self._pending is None and not self._in_flight

    # ------------------------------------------------------------ node leaders
    def _receive_loop(self) -> None:
        while True:
            request = self._control.Ibcast(self._header, root=0)  # [dist]
            backoff = Backoff(cap=5e-4, what="the next weight version")
            while not request.Test():  # idle wait that does not burn a core
                backoff.wait()
            version, digest = int(self._header[0]), int(self._header[1])
            whole = bool(self._header[2])
            if version == _STOP:
                self._mark_finished()
                return
            if digest != self.manifest.hash:
                raise RuntimeError(f"weight manifest mismatch: root sends hash {digest:#x}, "
                                   f"this rank expects {self.manifest.hash:#x} (the same "
                                   f"policy, dtype and frozen parameters on every rank)")
            self._store(version, whole, lambda half: self._receive(half, whole))

    def _receive(self, half: np.ndarray, whole: bool) -> None:
        """Leader: one version into `half`, all of it or its trainable places. Ibcast, not
        Bcast: the root's is nonblocking, and MPI matches a nonblocking collective only with
        nonblocking ones."""
        MPI.Request.Waitall(pieces.ibcast(self._control, half if whole else self._packed, 0,
                                          self._max_message))  # [dist]
        if not whole:
            self._unpack(self._packed, half, whole)

    def _unpack(self, version: np.ndarray, half: np.ndarray, whole: bool) -> None:
        """A version as broadcast into a node's `half`: whole, or its packed trainable
        places each to its place in the flat layout."""
        if whole:
            np.copyto(half, version)
            return
        at = 0
        for offset, n in self._regions:
            half[offset:offset + n] = version[at:at + n]
            at += n

    def _copy(self, out: np.ndarray, flat: np.ndarray, whole: bool) -> None:
        if whole or not self._packs:
            np.copyto(out, flat)
        else:
            for offset, n in self._regions:
                out[offset:offset + n] = flat[offset:offset + n]

    def _store(self, version: int, whole: bool, fill: Callable[[np.ndarray], None]) -> None:
        """Fill the spare half under its sequence lock, then make it current. The first
        version fills both halves: later ones rewrite only the trainable places."""
        words = self._words
        first = words[_CURRENT] < 0
        if first and not whole and self._packs:  # publish() rules it out
            raise RuntimeError("the first weight version on this node lacks the frozen tensors")
        spare = 0 if words[_CURRENT] != 0 else 1
        seq = _SEQ0 + spare
        words[seq] += 1            # odd: being written
        self.win.Sync()
        fill(self._halves[spare])
        if first:  # nobody reads yet
            np.copyto(self._halves[1 - spare], self._halves[spare])
        words[_VER0 + spare] = version  # ordered before the even count below (weakly
        self.win.Sync()                 # ordered CPUs): a reader that sees it sees this
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

    def read_into(self, out: np.ndarray, trainable_only: bool = False) -> int:
        """Copy the newest version into `out` (uint8, nbytes), or only its trainable places
        (`out` holds the frozen ones from an earlier read); returns its version, -1 if none."""
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
                self._copy(out, self._halves[current], not trainable_only)
                self.win.Sync()
                if int(self._words[_SEQ0 + current]) == before:
                    return version
            # the writer lapped us: retry (rare; it writes the other half first)

    def wait_for(self, version: int, timeout: float | None = None,
                 remind: Reminder | None = None) -> None:
        """Wait (back-off) until `version` or a newer one is on this node; `remind`: say so
        while it takes long (transport/backoff.wait_until)."""
        wait_until(lambda: self.latest_version() >= version, f"weight version {version}",
                   timeout, cap=5e-4, remind=remind)

    # ------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """Root: send what is pending, then tell every node the run is over (`finished()`)."""
        if self.is_root and not self._stopping:
            with self._lock:
                self._stopping = True
                self._lock.notify()
            assert self._thread is not None  # the root's sender, started with the plane
            self._thread.join()

    def close(self) -> None:
        """Collective over all ranks that built the plane: stop the threads, free windows."""
        self.stop()
        if self._thread is not None:
            self._thread.join()
            self._control.Free()  # [dist]
            self._thread = None
        self._raise_thread_error()
        idle_barrier(self.node)  # [dist] nobody reads the window any more
        self.win.Unlock_all()
        self.win.Free()  # [dist]

    def _guard(self, loop: Callable[[], None]) -> None:
        """A failed control-plane thread takes the job down: peers would wait for it forever."""
        try:
            loop()
        except BaseException as err:  # noqa: BLE001
            self._error = err
            deathwatch.abort_world(MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank(),
                                   f"hpcvla: {self._failure_words()}", 1,
                                   traceback.format_exc())

    def _raise_thread_error(self) -> None:
        # the rank's main thread may see the error before the thread's own abort has run:
        # whichever ends the world says the same words
        if self._error is not None:
            raise RuntimeError(self._failure_words()) from self._error

    def _failure_words(self) -> str:
        return f"the weight plane thread of {self.who} failed: {self._error!r}"
