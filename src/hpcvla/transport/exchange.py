"""Node-local observation/action exchange for one cell, through a shared-memory window.

Created collectively on a cell communicator (all ranks of one node: `Win.Allocate_shared`).
Comm rank `server` (the cell's inference rank) serves; every other rank is a simulator with
`shards` slots, one per env shard (with a one-rank communicator the server serves itself).
A slot is

    header (64 bytes): request (i8, written by the simulator), response (i8, by the server)
    observation: one `obs_dtype` item (a numpy structured dtype, e.g. image + state fields)
    action:      one `action_dtype` item

The simulator writes its observation straight into the slot (`obs(shard)` is a view),
bumps `request`; the server finds pending slots by scanning the request/response words,
reads observations in place, writes actions in place and sets `response = request`.
Each word has one writer, so plain aligned stores suffice; `Win.Sync` orders payload and
flag accesses. Waiting polls with back-off: it yields the core for the first DATA_SPIN
seconds (an answer usually comes sooner than a sleep wakes up), then sleeps, so it does
not burn a core. A request rings the server's doorbell and an answer its simulator's, so a
sleep ends when the answer is in, and sleeps after the spin can be long from the first
(RUNG_*_CAP): a waiting rank wakes about once an answer, not every few tens to hundreds of
microseconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np
from mpi4py import MPI

from hpcvla.topology.comms import members
from hpcvla.transport.backoff import (DATA_POLL_CAP, DATA_SPIN, FIRST_SLEEP, RUNG_CLIENT_CAP,
                                     RUNG_SERVER_CAP, Backoff, wait_until)
from hpcvla.transport.doorbell import Doorbell
from hpcvla.transport.windows import allocate_shared, window_bytes
from hpcvla.transport.records import aligned

HEADER_BYTES = 64


class ObsActionExchange:
    def __init__(self, comm: MPI.Comm, shards: int, obs_dtype: np.dtype,
                 action_dtype: np.dtype, server: int = 0, bells: bool = True):
        """`bells=False`: waits poll at DATA_POLL_CAP, nobody rings (the benchmark's
        baseline); a one-rank communicator (the server serves itself) has none."""
        self.comm, self.server, self.shards = comm, server, shards
        self.obs_dtype, self.action_dtype = np.dtype(obs_dtype), np.dtype(action_dtype)
        rank, size = comm.Get_rank(), comm.Get_size()
        self.clients = [r for r in range(size) if r != server] or [server]
        self.n_slots = len(self.clients) * shards
        self._obs_at = HEADER_BYTES
        self._act_at = HEADER_BYTES + aligned(self.obs_dtype.itemsize)
        self.slot_bytes = self._act_at + aligned(self.action_dtype.itemsize)
        total = self.n_slots * self.slot_bytes if rank == server else 0
        self.win = allocate_shared(total, comm, "the observation/action exchange")  # [dist]
        buf, _ = self.win.Shared_query(server)
        memory = window_bytes(buf).reshape(self.n_slots, self.slot_bytes)
        if rank == server:
            memory[:, :HEADER_BYTES] = 0
        self._memory = memory
        flags = memory[:, :16].view(np.int64)         # (n_slots, 2): request, response
        self._request, self._response = flags[:, 0], flags[:, 1]
        self._served = np.zeros(self.n_slots, np.int64)  # server: request handed out last
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.win.Sync()  # the server's zeroed flags before the barrier below (MPI-3.1 11.7)
        self.bell = Doorbell.on(comm, self.clients if rank == server else [server]) \
            if bells and size > 1 else None  # [dist] (collective; its barrier is the window's)
        # a wait's sleeps: with bells, each as long as any from the first (a ring ends it)
        self.poll_cap = DATA_POLL_CAP if not self.bell else RUNG_SERVER_CAP \
            if rank == server else RUNG_CLIENT_CAP
        self._first_sleep = self.poll_cap if self.bell else FIRST_SLEEP
        # sleep `seconds`, or less when this rank's bell rings
        self.sleep: Callable[[float], object] = self.bell.wait if self.bell else time.sleep
        if not self.bell:
            comm.Barrier()  # [dist]

    def world_ranks(self, slots: Iterable[int]) -> list[int]:
        """The world ranks of the simulators that own `slots` (for messages)."""
        world = members(self.comm)  # local: the groups translated, then freed
        return [world[rank] for rank in sorted({self.clients[slot // self.shards]
                                                for slot in slots})]

    def backoff(self) -> Backoff:
        """How a role's loop that waits on this exchange (among other things) sleeps."""
        return Backoff(self._first_sleep, self.poll_cap, sleep=self.sleep)

    def slot_of(self, shard: int, rank: int | None = None) -> int:
        rank = self.comm.Get_rank() if rank is None else rank
        return self.clients.index(rank) * self.shards + shard

    # ------------------------------------------------------------- simulator side
    def obs(self, shard: int) -> np.void:
        """This shard's observation slot, to be written in place (a structured scalar view)."""
        return self._obs_view(self.slot_of(shard))

    def submit(self, shard: int) -> None:
        """The observation of `shard` is written: ask for actions."""
        slot = self.slot_of(shard)
        self.win.Sync()  # the observation is visible before the request
        self._request[slot] += 1
        self.win.Sync()
        if self.bell:
            self.bell.ring(self.server)

    def actions_ready(self, shard: int) -> bool:
        slot = self.slot_of(shard)
        self.win.Sync()
        return bool(self._response[slot] == self._request[slot])

    def actions(self, shard: int, timeout: float | None = None) -> np.void:
        """Wait (back-off) for the answer to this shard's request; a view of the actions."""
        wait_until(lambda: self.actions_ready(shard), f"actions for shard {shard}", timeout,
                   cap=self.poll_cap, spin=DATA_SPIN, sleep=self.sleep, first=self._first_sleep)
        self.win.Sync()
        return self._act_view(self.slot_of(shard))

    # ------------------------------------------------------------- server side
    def pending(self) -> list[int]:
        """Slots with a request not handed out before (each request is returned once)."""
        self.win.Sync()
        request = self._request.copy()
        self.win.Sync()  # the flags read before the observations they publish (`_gather`)
        new = np.nonzero((request > self._response) & (request > self._served))[0]
        self._served[new] = request[new]
        return new.tolist()

    def wait_pending(self, timeout: float | None = None) -> list[int]:
        return wait_until(self.pending, "an observation request", timeout, cap=self.poll_cap,
                          spin=DATA_SPIN, sleep=self.sleep, first=self._first_sleep)

    def request_obs(self, slot: int) -> np.void:
        return self._obs_view(slot)

    def request_actions(self, slot: int) -> np.void:
        """The action slot to fill in place before `respond(slot)`."""
        return self._act_view(slot)

    def respond(self, slot: int) -> None:
        self.win.Sync()  # actions visible before the response
        self._response[slot] = self._served[slot]
        self.win.Sync()
        if self.bell:
            self.bell.ring(self.clients[slot // self.shards])

    # ------------------------------------------------------------- both
    def _obs_view(self, slot: int) -> np.void:
        raw = self._memory[slot, self._obs_at:self._obs_at + self.obs_dtype.itemsize]
        view: np.void = raw.view(self.obs_dtype)[0]  # a structured scalar, in place
        return view

    def _act_view(self, slot: int) -> np.void:
        raw = self._memory[slot, self._act_at:self._act_at + self.action_dtype.itemsize]
        view: np.void = raw.view(self.action_dtype)[0]
        return view

    def free(self) -> None:
        """Collective: release the shared window."""
        if self.win != MPI.WIN_NULL:
            del self._memory, self._request, self._response  # no view outlives the window
            self.win.Unlock_all()
            self.win.Free()  # [dist]
            if self.bell:
                self.bell.close()
