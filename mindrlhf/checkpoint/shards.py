"""Folders of per-rank checkpoint shards, `<folder>/rank_<r>/*.ckpt`, into nets.

`tools/transform_checkpoint.py` and `mindspore.parallel.transform_checkpoints` write such folders (MindSpore reads
the last `.ckpt` of a rank folder in name order, and so does this module). The tool also writes the folder's
strategy, `<folder>/strategy.ckpt`, with the plain model names of its shards (no net prefix).

Loading a folder into a net (`load_shards`):
    strategy.ckpt gives the net's layout   each rank reads only its own `rank_<r>` file
    no strategy.ckpt                       the same, with the net's layout assumed (as MindRLHF does) and every
                                           shard's shape checked against the net's
    strategy.ckpt gives another layout     reshard on load: every rank's shards merged through the folder's
                                           strategy and split onto the net's layout

A trainer step folder (`step.is_step_folder`: its meta.json or strategy files) is not a shard folder; it is read by
`mindrlhf.checkpoint.weights`.
"""
from __future__ import annotations

import glob
import logging
import os
import re

from mindspore import Tensor

from mindrlhf.checkpoint.step import CheckpointError, is_step_folder, is_weight, plain_name, read_arrays
from mindrlhf.parallel.layers import load_full_state
from mindrlhf.parallel.strategy import (
    ParamLayout,
    StrategyError,
    merge_shards,
    net_layouts,
    read_staged_strategy_file,
    staged_world_size,
)

SHARD_STRATEGY = "strategy.ckpt"
RANK_DIR = re.compile(r"^rank_(\d+)$")  # a rank folder of a shard folder
_MAX_LISTED = 10

logger = logging.getLogger("mindrlhf.checkpoint")


def rank_files(folder: str) -> dict[int, str]:
    """rank -> the checkpoint file of `folder/rank_<rank>/` (the last `*.ckpt` in name order, as MindSpore's
    transform reads it); ranks without a `.ckpt` are left out."""
    found = {}
    for entry in os.listdir(folder) if os.path.isdir(folder) else ():
        match = RANK_DIR.match(entry)
        files = sorted(glob.glob(os.path.join(glob.escape(folder), entry, "*.ckpt"))) if match else []
        if files:
            found[int(match.group(1))] = files[-1]
    return found


def checkpoint_form(path: str) -> str:
    """What `path` holds, decided once for every reader: "file" (a `.ckpt`), "step" (a trainer step folder:
    `step.is_step_folder`) or "shards" (`rank_<r>/*.ckpt` without a step folder's files); anything else is a
    CheckpointError naming the path and the forms expected."""
    if os.path.isfile(path):
        return "file"
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint not found (expected a .ckpt file, a trainer step folder or a "
                              "folder of rank_<r>/*.ckpt shards)")
    if is_step_folder(path):
        return "step"
    if rank_files(path):
        return "shards"
    raise not_a_checkpoint_folder(path)


def not_a_checkpoint_folder(folder: str) -> CheckpointError:
    """The one error for a folder that holds no checkpoint of either kind."""
    return CheckpointError(f"{folder}: neither a trainer step folder (meta.json, *_strategy.ckpt) nor a folder of "
                           "per-rank shards (rank_<r>/*.ckpt)")


def read_shard(path: str) -> dict:
    """name -> numpy array of one rank's checkpoint file, names without a net prefix, optimizer entries dropped."""
    arrays = read_arrays(path, keep=is_weight)
    return {plain_name(name): value for name, value in arrays.items()}


def read_folder_strategy(folder: str) -> tuple[dict, dict] | None:
    """(layouts, parameter -> pipeline stage) of `folder/strategy.ckpt`, names without a net prefix; None when the
    folder has no strategy file."""
    path = os.path.join(folder, SHARD_STRATEGY)
    if not os.path.isfile(path):
        return None
    try:
        layouts, stages = read_staged_strategy_file(path)
    except StrategyError as err:
        raise CheckpointError(str(err)) from None
    plain = {plain_name(name): ParamLayout(plain_name(name), lay.dev_matrix, lay.tensor_map)
             for name, lay in layouts.items()}
    return plain, {plain_name(name): stage for name, stage in stages.items()}


def merge_shard_folder(folder: str) -> dict:
    """The full weights (plain name -> numpy array) of a shard folder: every rank's shards merged through the
    folder's `strategy.ckpt` (which it needs: shards alone do not say how they were cut)."""
    strategy = read_folder_strategy(folder)
    if strategy is None:
        raise CheckpointError(f"{folder}: a folder of rank shards without {SHARD_STRATEGY}, so its full weights "
                              "cannot be merged here; give a whole .ckpt, or shards written by "
                              "tools/transform_checkpoint.py (which writes the strategy file beside them)")
    return _merge(folder, strategy)


def _merge(folder: str, strategy: tuple[dict, dict]) -> dict:
    layouts, stages = strategy
    path = os.path.join(folder, SHARD_STRATEGY)
    try:
        world = staged_world_size(layouts, stages, path)
        files = rank_files(folder)
        missing = [rank for rank in range(world) if rank not in files]
        if missing:
            raise CheckpointError(f"{folder}: no rank_<r>/*.ckpt for rank(s) {missing[:_MAX_LISTED]} ({path} "
                                  f"describes {world} ranks, and merging its shards reads all of them)")
        return merge_shards([read_shard(files[rank]) for rank in range(world)], layouts, folder, stages)
    except StrategyError as err:
        raise CheckpointError(str(err)) from None


def load_shards(net, layout, folder: str, prefix: str = "") -> None:
    """Loads the shard folder `folder` into `net` (this rank's part of a net in `layout`; its parameter names are
    `prefix` + the plain model names): its own rank file when the folder's strategy is the net's layout or absent,
    else resharded on load (see the module's docstring). Errors name the folder or file and what was expected."""
    files = _checked_rank_files(folder, layout.world_size)
    strategy = read_folder_strategy(folder)
    if strategy is None:
        logger.info("%s: no %s; the shards are taken to be in the net's layout (%s) and their shapes checked",
                    folder, SHARD_STRATEGY, layout)
    else:
        _check_world_size(folder, strategy, layout.world_size)
        by_plain_name = {_unprefixed(name, prefix): lay for name, lay in net_layouts(net, layout).items()}
        if not _same_layout(folder, strategy, by_plain_name, layout.stage):
            logger.info("%s: the shards are in another layout than the net's (%s): merged through %s and split "
                        "onto the net's layout", folder, layout, SHARD_STRATEGY)
            _load_full(net, layout, folder, _merge(folder, strategy), prefix)
            return
    if layout.rank not in files:
        raise CheckpointError(f"{folder}: no rank_{layout.rank}/*.ckpt, the shards of rank {layout.rank} (expected "
                              f"rank_0 ... rank_{layout.world_size - 1}, one per rank of the job)")
    load_rank_shard(net, layout, files[layout.rank], prefix)


def _checked_rank_files(folder: str, world_size: int) -> dict[int, str]:
    files = rank_files(folder)
    if not files:
        raise not_a_checkpoint_folder(folder)
    extra = sorted(rank for rank in files if rank >= world_size)
    if extra:
        raise CheckpointError(f"{folder}: holds shards of rank(s) {extra[:_MAX_LISTED]}, but the job has {world_size} "
                              f"ranks: shards of another world size (transform them with "
                              "tools/transform_checkpoint.py for this job's strategy)")
    return files


def _check_world_size(folder: str, strategy: tuple[dict, dict], world_size: int) -> None:
    path = os.path.join(folder, SHARD_STRATEGY)
    try:
        world = staged_world_size(*strategy, path)
    except StrategyError as err:
        raise CheckpointError(str(err)) from None
    if world != world_size:
        raise CheckpointError(f"{path}: a strategy of {world} ranks, but the job has {world_size}; transform the "
                              "shards for this job's strategy (tools/transform_checkpoint.py)")


def _same_layout(folder: str, strategy: tuple[dict, dict], by_plain_name: dict, stage: int) -> bool:
    """Whether every net parameter (`by_plain_name`: plain name -> its layout) is cut alike in the folder's strategy,
    at the net's pipeline stage; a net parameter the strategy lacks is an error."""
    layouts, stages = strategy
    absent = sorted(set(by_plain_name) - set(layouts))
    if absent:
        raise CheckpointError(f"{os.path.join(folder, SHARD_STRATEGY)}: no layout for the net's parameter(s) "
                              f"{', '.join(absent[:_MAX_LISTED])}{' ...' if len(absent) > _MAX_LISTED else ''}; "
                              "are these the shards of this model?")
    return all(stages[name] == stage and layouts[name].same_split(lay) for name, lay in by_plain_name.items())


def _unprefixed(name: str, prefix: str) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def match_params(params, state: dict, name_of=None) -> tuple[list, list[str]]:
    """Pairs (parameter, value of `state` under `name_of(param.name)`, default the name itself) when every one is
    there with the parameter's shape, and the problems (missing, or its shape against the net's) otherwise."""
    pairs, problems = [], []
    for param in params:
        name = name_of(param.name) if name_of else param.name
        value = state.get(name)
        if value is None:
            problems.append(f"'{name}' missing")
        elif tuple(value.shape) != tuple(param.shape):
            problems.append(f"'{name}' has shape {list(value.shape)}, the net's shard {list(param.shape)}")
        else:
            pairs.append((param, value))
    return pairs, problems


def listed(problems: list[str]) -> str:
    """The first problems of a list, joined, and how many more there are."""
    more = f" (+{len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
    return "; ".join(problems[:_MAX_LISTED]) + more


def load_rank_shard(net, layout, path: str, prefix: str = "") -> None:
    """Sets every parameter of `net` from `path`, the shards of this rank (`layout.rank`); each must be there under
    its plain name with the net's local shape. Nothing is set unless all are."""
    pairs, problems = match_params(net.get_parameters(), read_shard(path), lambda name: _unprefixed(name, prefix))
    if problems:
        raise CheckpointError(f"{path}: not the shards of rank {layout.rank} of a net in layout {layout}: "
                              f"{listed(problems)}")
    for param, value in pairs:
        param.set_data(Tensor(value, param.dtype))


def _load_full(net, layout, folder: str, full: dict, prefix: str) -> None:
    try:
        load_full_state(net, {prefix + name: value for name, value in full.items()}, layout)
    except ValueError as err:
        raise CheckpointError(f"{folder}: {err}") from None
