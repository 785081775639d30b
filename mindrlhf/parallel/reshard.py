"""Online resharding: move a network's weights into another network with a different layout, in memory.

Plan (pure layout arithmetic, :func:`plan_reshard`): for every destination parameter, this rank needs
the region of the full tensor its destination layout gives it. The ranks that hold the distinct shards
of the source parameter exactly once (the source *group*: ranks that differ only on the device axes the
parameter is split over) can provide any region. If every member of the group already holds the region
it needs, the move is a local slice. Otherwise the group exchanges a buffer covering the union
(bounding box) of the members' needs:

- when the group is the whole world (e.g. tp -> replicated, tp4 -> dp2 x tp2), every member sends its
  whole shard with AllGather and rebuilds the full tensor with a reshape/transpose; this moves half the
  bytes of an AllReduce and needs no zero padding;
- otherwise (a sub-group: AllGather is world-only on CPU) the members AllReduce(SUM) the buffer, each
  filling in the part of its shard that falls inside and zeros elsewhere; the sum is exact because the
  shards are disjoint.

CPU has no Send/Recv, ReduceScatter or AlltoAll, so nothing else is used. Moves of one group are packed
into size-bounded buckets, so the memory peak stays near one bucket. Each bucket is one compiled graph
(GRAPH_MODE): collectives, unpack, cast and `Assign` into the destination parameters, with no host round
trip. Inside a bucket, small messages share one collective call and every large one gets its own, on its
own contiguous tensor (`pack_below_bytes`). Values travel in the destination dtype when it is narrower
than the source and the backend's collectives carry it (casting before or after a gather or a
zero-padded sum gives the same bits). CPU has no bfloat16 collectives and no bfloat16 `Assign`: bfloat16
destinations get float32 on the wire and are written with `set_data`.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import mindspore as ms
from mindspore import ParameterTuple, Tensor, nn, ops
from mindspore.communication import get_rank

from mindrlhf.parallel.layout import NOT_SPLIT, ensure_group
from mindrlhf.parallel.pipeline import gather_stage_layouts
from mindrlhf.parallel.strategy import ParamLayout, StrategyError, read_strategy_file, validate_pair

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
# Per-rank messages smaller than this share one collective call with the other small moves of their bucket.
PACK_BELOW_BYTES = 1024 * 1024


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


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in region)


def source_group(layout: ParamLayout, rank: int) -> tuple[int, ...]:
    """Ranks that, with `rank`, hold every shard of the parameter exactly once (same replica coordinates)."""
    split_axes = {layout.device_axis(m) for m in layout.tensor_map if m != NOT_SPLIT}
    my_coords = layout.device_coords(rank)
    return tuple(r for r in range(layout.world_size)
                 if all(c == m for i, (c, m) in enumerate(zip(layout.device_coords(r), my_coords))
                        if i not in split_axes))


@dataclass(frozen=True)
class Move:
    """How this rank obtains destination parameter `dst_name` (its region `dst_region`) from `src_name`."""

    src_name: str
    dst_name: str
    group: tuple[int, ...]          # ranks in the collective; () = local slice, no communication
    buffer_region: Region           # region of the full tensor the buffer carries (or this rank's source shard)
    contribution: Region | None     # part of this rank's source shard inside the buffer (full-tensor coords)
    src_region: Region              # this rank's source shard (full-tensor coords)
    dst_region: Region              # this rank's destination shard (full-tensor coords)

    @property
    def buffer_elements(self) -> int:
        return region_size(self.buffer_region) if self.group else 0


def plan_reshard(src_layouts: Mapping[str, ParamLayout], dst_layouts: Mapping[str, ParamLayout],
                 pairs: Mapping[str, str], rank: int,
                 src_stages: Mapping[str, tuple[int, int]] | None = None) -> list[Move]:
    """One Move per destination parameter (`pairs`: dst name -> src name), in a rank-independent order.

    `src_stages` (source name -> (pipeline stage, ranks per stage)) marks a source split into pipeline stages:
    its layout is that of its stage (stage-local ranks), and its parameter comes from that stage alone."""
    moves = []
    for dst_name in sorted(pairs):
        src, dst = src_layouts[pairs[dst_name]], dst_layouts[dst_name]
        if src_stages:
            moves.append(_move_from_stage(src, dst, dst_name, rank, *src_stages[src.name]))
            continue
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


def _move_from_stage(src: ParamLayout, dst: ParamLayout, dst_name: str, rank: int, stage: int,
                     stage_size: int) -> Move:
    """Every rank of the world needs its destination region of a parameter that only pipeline stage `stage`
    holds: the stage's first data-parallel replica contributes its shards to a zero-padded world AllReduce."""
    world = dst.world_size
    holders = {stage * stage_size + r: src.slice_of(r) for r in source_group(src, 0)}
    group = tuple(range(world))
    buffer = bounding_box([dst.slice_of(m) for m in group])
    my_region = holders.get(rank)
    return Move(src_name=src.name, dst_name=dst_name, group=group, buffer_region=buffer,
                contribution=intersect(my_region, buffer) if my_region else None, src_region=my_region or buffer,
                dst_region=dst.slice_of(rank))


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


def _chunks(moves: list[Move], max_elements: int) -> list[list[Move]]:
    """Consecutive runs of `moves` whose destination regions hold at most `max_elements` (a bigger one alone)."""
    chunks: list[list[Move]] = []
    size = 0
    for move in moves:
        elements = region_size(move.dst_region)
        if not chunks or (chunks[-1] and size + elements > max_elements):
            chunks.append([])
            size = 0
        chunks[-1].append(move)
        size += elements
    return chunks


# ------------------------------------------------------------------------------------------ graphs
def _on_cpu() -> bool:
    return ms.get_context("device_target") == "CPU"


def _wire_dtypes():
    """Dtypes the backend's collectives carry: CPU has no bfloat16 AllReduce/AllGather kernels."""
    return {ms.float32, ms.float16} if _on_cpu() else {ms.float32, ms.float16, ms.bfloat16}


def _assignable(dtype) -> bool:
    """Whether a graph can `Assign` into a parameter of `dtype` (CPU has no bfloat16 Assign kernel)."""
    return dtype != ms.bfloat16 or not _on_cpu()


def wire_dtype(src_dtypes, dst_dtypes, carried=None):
    """Narrowest exact dtype for values moving from `src_dtypes` to `dst_dtypes` (sets of MindSpore dtypes).

    A single destination dtype is exact whatever its width (gathers and zero-padded sums never round, so
    casting before the move equals casting after); a single source dtype is exact (no cast at all).
    Mixed dtypes on both sides travel as float32.
    """
    carried = _wire_dtypes() if carried is None else carried
    candidates = [next(iter(s)) for s in (set(dst_dtypes), set(src_dtypes)) if len(s) == 1]
    candidates = [d for d in candidates if d in carried]
    return min(candidates, key=lambda d: d.itemsize) if candidates else ms.float32


def _slice_args(region: Region, origin: Region) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """StridedSlice (begin, end, strides) taking `region` out of a tensor covering `origin`; None if all of it."""
    if region == origin:
        return None
    rel = relative(region, origin)
    return tuple(s.start for s in rel), tuple(s.stop for s in rel), (1,) * len(rel)


class _Step(nn.Cell):
    """One compiled graph: its inputs are the source shards of `moves` (aliases of the source parameters);
    it writes every destination region into its parameter with `Assign` (a copy, never an alias).

    Subclasses produce, for move i, a tensor covering `origins[i]` of the full tensor; `_emit` cuts this
    rank's destination region out of it, casts and assigns. Where the backend cannot assign the
    destination dtype, the value is returned instead (`returned` lists those moves in output order) and
    `Resharder.run` hands it to `set_data`. Per-move constants are tuples indexed inside unrolled loops:
    the graph is static.
    """

    collective = False

    def __init__(self, moves: list[Move], dst_params, origins: list[Region], src_dtypes, order=None):
        super().__init__(auto_prefix=False)
        self.count = len(moves)
        self.src_names = tuple(m.src_name for m in moves)
        self.dst_names = tuple(m.dst_name for m in moves)
        self.dst = ParameterTuple(dst_params)
        self.dst_dtypes = tuple(p.dtype for p in dst_params)
        cuts = [_slice_args(m.dst_region, origin) for m, origin in zip(moves, origins)]
        self.cut = tuple(c is not None for c in cuts)
        self.cut_args = tuple(c or ((), (), ()) for c in cuts)
        self.assigned = tuple(_assignable(p.dtype) for p in dst_params)
        # whether a returned value is new memory (else it may be the input itself, i.e. the source parameter)
        self.fresh = tuple(self.collective or cut or src != dst
                           for cut, src, dst in zip(self.cut, src_dtypes, self.dst_dtypes))
        order = tuple(range(self.count)) if order is None else order  # the order construct emits moves in
        self.returned = tuple(i for i in order if not self.assigned[i])
        self.bytes_sent = 0
        self.bytes_received = 0

    def _emit(self, i, value, done, outs):
        """Destination region of move i out of `value`, cast, then assigned (or appended to `outs`).

        `done` is a scalar the graph returns that depends on every Assign: a graph whose output does not
        depend on its Assigns may drop them.
        """
        if self.cut[i]:
            begin, end, strides = self.cut_args[i]
            value = ops.strided_slice(value, begin, end, strides)
        if value.dtype != self.dst_dtypes[i]:
            value = value.astype(self.dst_dtypes[i])
        if self.assigned[i]:
            return ops.depend(done, ops.assign(self.dst[i], value)), outs
        return done, outs + [value]


class _LocalStep(_Step):
    """Moves whose destination region lies in this rank's own shard: slice, cast, assign."""

    def __init__(self, moves: list[Move], dst_params, src_dtypes):
        super().__init__(moves, dst_params, [m.src_region for m in moves], src_dtypes)

    def construct(self, *srcs):
        done, outs = ops.zeros((), ms.int32), []
        for i in range(self.count):
            done, outs = self._emit(i, srcs[i], done, outs)
        return done, tuple(outs)


class _ExchangeStep(_Step):
    """A bucket of moves exchanged with one kind of collective (AllGather or AllReduce).

    Moves whose message (this rank's part, in the wire dtype) is under `pack_below_bytes` share one
    collective call (flattened and concatenated: per-call latency dominates small messages); every other
    move gets its own call on its own contiguous tensor, so large values are never sliced out of a packed
    buffer (a strided copy that MindSpore's CPU kernels make slow, especially in float16). Subclasses define
    `_send` (this rank's flat message for move i), `_collect` (the collective), `_piece` (move i's part of
    a packed result) and `_unpack` (a result -> the tensor covering its origin).
    """

    collective = True

    def __init__(self, moves: list[Move], dst_params, origins: list[Region], src_dtypes, wire, sizes: list[int],
                 pack_below_bytes: int):
        small = [i for i, size in enumerate(sizes) if size * wire.itemsize < pack_below_bytes]
        packed = tuple(small) if len(small) > 1 else ()
        solo = tuple(i for i in range(len(moves)) if i not in packed)
        super().__init__(moves, dst_params, origins, src_dtypes, order=packed + solo)
        self.packed, self.solo = packed, solo
        self.wire = wire
        self.sizes = tuple(sizes)
        self.pack_offsets = tuple(sum(self.sizes[k] for k in self.packed[:j]) for j in range(len(self.packed)))
        self.n_packed, self.n_solo = len(self.packed), len(self.solo)

    def _to_wire(self, value):
        if value.dtype != self.wire:
            value = value.astype(self.wire)
        return value

    def construct(self, *srcs):
        done, outs = ops.zeros((), ms.int32), []
        # Each collective call waits for the previous one's result: the graph may otherwise schedule
        # independent calls in any order, and ranks whose graphs differ (a rank that contributes nothing
        # sends constant zeros) would pair different calls.
        previous = done
        if self.n_packed > 0:
            parts = []
            for j in range(self.n_packed):
                i = self.packed[j]
                parts.append(self._send(i, srcs[i]))
            received = self._collect(ops.depend(ops.concat(parts), previous))
            previous = received
            for j in range(self.n_packed):
                i = self.packed[j]
                piece = self._piece(received, self.pack_offsets[j], self.sizes[i])
                done, outs = self._emit(i, self._unpack(i, piece), done, outs)
        for j in range(self.n_solo):
            i = self.solo[j]
            received = self._collect(ops.depend(self._send(i, srcs[i]), previous))
            previous = received
            done, outs = self._emit(i, self._unpack(i, received), done, outs)
        return done, tuple(outs)


class _GatherStep(_ExchangeStep):
    """A bucket exchanged over the whole world with AllGather.

    Each rank sends its whole shard of every move. The result holds rank r's message as row r; ranks run
    row-major over the source device matrix, so move i's rows reshaped to `grid_shape` =
    (*dev_matrix, *shard_shape) and transposed by `perm` (each split device axis just before the tensor
    dimension it splits) are the full tensor.
    """

    def __init__(self, moves: list[Move], dst_params, src_dtypes, src_layouts: list[ParamLayout], world: int, wire,
                 pack_below_bytes: int):
        full = [tuple(slice(0, n) for n in lay.full_shape) for lay in src_layouts]
        for move, region in zip(moves, full):
            if move.buffer_region != region or len(move.group) != world:
                raise StrategyError(f"internal: {move.dst_name} is not a whole-tensor move over the world")
        sizes = [math.prod(lay.local_shape) for lay in src_layouts]
        super().__init__(moves, dst_params, full, src_dtypes, wire, sizes, pack_below_bytes)
        self.all_gather = ops.AllGather()
        self.world = world
        grids, perms = zip(*(self._grid(lay) for lay in src_layouts))
        self.grid_shapes = tuple(grids)
        self.perms = tuple(perms)
        self.transpose = tuple(p != tuple(sorted(p)) for p in perms)
        self.full_shapes = tuple(lay.full_shape for lay in src_layouts)
        self.bytes_sent = sum(sizes) * wire.itemsize
        self.bytes_received = self.bytes_sent * world

    @staticmethod
    def _grid(lay: ParamLayout) -> tuple[tuple[int, ...], tuple[int, ...]]:
        ndev = len(lay.dev_matrix)
        device_axis = lay.device_axis
        split = [None if m == NOT_SPLIT else device_axis(m) for m in lay.tensor_map]
        unused = [a for a in range(ndev) if a not in split]  # all of size 1 when the group is the world
        perm = list(unused)
        for dim, axis in enumerate(split):
            if axis is not None:
                perm.append(axis)
            perm.append(ndev + dim)
        return tuple(lay.dev_matrix) + tuple(lay.local_shape), tuple(perm)

    def _send(self, i, src):
        return self._to_wire(src).reshape(-1)

    def _collect(self, message):
        return self.all_gather(message).reshape(self.world, -1)

    def _piece(self, received, start, size):
        return received[:, start:start + size]

    def _unpack(self, i, rows):
        grid = rows.reshape(self.grid_shapes[i])
        if self.transpose[i]:
            grid = grid.transpose(self.perms[i])
        return grid.reshape(self.full_shapes[i])


class _ReduceStep(_ExchangeStep):
    """A bucket exchanged within a sub-group with AllReduce(SUM) of zero-padded contributions."""

    def __init__(self, moves: list[Move], dst_params, src_dtypes, group: str, wire, pack_below_bytes: int):
        sizes = [m.buffer_elements for m in moves]
        super().__init__(moves, dst_params, [m.buffer_region for m in moves], src_dtypes, wire, sizes,
                         pack_below_bytes)
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, group)
        self.buffer_shapes = tuple(region_shape(m.buffer_region) for m in moves)
        self.contributes = tuple(m.contribution is not None for m in moves)
        takes = [_slice_args(m.contribution, m.src_region) if m.contribution else None for m in moves]
        self.take = tuple(t is not None for t in takes)
        self.take_args = tuple(t or ((), (), ()) for t in takes)
        pads = [self._paddings(m) for m in moves]
        self.pad = tuple(any(p) for p in pads)
        self.paddings = tuple(pads)
        self.bytes_sent = self.bytes_received = sum(sizes) * wire.itemsize

    @staticmethod
    def _paddings(move: Move) -> tuple[int, ...]:
        """ops.pad amounts (last dimension first) placing the contribution inside the buffer."""
        if move.contribution is None:
            return ()
        flat = []
        for c, b in reversed(list(zip(move.contribution, move.buffer_region))):
            flat += [c.start - b.start, b.stop - c.stop]
        return tuple(flat)

    def _send(self, i, src):
        if not self.contributes[i]:
            return ops.zeros((self.sizes[i],), self.wire)
        part = src
        if self.take[i]:
            begin, end, strides = self.take_args[i]
            part = ops.strided_slice(part, begin, end, strides)
        part = self._to_wire(part)
        if self.pad[i]:
            part = ops.pad(part, self.paddings[i])
        return part.reshape(-1)

    def _collect(self, message):
        return self.all_reduce(message)

    def _piece(self, received, start, size):
        return received[start:start + size]

    def _unpack(self, i, flat):
        return flat.reshape(self.buffer_shapes[i])


@dataclass
class ReshardStats:
    """What one reshard did on this rank."""

    parameters: int = 0
    local_copies: int = 0
    buckets: int = 0
    bytes_sent: int = 0        # bytes this rank put into collectives
    seconds: float = 0.0
    bytes_received: int = 0    # bytes the collectives returned to this rank

    def __str__(self):
        return (f"{self.parameters} params ({self.local_copies} local), {self.buckets} buckets, "
                f"{self.bytes_sent / 2**20:.1f} MiB sent / {self.bytes_received / 2**20:.1f} MiB received "
                f"through collectives, {self.seconds:.3f}s")


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
    """Moves `src_net`'s weights into `dst_net` (different layouts, same ranks); plan once, run every step.

    Construction plans the moves and builds one graph per bucket; the first `run()` compiles them, later
    runs reuse them. `bucket_bytes` bounds what one graph moves (its memory peak); moves whose per-rank
    message is under `pack_below_bytes` share a collective call within their bucket (a performance knob;
    tests shrink it to cover both paths).

    A source split into pipeline stages (`src_pipeline`, its `Layout` with pp > 1; `src_strategy` that of this
    rank's stage) into a destination without stages: the ranks learn every stage's layouts from one another
    (a world gather at construction, or `src_stage_layouts` if the caller already has what
    `gather_stage_layouts` returns), and each parameter comes from the stage that holds it through a
    zero-padded world AllReduce.

    `only`: a test of the parameter names (source and destination) to move, the others left as they are: a LoRA
    policy's base weights into the reference (the base model), or its adapters alone once the base is there.
    """

    def __init__(self, src_net: nn.Cell, dst_net: nn.Cell, src_strategy, dst_strategy,
                 name_map: Mapping[str, str] | None = None, rank: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, pack_below_bytes: int = PACK_BELOW_BYTES,
                 src_pipeline=None, src_stage_layouts=None, only: Callable[[str], bool] | None = None):
        src_layouts = _with_net_shapes(_as_layouts(src_strategy, "source"), src_net, "source")
        dst_layouts = _with_net_shapes(_as_layouts(dst_strategy, "destination"), dst_net, "destination")
        self.src_params = {p.name: p for p in src_net.get_parameters()}
        self.dst_params = {p.name: p for p in dst_net.get_parameters()}
        self.src_dtypes = {name: param.dtype for name, param in self.src_params.items()}
        src_stages = None
        world = next(iter(src_layouts.values())).world_size
        stages = 1
        if src_pipeline is not None and src_pipeline.pp > 1:
            src_layouts, stage_of, dtypes = src_stage_layouts or gather_stage_layouts(src_layouts, self.src_dtypes,
                                                                                      src_pipeline)
            src_stages = {name: (stage, src_pipeline.stage_size) for name, stage in stage_of.items()}
            self.src_dtypes = {**dtypes, **self.src_dtypes}
            world, stages = src_pipeline.world_size, src_pipeline.pp
        if only is not None:
            src_layouts = {name: layout for name, layout in src_layouts.items() if only(name)}
            dst_layouts = {name: layout for name, layout in dst_layouts.items() if only(name)}
            if name_map is not None:
                name_map = {src: dst for src, dst in name_map.items() if src in src_layouts}
        pairs = validate_pair(src_layouts, dst_layouts, name_map, "source", "destination", allow_unused_src=False,
                              src_stages=stages)
        if rank is None:
            rank = 0
            if world > 1:
                rank = get_rank()
        self.rank = rank
        self.world_size = world
        self.pipeline = src_stages is not None
        self.moves = plan_reshard(src_layouts, dst_layouts, pairs, rank, src_stages)
        self.bucket_bytes = bucket_bytes
        self.pack_below_bytes = pack_below_bytes
        self._steps = self._build_steps(src_layouts)

    def _wire(self, moves: list[Move]):
        return wire_dtype({self.src_dtypes[m.src_name] for m in moves},
                          {self.dst_params[m.dst_name].dtype for m in moves})

    def _params_of(self, moves: list[Move]):
        """(destination parameters, source dtypes) of `moves`."""
        return [self.dst_params[m.dst_name] for m in moves], [self.src_dtypes[m.src_name] for m in moves]

    def _build_steps(self, src_layouts: Mapping[str, ParamLayout]) -> list[_Step]:
        """Local chunks first, then the buckets in the global order every rank follows."""
        itemsize = max(self._wire(self.moves).itemsize, 2) if self.moves else 4
        bucket_elements = max(1, self.bucket_bytes // itemsize)
        steps: list[_Step] = []
        for chunk in _chunks([m for m in self.moves if not m.group], bucket_elements):
            steps.append(_LocalStep(chunk, *self._params_of(chunk)))
        for bucket in make_buckets(self.moves, bucket_elements):
            wire = self._wire(bucket.moves)
            if len(bucket.group) == self.world_size and not self.pipeline:
                steps.append(_GatherStep(bucket.moves, *self._params_of(bucket.moves),
                                         [src_layouts[m.src_name] for m in bucket.moves], self.world_size, wire,
                                         self.pack_below_bytes))
            else:
                group = ensure_group(list(bucket.group), self.world_size)
                steps.append(_ReduceStep(bucket.moves, *self._params_of(bucket.moves), group, wire,
                                         self.pack_below_bytes))
        return steps

    def _source(self, name: str) -> Tensor:
        """A Tensor sharing the source parameter's memory: an input of the step graphs that, unlike the
        Parameter itself, cannot clash by name with a destination parameter held by the graph."""
        param = self.src_params.get(name)
        if param is None:  # held by another pipeline stage: this rank contributes zeros, the input is unused
            return Tensor([0], self.src_dtypes[name])
        if getattr(param, "has_init", False):
            param.init_data()
        return Tensor(param)

    def run(self) -> ReshardStats:
        """Moves the weights; returns what this rank did."""
        start = time.perf_counter()
        stats = ReshardStats(parameters=len(self.moves), local_copies=sum(1 for m in self.moves if not m.group))
        for step in self._steps:
            _, returned = step(*[self._source(name) for name in step.src_names])
            for i, value in zip(step.returned, returned):
                self.dst_params[step.dst_names[i]].set_data(value if step.fresh[i] else value.copy())
            if step.collective:
                stats.buckets += 1
                stats.bytes_sent += step.bytes_sent
                stats.bytes_received += step.bytes_received
        stats.seconds = time.perf_counter() - start
        logger.debug("reshard rank %d: %s", self.rank, stats)
        return stats

