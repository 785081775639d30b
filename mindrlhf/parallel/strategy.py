"""Per-parameter layouts and MindSpore strategy files (`ParallelStrategyMap` protobuf).

A :class:`ParamLayout` says how one parameter is split over the ranks of a job, in MindSpore's
convention: ranks are laid out on ``dev_matrix`` (last axis varies fastest) and ``tensor_map[d]``
names the device-matrix axis that splits tensor dimension ``d``, **counted from the right**
(``-1`` = not split). Device axes that no tensor dimension uses replicate the parameter.

The strategy files written here are read by ``mindspore.build_searched_strategy`` and
``mindspore.parallel.transform_checkpoints``; every rank of a job writes the same content (a strategy
describes the whole job, not one rank), so any one rank's file can be given to ``transform_checkpoints``.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError
from mindspore.train import node_strategy_pb2

from mindrlhf.parallel.layers import param_split_axes, param_split_shards
from mindrlhf.parallel.layout import NOT_SPLIT, TP_AXIS, Layout
from mindrlhf.utils.atomic import atomic_output

_STAGE_PREFIX = re.compile(r"^(?P<stage>\d+)-(?P<name>.+)$")
_MAX_LISTED = 20


class StrategyError(ValueError):
    """A strategy file or a pair of layouts that cannot be used; the message names file and parameter."""


@dataclass(frozen=True)
class ParamLayout:
    """How parameter `name` is split: MindSpore `dev_matrix` + `tensor_map`, and its full shape if known."""

    name: str
    dev_matrix: tuple[int, ...]
    tensor_map: tuple[int, ...]
    full_shape: tuple[int, ...] | None = field(default=None)

    def __post_init__(self):
        object.__setattr__(self, "dev_matrix", tuple(int(d) for d in self.dev_matrix))
        object.__setattr__(self, "tensor_map", tuple(int(m) for m in self.tensor_map))
        if self.full_shape is not None:
            object.__setattr__(self, "full_shape", tuple(int(s) for s in self.full_shape))
        problem = self._problem()
        if problem:
            raise StrategyError(f"parameter '{self.name}': invalid layout {self.describe()}: {problem}")

    def _problem(self) -> str | None:
        if not self.dev_matrix or any(d < 1 for d in self.dev_matrix):
            return "dev_matrix must be non-empty with sizes >= 1"
        used = [m for m in self.tensor_map if m != NOT_SPLIT]
        if any(not 0 <= m < len(self.dev_matrix) for m in used):
            return f"tensor_map entries must be -1 or in [0, {len(self.dev_matrix)})"
        if len(set(used)) != len(used):
            return "a device-matrix axis splits more than one tensor dimension"
        if self.full_shape is None:
            return None
        if len(self.full_shape) != len(self.tensor_map):
            return f"full shape has {len(self.full_shape)} dims but tensor_map has {len(self.tensor_map)}"
        bad = [d for d, (size, parts) in enumerate(zip(self.full_shape, self.split_counts)) if size % parts]
        if bad:
            return f"dimension(s) {bad} not divisible by their split counts {list(self.split_counts)}"
        return None

    # ---------------------------------------------------------------- arithmetic
    @property
    def world_size(self) -> int:
        """Number of ranks the layout covers (product of the device matrix)."""
        return math.prod(self.dev_matrix)

    @property
    def ndim(self) -> int:
        return len(self.tensor_map)

    def device_axis(self, mapped: int) -> int:
        """Index (from the left) into `dev_matrix` of a tensor_map value (counted from the right)."""
        return len(self.dev_matrix) - 1 - mapped

    @property
    def split_counts(self) -> tuple[int, ...]:
        """Number of shards along each tensor dimension (MindSpore's 'tensor strategy')."""
        return tuple(1 if m == NOT_SPLIT else self.dev_matrix[self.device_axis(m)] for m in self.tensor_map)

    @property
    def is_replicated(self) -> bool:
        return all(c == 1 for c in self.split_counts)

    def device_coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of `rank` in the device matrix (last axis varies fastest)."""
        if not 0 <= rank < self.world_size:
            raise StrategyError(f"parameter '{self.name}': rank {rank} outside {self.describe()} "
                                f"(world size {self.world_size})")
        coords = []
        for size in reversed(self.dev_matrix):
            rank, coord = divmod(rank, size)
            coords.append(coord)
        return tuple(reversed(coords))

    def shard_index(self, rank: int) -> tuple[int, ...]:
        """Index of `rank`'s shard along each tensor dimension (0 where not split)."""
        coords = self.device_coords(rank)
        return tuple(0 if m == NOT_SPLIT else coords[self.device_axis(m)] for m in self.tensor_map)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the shard each rank holds."""
        return tuple(size // parts for size, parts in zip(self._require_full_shape(), self.split_counts))

    def slice_of(self, rank: int) -> tuple[slice, ...]:
        """Region of the full tensor that `rank` holds."""
        local = self.local_shape
        return tuple(slice(i * n, (i + 1) * n) for i, n in zip(self.shard_index(rank), local))

    def with_full_shape(self, full_shape: Iterable[int]) -> ParamLayout:
        return ParamLayout(self.name, self.dev_matrix, self.tensor_map, tuple(full_shape))

    def full_shape_from_local(self, local_shape: Iterable[int]) -> tuple[int, ...]:
        """Full shape of a parameter whose shard on every rank has `local_shape`."""
        local_shape = tuple(local_shape)
        if len(local_shape) != self.ndim:
            raise StrategyError(f"parameter '{self.name}': local shape {list(local_shape)} has {len(local_shape)} "
                                f"dims but layout {self.describe()} has {self.ndim}")
        return tuple(n * parts for n, parts in zip(local_shape, self.split_counts))

    def _require_full_shape(self) -> tuple[int, ...]:
        if self.full_shape is None:
            raise StrategyError(f"parameter '{self.name}': full shape unknown (strategy files do not store it); "
                                "use with_full_shape() first")
        return self.full_shape

    def same_split(self, other: ParamLayout) -> bool:
        """True if both layouts give every rank the same region (ignores names and shapes)."""
        return self.dev_matrix == other.dev_matrix and self.tensor_map == other.tensor_map

    def describe(self) -> str:
        shape = "" if self.full_shape is None else f" full_shape={list(self.full_shape)}"
        return f"dev_matrix={list(self.dev_matrix)} tensor_map={list(self.tensor_map)}{shape}"


# ---------------------------------------------------------------- building layouts
def layouts_for(layout: Layout, split_axes: Mapping[str, int | None],
                full_shapes: Mapping[str, Iterable[int]],
                split_shards: Mapping[str, int] | None = None) -> dict[str, ParamLayout]:
    """Layouts of a net's parameters under `layout`: dimension `split_axes[name]` split over tp.

    Parameters are never split over dp. `full_shapes` must name exactly the parameters of `split_axes`. A
    parameter cut into fewer shards than tp (`split_shards[name]`, shared by tp / shards consecutive tp ranks)
    gets the device matrix [dp, shards, tp / shards], split over its middle axis and replicated over the last.
    """
    _check_same_names(split_axes, full_shapes, "split_axes", "full_shapes")
    split_shards = split_shards or {}
    result = {}
    for name, axis in split_axes.items():
        shape = tuple(full_shapes[name])
        tensor_map = [NOT_SPLIT] * len(shape)
        dev_matrix = tuple(layout.dev_matrix)
        if axis is not None:
            shards = split_shards.get(name, layout.tp)
            tensor_map[_normalize_axis(name, axis, len(shape))] = TP_AXIS
            if shards < layout.tp:
                dev_matrix = (layout.dp, shards, layout.tp // shards)
                tensor_map[_normalize_axis(name, axis, len(shape))] = TP_AXIS + 1
        result[name] = ParamLayout(name, dev_matrix, tuple(tensor_map), shape)
    return result


def full_shapes_from_local(layout: Layout, split_axes: Mapping[str, int | None],
                           local_shapes: Mapping[str, Iterable[int]],
                           split_shards: Mapping[str, int] | None = None) -> dict[str, tuple[int, ...]]:
    """Full shapes from per-rank shapes: the split axis is `tp` (or `split_shards[name]`) times larger."""
    _check_same_names(split_axes, local_shapes, "split_axes", "local_shapes")
    split_shards = split_shards or {}
    result = {}
    for name, axis in split_axes.items():
        shape = list(local_shapes[name])
        if axis is not None:
            shape[_normalize_axis(name, axis, len(shape))] *= split_shards.get(name, layout.tp)
        result[name] = tuple(shape)
    return result


def _normalize_axis(name: str, axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise StrategyError(f"parameter '{name}': split axis {axis} out of range for a {ndim}-dim tensor")
    return axis % ndim


def _check_same_names(a: Mapping, b: Mapping, a_desc: str, b_desc: str) -> None:
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        raise StrategyError(f"{a_desc} and {b_desc} name different parameters: only in {a_desc}: "
                            f"{_listing(only_a)}; only in {b_desc}: {_listing(only_b)}")


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED]) or "-"
    return shown + (f" (+{len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def world_size_of(layouts: Mapping[str, ParamLayout], desc: str = "layouts") -> int:
    """The one world size all `layouts` cover; an error if they disagree or are empty."""
    sizes = {lay.world_size for lay in layouts.values()}
    if len(sizes) != 1:
        detail = ", ".join(f"{n}: {lay.describe()}" for n, lay in list(layouts.items())[:_MAX_LISTED])
        raise StrategyError(f"{desc}: expected one world size, got {sorted(sizes) or 'none'} ({detail or 'empty'})")
    return sizes.pop()


# ---------------------------------------------------------------- strategy files
def strategy_file_name(rank: int) -> str:
    """Conventional per-rank file name; `.ckpt` is what `merge_pipeline_strategys` looks for."""
    return f"ckpt_strategy_rank_{rank}.ckpt"


def write_strategy_file(path: str | os.PathLike, layouts: Mapping[str, ParamLayout], stage: int = 0,
                        stages: Mapping[str, int] | None = None) -> str:
    """Writes `layouts` as a `ParallelStrategyMap` protobuf (temp file + rename); returns the path.

    `stage` is the pipeline stage the file describes (`current_stage`, as each stage's ranks write it). With
    `stages` (parameter name -> its stage) the file holds every stage of a net in pipeline stages, as
    `mindspore.parallel.merge_pipeline_strategys` writes it (names `<stage>-<name>`, each with its stage's
    device matrix), which `transform_checkpoints` reads as the whole net's strategy.
    """
    path = os.fspath(path)
    if path.endswith(".json"):
        raise StrategyError(f"{path}: MindSpore reads '.json' strategy files as JSON; this writer writes protobuf, "
                            "use another extension (e.g. '.ckpt')")
    _check_writable_layouts(path, layouts, stages)
    strategy_map = node_strategy_pb2.ParallelStrategyMap()
    strategy_map.current_stage = stage if stages is None else 1  # what merge_pipeline_strategys sets
    for lay in sorted(layouts.values(), key=lambda lay: stages[lay.name]) if stages else layouts.values():
        _add_strategy_item(strategy_map, lay, stage if stages is None else stages[lay.name])
        _add_layout_item(strategy_map, lay, None if stages is None else stages[lay.name])
    _atomic_write(path, strategy_map.SerializeToString())
    return path


def _check_writable_layouts(path: str, layouts: Mapping[str, ParamLayout], stages: Mapping[str, int] | None) -> None:
    if not layouts:
        raise StrategyError(f"{path}: no parameter layouts to write")
    for name, lay in layouts.items():
        if name != lay.name:
            raise StrategyError(f"{path}: key '{name}' holds the layout of parameter '{lay.name}'")
        if "-" in name:
            raise StrategyError(f"{path}: parameter '{name}' has a '-' in its name, which MindSpore reads as "
                                "'<pipeline stage>-<name>'")
    if stages is None:
        world_size_of(layouts, path)
        return
    missing = sorted(set(layouts) - set(stages))
    if missing:
        raise StrategyError(f"{path}: no pipeline stage given for {_listing(missing)}")
    stage_ranks(layouts, stages, path)


def _add_strategy_item(strategy_map, lay: ParamLayout, stage: int) -> None:
    """One informational node entry per parameter; MindSpore only reads the stage of the first one."""
    item = strategy_map.parallel_strategy_item.add()
    item.node_name = lay.name
    item.parallel_strategys.stage = stage
    item.parallel_strategys.parallel_strategy.add().dim.extend(lay.split_counts)


def _add_layout_item(strategy_map, lay: ParamLayout, stage: int | None = None) -> None:
    item = strategy_map.parallel_layout_item.add()
    item.param_name = lay.name if stage is None else f"{stage}-{lay.name}"
    layouts = item.parallel_layouts
    layouts.dev_matrix.add().dim.extend(lay.dev_matrix)
    layouts.tensor_map.add().dim.extend(lay.tensor_map)
    layouts.param_split_shape.add()  # read unconditionally by MindSpore; empty = even split
    layouts.indices_offset.add()
    layouts.field = 0
    # 0 also under `optimizer_shard`: MindSpore's fields say the weight itself is split along dim 0 in the
    # checkpoint (transform_checkpoints multiplies dim 0 by them); here weights stay whole and only the moments,
    # which have no entries of their own, are flat slices (`mindrlhf.optim.ShardedAdamW`)
    layouts.opt_weight_shard_step = 0
    layouts.opt_weight_shard_size = 0


def _atomic_write(path: str, data: bytes) -> None:
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def read_strategy_file(path: str | os.PathLike) -> dict[str, ParamLayout]:
    """Parameter layouts of a protobuf strategy file (full shapes are not stored: `full_shape=None`).

    Names of a file merged by `merge_pipeline_strategys` (`<stage>-<name>`) are returned without the stage,
    as MindSpore does; a file holding several pipeline stages needs :func:`read_staged_strategy_file`.
    """
    path = os.fspath(path)
    layouts, stages = read_staged_strategy_file(path)
    if len(set(stages.values())) > 1:
        raise StrategyError(f"{path}: holds pipeline stages {sorted(set(stages.values()))}; read it with "
                            "read_staged_strategy_file")
    return layouts


def read_staged_strategy_file(path: str | os.PathLike) -> tuple[dict[str, ParamLayout], dict[str, int]]:
    """(layouts, parameter name -> pipeline stage) of a strategy file; a file of one stage (or without stages)
    gives stage 0 to every parameter. Each stage's layouts cover that stage's ranks (see :func:`stage_ranks`). A
    parameter that several stages hold (a tied embedding) is read from the first of them: their copies are equal."""
    path = os.fspath(path)
    strategy_map = _parse_strategy_map(path)
    layouts: dict[str, ParamLayout] = {}
    stages: dict[str, int] = {}
    for item in strategy_map.parallel_layout_item:
        stage, name = _split_stage(item.param_name)
        if stages.get(name, stage) < stage:
            continue
        layouts[name] = _layout_from_proto(path, name, item.parallel_layouts)
        stages[name] = stage
    if len(set(stages.values())) == 1:
        stages = dict.fromkeys(stages, 0)
    return layouts, stages


def read_stage_layouts(path: str | os.PathLike) -> dict[int, dict[str, ParamLayout]]:
    """Pipeline stage -> the layouts of the parameters that stage holds, from one strategy file: every stage of a
    merged file (`<stage>-<name>`; a parameter several stages hold, a tied embedding, is under each of them), or
    the one stage a stage's own file describes (the `stage` of its first node entry, which is what
    `mindspore.parallel.merge_pipeline_strategys` reads; 0 for a net without stages)."""
    path = os.fspath(path)
    strategy_map = _parse_strategy_map(path)
    nodes = strategy_map.parallel_strategy_item
    own = nodes[0].parallel_strategys.stage if nodes else 0
    result: dict[int, dict[str, ParamLayout]] = {}
    for item in strategy_map.parallel_layout_item:
        match = _STAGE_PREFIX.match(item.param_name)
        stage, name = (int(match.group("stage")), match.group("name")) if match else (own, item.param_name)
        result.setdefault(stage, {})[name] = _layout_from_proto(path, name, item.parallel_layouts)
    return dict(sorted(result.items()))


def stage_ranks(layouts: Mapping[str, ParamLayout], stages: Mapping[str, int], desc: str) -> dict[int, range]:
    """Pipeline stage -> the ranks holding it (stages outermost in the rank order, each of one size); a staged
    strategy whose stages are missing or of different sizes is an error naming `desc`."""
    per_stage = {}
    for stage in sorted(set(stages.values())):
        per_stage[stage] = world_size_of({n: lay for n, lay in layouts.items() if stages[n] == stage},
                                         f"{desc} stage {stage}")
    if sorted(per_stage) != list(range(len(per_stage))) or len(set(per_stage.values())) != 1:
        raise StrategyError(f"{desc}: pipeline stages {sorted(per_stage)} of sizes {list(per_stage.values())}; "
                            "expected stages 0..n-1 of one size each")
    size = per_stage[0]
    return {stage: range(stage * size, (stage + 1) * size) for stage in per_stage}


def staged_world_size(layouts: Mapping[str, ParamLayout], stages: Mapping[str, int], desc: str) -> int:
    """Ranks a strategy covers: those of all its pipeline stages (:func:`stage_ranks`)."""
    return max(ranks.stop for ranks in stage_ranks(layouts, stages, desc).values())


def _parse_strategy_map(path: str):
    if not os.path.isfile(path):
        raise StrategyError(f"{path}: strategy file not found")
    if path.endswith(".json"):
        raise StrategyError(f"{path}: JSON strategy files are not supported; give the protobuf file")
    with open(path, "rb") as f:
        content = f.read()
    if not content:
        raise StrategyError(f"{path}: strategy file is empty")
    strategy_map = node_strategy_pb2.ParallelStrategyMap()
    try:
        strategy_map.ParseFromString(content)
    except DecodeError as err:
        raise StrategyError(f"{path}: not a MindSpore strategy file (ParallelStrategyMap protobuf): {err}") from None
    if not strategy_map.HasField("current_stage") or not strategy_map.parallel_layout_item:
        raise StrategyError(f"{path}: not a MindSpore strategy file (ParallelStrategyMap protobuf): "
                            "no current_stage or no parameter layouts")
    return strategy_map


def _split_stage(stored_name: str) -> tuple[int, str]:
    match = _STAGE_PREFIX.match(stored_name)
    if match:
        return int(match.group("stage")), match.group("name")
    return 0, stored_name


def _layout_from_proto(path: str, name: str, proto) -> ParamLayout:
    if len(proto.dev_matrix) != 1 or len(proto.tensor_map) != 1:
        raise StrategyError(f"{path}: parameter '{name}' has {len(proto.dev_matrix)} dev_matrix and "
                            f"{len(proto.tensor_map)} tensor_map entries; exactly one of each is supported")
    if proto.opt_weight_shard_size not in (0, 1):
        raise StrategyError(f"{path}: parameter '{name}' uses optimizer weight sharding "
                            f"(opt_weight_shard_size={proto.opt_weight_shard_size}), which is not supported")
    try:
        return ParamLayout(name, tuple(proto.dev_matrix[0].dim), tuple(proto.tensor_map[0].dim))
    except StrategyError as err:
        raise StrategyError(f"{path}: {err}") from None


# ---------------------------------------------------------------- comparing two layouts
def validate_pair(src_layouts: Mapping[str, ParamLayout], dst_layouts: Mapping[str, ParamLayout],
                  name_map: Mapping[str, str] | None = None, src_desc: str = "source",
                  dst_desc: str = "destination", allow_unused_src: bool = False,
                  src_stages: int = 1) -> dict[str, str]:
    """Checks that `src_layouts` can be resharded into `dst_layouts`; returns {dst_name: src_name}.

    `name_map` maps source names to destination names (None = same names). Every destination parameter must
    have a source; unless `allow_unused_src`, every source parameter must have a destination. Both sides must
    cover one and the same world size (a source in `src_stages` pipeline stages: each stage's layouts cover
    that share of it), and matched parameters must have the same full shape (when both are known) and number
    of dimensions. All problems are reported in one StrategyError.
    """
    name_map = {n: n for n in src_layouts} if name_map is None else dict(name_map)
    problems = _name_problems(src_layouts, dst_layouts, name_map, src_desc, dst_desc, allow_unused_src)
    problems += _world_size_problems(src_layouts, dst_layouts, src_desc, dst_desc, src_stages)
    pairs = {dst: src for src, dst in name_map.items() if src in src_layouts and dst in dst_layouts}
    for dst, src in pairs.items():
        problem = _shape_problem(src_layouts[src], dst_layouts[dst], src_desc, dst_desc)
        if problem:
            problems.append(problem)
    if problems:
        raise StrategyError(f"cannot reshard {src_desc} -> {dst_desc}:\n  " + "\n  ".join(problems[:_MAX_LISTED])
                            + (f"\n  (+{len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""))
    return pairs


def _name_problems(src_layouts, dst_layouts, name_map, src_desc, dst_desc, allow_unused_src) -> list[str]:
    problems = []
    unknown_src = sorted(n for n in name_map if n not in src_layouts)
    unknown_dst = sorted({d for d in name_map.values() if d not in dst_layouts})
    targets: dict[str, list[str]] = {}
    for src, dst in name_map.items():
        targets.setdefault(dst, []).append(src)
    doubled = sorted(f"{dst} <- {', '.join(srcs)}" for dst, srcs in targets.items() if len(srcs) > 1)
    unmatched_dst = sorted(n for n in dst_layouts if n not in targets)
    unmatched_src = [] if allow_unused_src else sorted(n for n in src_layouts if n not in name_map)
    for names, what in ((unknown_src, f"name map keys not in {src_desc}"),
                        (unknown_dst, f"name map values not in {dst_desc}"),
                        (doubled, f"{dst_desc} parameters mapped from several {src_desc} parameters"),
                        (unmatched_dst, f"{dst_desc} parameters with no {src_desc} counterpart"),
                        (unmatched_src, f"{src_desc} parameters with no {dst_desc} counterpart")):
        if names:
            problems.append(f"{what}: {_listing(names)}")
    return problems


def _world_size_problems(src_layouts, dst_layouts, src_desc, dst_desc, src_stages: int = 1) -> list[str]:
    sizes = {}
    for layouts, desc in ((src_layouts, src_desc), (dst_layouts, dst_desc)):
        try:
            sizes[desc] = world_size_of(layouts, desc)
        except StrategyError as err:
            return [str(err)]
    if sizes[src_desc] * src_stages != sizes[dst_desc]:
        stages = f" in each of {src_stages} pipeline stages" if src_stages > 1 else ""
        return [f"world size mismatch: {src_desc} covers {sizes[src_desc]} ranks{stages}, {dst_desc} "
                f"{sizes[dst_desc]}"]
    return []


def _shape_problem(src: ParamLayout, dst: ParamLayout, src_desc: str, dst_desc: str) -> str | None:
    differs = src.ndim != dst.ndim or (
        src.full_shape is not None and dst.full_shape is not None and src.full_shape != dst.full_shape)
    if not differs:
        return None
    return (f"shape mismatch: {src_desc} '{src.name}' ({src.describe()}) vs "
            f"{dst_desc} '{dst.name}' ({dst.describe()})")


def net_layouts(net, layout: Layout) -> dict[str, ParamLayout]:
    """Layouts of every parameter of a network built from the tensor-parallel layers, under `layout`."""
    axes, shards = param_split_axes(net), param_split_shards(net, layout.tp)
    local = {p.name: tuple(p.shape) for p in net.get_parameters()}
    return layouts_for(layout, axes, full_shapes_from_local(layout, axes, local, shards), shards)


def merge_shards(shards: list[Mapping[str, np.ndarray]], layouts: Mapping[str, ParamLayout],
                 source: str = "shards", stages: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Full tensors of the parameters in `layouts` from the per-rank shards (`shards[rank]`: name -> array).

    With `stages` (a net in pipeline stages, :func:`read_staged_strategy_file`) each parameter comes from the
    ranks of its stage. Full shapes come from the shard shapes; other entries of the shards (optimizer state)
    are ignored.
    """
    stages = stages or dict.fromkeys(layouts, 0)
    ranks_of = stage_ranks(layouts, stages, source)
    world = sum(len(ranks) for ranks in ranks_of.values())
    if len(shards) != world:
        raise StrategyError(f"{source}: {len(shards)} rank shards for a strategy of {world} ranks")
    merged = {}
    for name, lay in layouts.items():
        ranks = ranks_of[stages[name]]
        missing = [rank for rank in ranks if name not in shards[rank]]
        if missing:
            raise StrategyError(f"{source}: parameter '{name}' missing from the shards of ranks {missing}")
        lay = lay.with_full_shape(lay.full_shape_from_local(shards[ranks[0]][name].shape))
        full = np.empty(lay.full_shape, dtype=shards[ranks[0]][name].dtype)
        for local, rank in enumerate(ranks):
            piece = shards[rank][name]
            if tuple(piece.shape) != lay.local_shape:
                raise StrategyError(f"{source}: '{name}' of rank {rank} has shape {list(piece.shape)}, "
                                    f"expected {list(lay.local_shape)} ({lay.describe()})")
            full[lay.slice_of(local)] = piece
        merged[name] = full
    return merged


def split_full(full: Mapping[str, np.ndarray], layouts: Mapping[str, ParamLayout], rank: int,
               source: str = "checkpoint") -> dict[str, np.ndarray]:
    """`rank`'s shards (views) of the full tensors `full` for the parameters in `layouts`, the inverse of
    :func:`merge_shards`: the region `ParamLayout.slice_of(rank)` of each. `layouts` are those of one pipeline stage
    and `rank` counts within it. A parameter missing from `full`, or whose shape does not fit its layout, is an
    error naming `source` and the parameter."""
    shards = {}
    for name, lay in layouts.items():
        if name not in full:
            raise StrategyError(f"{source}: no entry for parameter '{name}'")
        value = full[name]
        if value.ndim != lay.ndim:
            raise StrategyError(f"{source}: '{name}' has shape {list(value.shape)} ({value.ndim} dims), but its "
                                f"layout {lay.describe()} has {lay.ndim}")
        try:
            lay = lay.with_full_shape(value.shape)
        except StrategyError as err:
            raise StrategyError(f"{source}: {err}") from None
        shards[name] = value[lay.slice_of(rank)]
    return shards
