"""Online resharding: move a network's weights into another network with a different layout, in memory.

Plan (pure layout arithmetic, :func:`plan_reshard`): for every destination parameter, this rank needs
the region of the full tensor its destination layout gives it. The ranks that hold the distinct shards
of the source parameter exactly once (the source *group*: ranks that differ only on the device axes the
parameter is split over) can provide any region. If every member of the group already holds the region
it needs, the move is a local slice. Otherwise the group AllReduce(SUM)s a buffer covering the union
(bounding box) of the members' needs, each member filling in the part of its shard that falls inside
and zeros elsewhere; the sum is exact because the shards are disjoint.

Only AllReduce(SUM) is used, which works on sub-groups on every backend (CPU has no Send/Recv,
ReduceScatter or AlltoAll, and AllGather only on the world group). Buffers of one group are packed into
size-bounded buckets, so the memory peak stays near one bucket; values are cast to the destination dtype
before they travel when that is exact (fp32 -> fp16 zero-padded sums are), else after.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops

from mindrlhf.parallel.layout import NOT_SPLIT, ensure_group
from mindrlhf.parallel.strategy import ParamLayout, StrategyError, read_strategy_file, validate_pair

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


Region = tuple[slice, ...]


def intersect(a: Region, b: Region) -> Region | None:
    """Intersection of two boxes, or None when empty."""
    out = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
    return None if any(s.start >= s.stop for s in out) else out


def contains(outer: Region, inner: Region) -> bool:
    return all(o.start <= i.start and i.stop <= o.stop for o, i in zip(outer, inner))


def bounding_box(regions: list[Region]) -> Region:
    return tuple(slice(min(r[d].start for r in regions), max(r[d].stop for r in regions))
                 for d in range(len(regions[0])))


def relative(region: Region, origin: Region) -> Region:
    """`region` in the coordinates of box `origin` (which contains it)."""
    return tuple(slice(r.start - o.start, r.stop - o.start) for r, o in zip(region, origin))


def region_size(region: Region) -> int:
    return math.prod(s.stop - s.start for s in region)


def source_group(layout: ParamLayout, rank: int) -> tuple[int, ...]:
    """Ranks that, with `rank`, hold every shard of the parameter exactly once (same replica coordinates)."""
    split_axes = {layout._device_axis(m) for m in layout.tensor_map if m != NOT_SPLIT}  # pylint: disable=protected-access
    mine = layout.device_coords(rank)
    return tuple(r for r in range(layout.world_size)
                 if all(c == m for i, (c, m) in enumerate(zip(layout.device_coords(r), mine)) if i not in split_axes))


@dataclass(frozen=True)
class Move:
    """How this rank obtains destination parameter `dst_name` (its region `dst_region`) from `src_name`."""

    src_name: str
    dst_name: str
    group: tuple[int, ...]          # ranks in the AllReduce; () = local slice, no communication
    buffer_region: Region           # region of the full tensor the buffer carries (or this rank's source shard)
    contribution: Region | None     # part of this rank's source shard inside the buffer (full-tensor coords)
    src_region: Region              # this rank's source shard (full-tensor coords)
    dst_region: Region              # this rank's destination shard (full-tensor coords)

    @property
    def buffer_elements(self) -> int:
        return region_size(self.buffer_region) if self.group else 0


def plan_reshard(src_layouts: Mapping[str, ParamLayout], dst_layouts: Mapping[str, ParamLayout],
                 pairs: Mapping[str, str], rank: int) -> list[Move]:
    """One Move per destination parameter (`pairs`: dst name -> src name), in a rank-independent order."""
    moves = []
    for dst_name in sorted(pairs):
        src, dst = src_layouts[pairs[dst_name]], dst_layouts[dst_name]
        group = source_group(src, rank)
        needs = {m: dst.slice_of(m) for m in group}
        holds = {m: src.slice_of(m) for m in group}
        local = all(contains(holds[m], needs[m]) for m in group)
        buffer = holds[rank] if local else bounding_box(list(needs.values()))
        moves.append(Move(
            src_name=src.name, dst_name=dst_name, group=() if local else group, buffer_region=buffer,
            contribution=None if local else intersect(holds[rank], buffer),
            src_region=holds[rank], dst_region=needs[rank]))
    return moves


@dataclass
class Bucket:
    group: tuple[int, ...]
    moves: list[Move] = field(default_factory=list)
    elements: int = 0


def make_buckets(moves: list[Move], bucket_elements: int) -> list[Bucket]:
    """Packs communicating moves per group into buckets of at most `bucket_elements` (a bigger move gets its own)."""
    buckets: list[Bucket] = []
    open_bucket: dict[tuple[int, ...], Bucket] = {}
    for move in moves:
        if not move.group:
            continue
        bucket = open_bucket.get(move.group)
        if bucket is None or (bucket.moves and bucket.elements + move.buffer_elements > bucket_elements):
            bucket = Bucket(move.group)
            buckets.append(bucket)
            open_bucket[move.group] = bucket
        bucket.moves.append(move)
        bucket.elements += move.buffer_elements
    # Every rank runs the collectives in one global order (by group, then creation) so none waits forever.
    return sorted(buckets, key=lambda b: b.group)


class _GroupAllReduce(nn.Cell):
    def __init__(self, group: str):
        super().__init__()
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, group)

    def construct(self, x):
        return self.all_reduce(x)


@dataclass
class ReshardStats:
    """What one reshard did on this rank."""

    parameters: int = 0
    local_copies: int = 0
    buckets: int = 0
    bytes_sent: int = 0        # bytes this rank put into collectives
    seconds: float = 0.0

    def __str__(self):
        return (f"{self.parameters} params ({self.local_copies} local), {self.buckets} buckets, "
                f"{self.bytes_sent / 2**20:.1f} MiB through collectives, {self.seconds:.3f}s")


def _as_layouts(strategy, what: str) -> dict[str, ParamLayout]:
    if isinstance(strategy, Mapping):
        return dict(strategy)
    if isinstance(strategy, (str, os.PathLike)):
        return read_strategy_file(strategy)
    raise StrategyError(f"{what} strategy must be a strategy file path or a dict of ParamLayout, "
                        f"got {type(strategy).__name__}")


def _with_net_shapes(layouts: dict[str, ParamLayout], net: nn.Cell, what: str) -> dict[str, ParamLayout]:
    """Completes full shapes from the net's local shapes, checking they agree with the strategy."""
    params = {p.name: p for p in net.get_parameters()}
    out = {}
    for name, lay in layouts.items():
        if name not in params:
            continue
        full = lay.full_shape_from_local(params[name].shape)
        if lay.full_shape is not None and tuple(lay.full_shape) != tuple(full):
            raise StrategyError(f"{what} parameter '{name}': network shard {list(params[name].shape)} does not "
                                f"match the strategy ({lay.describe()})")
        out[name] = lay.with_full_shape(full)
    missing = sorted(set(params) - set(layouts))
    if missing:
        raise StrategyError(f"{what} network parameters absent from its strategy: {', '.join(missing[:20])}")
    return out


class Resharder:
    """Moves `src_net`'s weights into `dst_net` (different layouts, same ranks); plan once, run every step."""

    def __init__(self, src_net: nn.Cell, dst_net: nn.Cell, src_strategy, dst_strategy,
                 name_map: Mapping[str, str] | None = None, rank: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        src_layouts = _with_net_shapes(_as_layouts(src_strategy, "source"), src_net, "source")
        dst_layouts = _with_net_shapes(_as_layouts(dst_strategy, "destination"), dst_net, "destination")
        pairs = validate_pair(src_layouts, dst_layouts, name_map, "source", "destination", allow_unused_src=False)
        world = next(iter(src_layouts.values())).world_size
        if rank is None:
            rank = 0
            if world > 1:
                from mindspore.communication import get_rank
                rank = get_rank()
        self.rank = rank
        self.world_size = world
        self.src_params = {p.name: p for p in src_net.get_parameters()}
        self.dst_params = {p.name: p for p in dst_net.get_parameters()}
        self.moves = plan_reshard(src_layouts, dst_layouts, pairs, rank)
        self.bucket_bytes = bucket_bytes
        self._reducers: dict[tuple[int, ...], _GroupAllReduce] = {}

    def _reducer(self, group: tuple[int, ...]) -> _GroupAllReduce:
        if group not in self._reducers:
            self._reducers[group] = _GroupAllReduce(ensure_group(list(group), self.world_size))
        return self._reducers[group]

    def _wire_dtype(self, moves: list[Move]):
        """float16 on the wire when every destination is float16 (exact for zero-padded sums), else float32."""
        dst_dtypes = {self.dst_params[m.dst_name].dtype for m in moves}
        return np.float16 if dst_dtypes == {ms.float16} else np.float32

    def _write(self, move: Move, values: np.ndarray) -> None:
        param = self.dst_params[move.dst_name]
        if tuple(values.shape) != tuple(param.shape):
            raise StrategyError(f"internal: {move.dst_name} got {values.shape}, expected {param.shape}")
        param.set_data(Tensor(np.ascontiguousarray(values), param.dtype))

    def run(self) -> ReshardStats:
        """Moves the weights; returns what this rank did."""
        start = time.perf_counter()
        stats = ReshardStats(parameters=len(self.moves))
        host_cache: dict[str, np.ndarray] = {}

        def src_values(name):
            if name not in host_cache:
                host_cache[name] = self.src_params[name].asnumpy()
            return host_cache[name]

        for move in self.moves:
            if not move.group:
                stats.local_copies += 1
                self._write(move, src_values(move.src_name)[relative(move.dst_region, move.src_region)])
        itemsize = max(np.dtype(self._wire_dtype(self.moves)).itemsize, 2)
        for bucket in make_buckets(self.moves, max(1, self.bucket_bytes // itemsize)):
            wire = self._wire_dtype(bucket.moves)
            buffer = np.zeros(bucket.elements, wire)
            offset = 0
            for move in bucket.moves:
                view = buffer[offset:offset + move.buffer_elements].reshape(
                    [s.stop - s.start for s in move.buffer_region])
                if move.contribution is not None:
                    view[relative(move.contribution, move.buffer_region)] = \
                        src_values(move.src_name)[relative(move.contribution, move.src_region)]
                offset += move.buffer_elements
            reduced = self._reducer(bucket.group)(Tensor(buffer)).asnumpy()
            stats.buckets += 1
            stats.bytes_sent += buffer.nbytes
            offset = 0
            for move in bucket.moves:
                view = reduced[offset:offset + move.buffer_elements].reshape(
                    [s.stop - s.start for s in move.buffer_region])
                self._write(move, view[relative(move.dst_region, move.buffer_region)])
                offset += move.buffer_elements
            del buffer, reduced
        stats.seconds = time.perf_counter() - start
        logger.info("reshard rank %d: %s", self.rank, stats)
        return stats


def reshard(src_net: nn.Cell, dst_net: nn.Cell, src_strategy, dst_strategy, name_map: Mapping[str, str] | None = None,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ReshardStats:
    """Copies `src_net`'s weights into `dst_net` online, from two strategy files (or layout dicts).

    `name_map` maps source parameter names to destination names (None = identical names); every
    parameter of both nets must be matched. Errors (unmatched names, different world sizes, shapes
    that disagree) are raised before any weight is touched. For repeated moves keep a `Resharder`.
    """
    return Resharder(src_net, dst_net, src_strategy, dst_strategy, name_map, bucket_bytes=bucket_bytes).run()
