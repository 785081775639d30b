"""AllReduce(SUM) through shared memory for CPU ranks on one host.

MindSpore's CPU collectives run over TCP and cost CPU time in proportion to the bytes (`docs/performance.md`,
"gradient sums in shared memory"). Ranks on one host can sum through shared memory instead: each member writes its
tensor into a file of its own under /dev/shm, the members wait for each other, and each adds the members' tensors in
the same order (so every member gets the same bits).

A member's files are unlinked as soon as every peer has them open, so a killed job leaves nothing behind. Waiting
uses one FIFO per ordered pair of members: the token write and read are system calls, which also order the shared
memory between them. Calls of one group must come in the same order on every member (as for any collective); each
call's header (sequence number, size, dtype) is checked, so a mismatch is an error rather than a wrong sum.

`open_groups({name: ranks}, rank, barrier)` makes and connects the groups (every member calls it at the same point)
and returns them; `all_reduce_op(group)` is then an in-graph op (a MindSpore `pyfunc` Custom op) for one of them.
Nothing is registered here: whoever builds a cell that sums through a group is handed the group.
"""
from __future__ import annotations

import atexit
import mmap
import os
import select
from collections.abc import Mapping

import numpy as np

ROOT = "/dev/shm"
CHUNK_BYTES = 8 * 2**20  # larger tensors go through in chunks: a member maps 2 slots of this per member (resident)
HEADER_BYTES = 64
TIMEOUT_S = 600.0  # a peer that never comes (msrun kills a job whose worker died; this catches the rest)
_MAGIC = 0x6D696E64726C6866  # "mindrlhf"
_DTYPES = {np.dtype(np.float32): 1, np.dtype(np.float16): 2, np.dtype(np.int32): 3, np.dtype(np.float64): 4,
           np.dtype(np.int64): 5}


class CollectiveError(RuntimeError):
    """The members of a shared-memory group disagree (another call, shape or dtype) or one did not come."""


def available() -> bool:
    """Whether this host has the shared-memory folder and FIFOs the groups use."""
    return os.path.isdir(ROOT) and hasattr(os, "mkfifo")


def job_key() -> str:
    """What tells this job's files from another job's on the host: msrun's scheduler address."""
    return f"{os.environ.get('MS_SCHED_HOST', 'local')}-{os.environ.get('MS_SCHED_PORT', os.getppid())}"


class SharedMemoryGroup:
    """One member's side of a group of ranks on this host (`ranks`, this process being `rank`)."""

    def __init__(self, name: str, ranks: list[int], rank: int, key: str | None = None):
        self.name, self.ranks = name, list(ranks)
        self.index, self.size = self.ranks.index(rank), len(self.ranks)
        self.folder = os.path.join(ROOT, f"mindrlhf-{key or job_key()}-{name}")
        self.sequence = 0
        self._incoming: dict[int, int] = {}
        self._outgoing: dict[int, int] = {}
        self._maps: dict[tuple[int, int, int], mmap.mmap] = {}
        self._created: list[tuple[str, int]] = []
        self.stage = "created"
        os.makedirs(self.folder, exist_ok=True)
        for peer in self.peers:
            path = self._fifo(peer, self.index)
            _unlink(path)  # left by a job killed during its set-up on the same scheduler port
            os.mkfifo(path, 0o600)
            self._incoming[peer] = os.open(path, os.O_RDWR)  # RDWR: never blocks, and the pipe always has a reader

    @property
    def peers(self) -> list[int]:
        return [i for i in range(self.size) if i != self.index]

    def _fifo(self, source: int, target: int) -> str:
        return os.path.join(self.folder, f"fifo.{source}.{target}")

    def connect(self) -> None:
        """Opens the FIFOs to the peers (after every member has made its own)."""
        for peer in self.peers:
            self._outgoing[peer] = os.open(self._fifo(self.index, peer), os.O_WRONLY)
        self.stage = "connected"

    def unlink_own(self) -> None:
        """Removes this member's FIFO names (after every member has opened them); the open pipes stay."""
        for peer in self.peers:
            _unlink(self._fifo(peer, self.index))
        self._remove_folder()
        self.stage = "ready"

    def _remove_folder(self) -> None:
        try:
            os.rmdir(self.folder)
        except OSError:  # a member's files are still there: whoever unlinks the last one removes it
            pass

    # ------------------------------------------------------------------ exchange
    def _slot(self, member: int, parity: int, nbytes: int) -> mmap.mmap:
        key = (member, parity, nbytes)
        if key not in self._maps:
            path = os.path.join(self.folder, f"slot.{member}.{parity}.{nbytes}")
            if member == self.index:
                fd = self._create_in_folder(path)
                os.ftruncate(fd, HEADER_BYTES + nbytes)
                self._created.append((path, self.sequence))
            else:
                try:
                    fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:
                    raise CollectiveError(f"shared-memory group {self.name}: member {self.ranks[member]} has no "
                                          f"{nbytes}-byte tensor at call {self.sequence}: the members' collectives "
                                          "differ in order or shape") from None
            try:
                self._maps[key] = mmap.mmap(fd, HEADER_BYTES + nbytes)
            finally:
                os.close(fd)
        return self._maps[key]

    def _create_in_folder(self, path: str, attempts: int = 100) -> int:
        """A new file of this member's in the group's folder, open for reading and writing. A peer removes the folder
        when it holds no file (`_remove_folder`), which can fall between making the folder and creating the file:
        then both are made again (once the file exists the folder stays)."""
        for _ in range(attempts):
            os.makedirs(self.folder, exist_ok=True)
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            except FileNotFoundError:
                continue
        raise CollectiveError(f"shared-memory group {self.name}: {self.folder} was removed {attempts} times while "
                              "this member created its tensor's file")

    def _wait_for_peers(self) -> None:
        for peer in self.peers:
            os.write(self._outgoing[peer], b"\x01")
        for peer in self.peers:
            ready, _, _ = select.select([self._incoming[peer]], [], [], TIMEOUT_S)
            if not ready:
                raise CollectiveError(f"shared-memory group {self.name}: member {self.ranks[peer]} did not reach call "
                                      f"{self.sequence} within {TIMEOUT_S:.0f} s")
            os.read(self._incoming[peer], 1)

    def _unlink_opened(self) -> None:
        """Unlinks own slot files every peer has mapped: those made in an earlier call (a peer that has reached this
        call's wait is done with the earlier ones)."""
        if not self._created:
            return
        keep = []
        for path, created in self._created:
            if created < self.sequence:
                _unlink(path)
            else:
                keep.append((path, created))
        self._created = keep
        if not keep:
            self._remove_folder()

    def _sum_chunk(self, flat: np.ndarray) -> None:
        """`flat` (a chunk of at most CHUNK_BYTES) becomes the members' sum of it."""
        sequence, nbytes = self.sequence, flat.nbytes
        parity = sequence & 1  # a member reuses a slot two calls later, when every peer has read it
        header = np.array([sequence, nbytes, _DTYPES[flat.dtype], _MAGIC], np.int64)
        my_slot = self._slot(self.index, parity, nbytes)
        my_slot[:HEADER_BYTES] = header.tobytes().ljust(HEADER_BYTES, b"\0")
        np.frombuffer(my_slot, flat.dtype, flat.size, HEADER_BYTES)[:] = flat
        self._wait_for_peers()
        self._unlink_opened()
        self.sequence += 1
        views = []
        for member in range(self.size):
            slot = self._slot(member, parity, nbytes)
            theirs = np.frombuffer(slot, np.int64, 4)
            if not np.array_equal(theirs, header):
                raise CollectiveError(f"shared-memory group {self.name}: member {self.ranks[member]} is at call "
                                      f"{theirs[0]} ({theirs[1]} bytes, dtype code {theirs[2]}), this member at call "
                                      f"{sequence} ({nbytes} bytes, dtype code {header[2]}): the members' "
                                      "collectives differ in order or shape")
            views.append(np.frombuffer(slot, flat.dtype, flat.size, HEADER_BYTES))
        np.add(views[0], views[1], out=flat)  # a group has 2+ members (`open_groups`); the sum in member order
        for view in views[2:]:
            np.add(flat, view, out=flat)

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The sum of every member's `x` (same shape and dtype on every member), the same on every member."""
        total = np.array(x, order="C")
        self.all_reduce_in_place(total)
        return total

    def all_reduce_in_place(self, x: np.ndarray) -> None:
        """`x` (C-contiguous, writable) becomes the sum of every member's `x`, a chunk at a time: no copy of `x` is
        made (the members' chunks are added from shared memory straight into it)."""
        if not (x.flags.c_contiguous and x.flags.writeable):
            raise CollectiveError(f"shared-memory group {self.name}: an in-place sum needs a C-contiguous, writable "
                                  "array")
        flat = self._checked_flat(x)
        step = max(1, CHUNK_BYTES // flat.itemsize)
        for start in range(0, flat.size, step):
            self._sum_chunk(flat[start:start + step])

    def _checked_flat(self, x: np.ndarray) -> np.ndarray:
        if self.stage != "ready":
            raise CollectiveError(f"shared-memory group {self.name}: set up incompletely ({self.stage}); call "
                                  "shared_memory.open_groups on every member")
        if x.dtype not in _DTYPES:
            raise CollectiveError(f"shared-memory group {self.name}: dtype {x.dtype} is not supported")
        return np.ascontiguousarray(x).reshape(-1)

    def close(self) -> None:
        for fd in list(self._incoming.values()) + list(self._outgoing.values()):
            try:
                os.close(fd)
            except OSError:
                pass
        for path, _ in self._created:
            _unlink(path)
        self._remove_folder()
        for slot in self._maps.values():
            try:
                slot.close()
            except BufferError:  # a numpy view still refers to it; the process is ending anyway
                pass
        self._incoming, self._outgoing, self._maps, self._created = {}, {}, {}, []


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def open_groups(members: Mapping[str, list[int]], rank: int, barrier, key: str | None = None
                ) -> dict[str, SharedMemoryGroup]:
    """Shared-memory groups, by name, for `members` (group name -> its ranks, all on this host; this process is
    `rank`, a member of each), connected and ready; a group of one rank is left out. Every rank of the job calls it
    at the same point, with the groups it is a member of; `barrier()` waits for every rank of the job. The groups
    are closed when the process ends (or by their `close()`)."""
    groups = {name: SharedMemoryGroup(name, ranks, rank, key) for name, ranks in members.items() if len(ranks) > 1}
    if not groups:
        return groups
    for group in groups.values():
        atexit.register(group.close)
    barrier()
    for group in groups.values():
        group.connect()
    barrier()
    for group in groups.values():
        group.unlink_own()
    return groups


def all_reduce_op(group: SharedMemoryGroup):
    """An in-graph AllReduce(SUM) over the shared-memory `group` (a `pyfunc` Custom op: the graph hands this process
    the tensor, the members sum it in shared memory). No gradient."""
    from mindspore import ops

    return ops.Custom(group.all_reduce, out_shape=lambda x: x, out_dtype=lambda x: x, func_type="pyfunc")
