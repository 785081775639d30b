"""Offline checkpoint transforms between parallel layouts (`mindrlhf-transform-checkpoint`,
mindrlhf/cli/transform_checkpoint.py, is their command line).

`transform` either cuts one whole checkpoint into per-rank shards for a net's strategy (`split_whole`: by the
strategy's device matrices and tensor maps, as `mindspore.parallel.transform_checkpoints` cuts them, bit for bit)
or runs MindSpore's transform on split checkpoints after checking them. A strategy is a protobuf strategy file or a
folder of per-rank (per-stage) files (`resolve_strategy`). Everything that can be checked is checked before
anything is written; problems are `TransformError`s naming the file.
"""
from __future__ import annotations

import glob
import os
import re
import sys
import tempfile
from dataclasses import dataclass

from mindspore.parallel import merge_pipeline_strategys, transform_checkpoints

from mindrlhf.checkpoint.shards import RANK_DIR, SHARD_STRATEGY, rank_files
from mindrlhf.checkpoint.step import NET_PREFIXES, plain_name, read_arrays, stored_parameters
from mindrlhf.parallel.strategy import (
    ParamLayout,
    StrategyError,
    read_stage_layouts,
    split_full,
    stage_ranks,
    staged_world_size,
    world_size_of,
    write_strategy_file,
)
from mindrlhf.utils.checkpoint_file import write_checkpoint

_LISTED = 20


class TransformError(Exception):
    """A problem found before (or while) transforming; the message names the path."""


# ---------------------------------------------------------------- strategies
@dataclass
class Strategy:
    """A strategy as given (`path`: a file or a folder of per-rank files): each stage's layouts (a parameter
    several stages hold is in each), and flat, each parameter at its first stage (as a merged file reads)."""

    path: str
    files: dict[str, dict[int, dict[str, ParamLayout]]]
    stage_layouts: dict[int, dict[str, ParamLayout]]
    layouts: dict[str, ParamLayout]
    stages: dict[str, int]
    world: int

    @property
    def stage_size(self) -> int:
        return self.world // len(self.stage_layouts)


def _numeric_key(path: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(path)))


def resolve_strategy(path: str, flag: str) -> Strategy:
    """The strategy of a file or a folder of per-rank files: files of one pipeline stage must agree, the stages'
    files are merged."""
    if not os.path.exists(path):
        raise TransformError(f"{flag} {path}: no such file or folder")
    files = sorted(glob.glob(os.path.join(glob.escape(path), "*.ckpt")), key=_numeric_key) \
        if os.path.isdir(path) else [path]
    if not files:
        raise TransformError(f"{flag} {path}: folder holds no strategy files (*.ckpt)")
    read = {}
    for file in files:
        try:
            read[file] = read_stage_layouts(file)
        except StrategyError as err:
            raise TransformError(f"{flag}: strategy not readable: {err}") from None
    _check_same_world_size(read, flag)
    stage_layouts = _merge_stages(read, flag)
    layouts, stages = {}, {}
    for stage, held in stage_layouts.items():
        for name, lay in held.items():
            layouts.setdefault(name, lay)
            stages.setdefault(name, stage)
    try:
        world = staged_world_size(layouts, stages, path)
    except StrategyError as err:
        raise TransformError(f"{flag}: {err}") from None
    return Strategy(path, read, stage_layouts, layouts, stages, world)


def _check_same_world_size(read: dict[str, dict[int, dict]], flag: str) -> None:
    sizes = {}
    for file, by_stage in read.items():
        try:
            sizes[file] = max(world_size_of(held, f"{file} stage {stage}") for stage, held in by_stage.items())
        except StrategyError as err:
            raise TransformError(f"{flag}: {err}") from None
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{os.path.basename(f)}: {n}" for f, n in sizes.items())
        raise TransformError(f"{flag}: strategy files of different world sizes (ranks per pipeline stage: "
                             f"{listing}); give the files of one job")


def _merge_stages(read: dict[str, dict[int, dict]], flag: str) -> dict[int, dict[str, ParamLayout]]:
    """stage -> its layouts, from every file; two files of one stage must agree."""
    merged: dict[int, tuple[str, dict]] = {}
    for file, by_stage in read.items():
        for stage, layouts in by_stage.items():
            first, reference = merged.setdefault(stage, (file, layouts))
            if layouts == reference:
                continue
            differing = sorted(set(layouts) ^ set(reference)) or sorted(
                n for n in layouts if layouts[n] != reference[n])
            name = differing[0]
            raise TransformError(f"{flag}: {file} and {first} disagree on parameter '{name}' of pipeline stage "
                                 f"{stage} ({_describe(layouts.get(name))} vs {_describe(reference.get(name))}); "
                                 "give the strategy files of one net of one job")
    return {stage: layouts for stage, (_, layouts) in sorted(merged.items())}


def _describe(layout: ParamLayout | None) -> str:
    return "absent" if layout is None else layout.describe()


def mindspore_strategy_file(strategy: Strategy, tmp_dir: str) -> str:
    """One file MindSpore can read for `strategy`: a file as given, or the stages' files merged by
    `mindspore.parallel.merge_pipeline_strategys` (which keeps a parameter several stages hold in each)."""
    files = list(strategy.files)
    if all(strategy.files[f] == strategy.files[files[0]] for f in files):
        return files[0]
    if any(len(by_stage) > 1 for by_stage in strategy.files.values()):
        raise TransformError(f"{strategy.path}: mixes a merged pipeline strategy with stages' own files; give one "
                             "or the other")
    merged = os.path.join(tmp_dir, f"merged_{len(os.listdir(tmp_dir))}.ckpt")
    merge_pipeline_strategys(strategy.path, merged)
    return merged


# ---------------------------------------------------------------- checkpoints
def rank_checkpoints(src_dir: str, world_size: int, strategy_file: str) -> dict[int, str]:
    """rank -> the checkpoint file MindSpore will read from the folder `src_dir` (`transform` checked it exists);
    every rank of the strategy must have one."""
    found = rank_files(src_dir)
    missing = [r for r in range(world_size) if r not in found]
    if missing:
        raise TransformError(f"--src_checkpoint {src_dir}: missing rank file(s) for rank(s) {missing} "
                             f"(expected rank_<i>/*.ckpt for i < {world_size}, the world size of {strategy_file})")
    extra = sorted(r for r in found if r >= world_size)
    if extra:
        raise TransformError(f"--src_checkpoint {src_dir}: has checkpoints for rank(s) {extra} but {strategy_file} "
                             f"covers {world_size} ranks; is it the strategy of this checkpoint?")
    return found


def check_checkpoint_matches(ckpt_file: str, layouts: dict[str, ParamLayout], strategy_file: str) -> list[str]:
    """Errors if strategy parameters are absent or of another rank; returns checkpoint-only names."""
    with stored_parameters(ckpt_file) as stored:  # the records' headers only
        shapes = {name: tensor.shape for name, tensor in stored.items()}
    absent = sorted(set(layouts) - set(shapes))
    if absent:
        raise TransformError(f"{strategy_file} names parameters missing from {ckpt_file}: {_listing(absent)}")
    for name, layout in layouts.items():
        if len(shapes[name]) != layout.ndim:
            raise TransformError(f"parameter '{name}': shape {list(shapes[name])} in {ckpt_file} does not fit "
                                 f"{layout.describe()} in {strategy_file}")
    return sorted(set(shapes) - set(layouts))


def _listing(names: list[str]) -> str:
    return ", ".join(names[:_LISTED]) + (" ..." if len(names) > _LISTED else "")


def check_dst_dir(dst_dir: str) -> None:
    if os.path.isfile(dst_dir):
        raise TransformError(f"--dst_checkpoint {dst_dir}: is a file, expected a folder")
    if os.path.isdir(dst_dir) and any(RANK_DIR.match(entry) for entry in os.listdir(dst_dir)):
        raise TransformError(f"--dst_checkpoint {dst_dir}: already holds rank_<i> folders; choose an empty folder")


def check_same_names(src: dict[str, ParamLayout], dst: dict[str, ParamLayout], src_file: str, dst_file: str) -> None:
    only_src, only_dst = sorted(set(src) - set(dst)), sorted(set(dst) - set(src))
    if only_src or only_dst:
        raise TransformError(f"strategies name different parameters: only in {src_file}: "
                             f"{', '.join(only_src[:20]) or '-'}; "
                             f"only in {dst_file}: {', '.join(only_dst[:20]) or '-'}")


def _warn_copied(names: list[str], where: str) -> None:
    if names:
        print(f"warning: {len(names)} checkpoint entries not in {where} are copied unchanged "
              f"(fine for step counters, wrong for split tensors): {', '.join(names[:10])}", file=sys.stderr)


# ---------------------------------------------------------------- a whole checkpoint into shards
def read_whole_checkpoint(path: str) -> dict:
    """name -> numpy array of a whole `.ckpt`, in the file's order; an unreadable file is a CheckpointError naming
    it."""
    return read_arrays(path)


def checkpoint_names(layouts: dict[str, ParamLayout], names: list[str], ckpt: str, strategy: str) -> dict[str, str]:
    """strategy name -> the checkpoint entry holding it: the same name, else the name without a net prefix
    (`NET_PREFIXES`); a strategy parameter with neither, or two on one entry, is an error."""
    present = set(names)
    found, missing = {}, []
    for name in layouts:
        entry = name if name in present else plain_name(name)
        if entry in present:
            found[name] = entry
        else:
            missing.append(name)
    if missing:
        raise TransformError(f"{strategy} names parameters with no entry in {ckpt} (looked up as named and without "
                             f"a net prefix {', '.join(NET_PREFIXES)}): {_listing(missing)}; is it the strategy "
                             "of this model?")
    targets: dict[str, list[str]] = {}
    for name, entry in found.items():
        targets.setdefault(entry, []).append(name)
    doubled = [f"{entry} <- {', '.join(names)}" for entry, names in targets.items() if len(names) > 1]
    if doubled:
        raise TransformError(f"{strategy}: several parameters match one entry of {ckpt}: {_listing(doubled)}")
    return found


def _renamed(layouts: dict[str, ParamLayout], names: dict[str, str]) -> dict[str, ParamLayout]:
    return {names[n]: ParamLayout(names[n], lay.dev_matrix, lay.tensor_map) for n, lay in layouts.items()}


def split_whole(src: str, dst_checkpoint: str, src_strategy: str | None, dst_strategy: str | None,
                prefix: str) -> str:
    """Cuts the whole checkpoint `src` into the shards of every rank of `dst_strategy`, written to
    `<dst_checkpoint>/rank_<i>/<prefix><i>.ckpt`; returns a one-line summary."""
    if src_strategy is not None:
        raise TransformError(f"--src_strategy: not used with a whole checkpoint (--src_checkpoint {src} is one .ckpt, "
                             "unsplit); for split checkpoints give their folder of rank_<i>/*.ckpt")
    if dst_strategy is None:
        raise TransformError(f"--src_checkpoint {src} is already one whole checkpoint: give --dst_strategy (the net's "
                             "strategy files, e.g. <output_dir>/strategy/train) to split it")
    dst = resolve_strategy(dst_strategy, "--dst_strategy")
    full = read_whole_checkpoint(src)
    names = checkpoint_names(dst.layouts, list(full), src, dst_strategy)
    stage_layouts = {stage: _renamed(held, names) for stage, held in dst.stage_layouts.items()}
    for held in stage_layouts.values():  # every shape fits its layout, before anything is written
        split_full(full, held, 0, src)
    check_dst_dir(dst_checkpoint)
    extra = [name for name in full if name not in set(names.values())]
    _warn_copied(extra, dst_strategy)
    for rank in range(dst.world):
        stage, local = divmod(rank, dst.stage_size)
        shards = split_full(full, stage_layouts[stage], local, src)
        entries = ((name, shards.get(name, full[name])) for name in full if name in shards or name in extra)
        write_checkpoint(entries, os.path.join(dst_checkpoint, f"rank_{rank}", f"{prefix}{rank}.ckpt"))
    _write_folder_strategy(dst_checkpoint, _renamed(dst.layouts, names),
                           {names[n]: s for n, s in dst.stages.items()})
    return (f"split {src} into {dst.world} rank(s) of {dst_strategy} in {dst_checkpoint} "
            f"(strategy: {os.path.join(dst_checkpoint, SHARD_STRATEGY)})")


def _write_folder_strategy(folder: str, layouts: dict[str, ParamLayout], stages: dict[str, int]) -> None:
    """`<folder>/strategy.ckpt`: the shards' strategy under their names (merged, with pipeline stages)."""
    staged = len(set(stages.values())) > 1
    write_strategy_file(os.path.join(folder, SHARD_STRATEGY), layouts, stages=stages if staged else None)


# ---------------------------------------------------------------- split checkpoints (MindSpore's transform)
def transform(src_checkpoint: str, dst_checkpoint: str, src_strategy: str | None = None,
              dst_strategy: str | None = None, prefix: str = "checkpoint_") -> str:
    """`src_checkpoint` (a whole `.ckpt`, or a folder of rank_<i>/*.ckpt with `src_strategy`, default its own
    strategy.ckpt) into the shards of `dst_strategy` in `dst_checkpoint` (without it: merged into one full
    checkpoint, `<dst_checkpoint>/rank_0/`); checks everything first, returns a one-line summary."""
    if not os.path.exists(src_checkpoint):  # before a missing --src_strategy is blamed
        raise TransformError(f"--src_checkpoint {src_checkpoint}: no such folder (or .ckpt file)")
    if os.path.isfile(src_checkpoint):
        return split_whole(src_checkpoint, dst_checkpoint, src_strategy, dst_strategy, prefix)
    src_strategy = src_strategy or _own_strategy(src_checkpoint)
    src = resolve_strategy(src_strategy, "--src_strategy")
    dst = resolve_strategy(dst_strategy, "--dst_strategy") if dst_strategy is not None else None
    if dst is not None:
        check_same_names(src.layouts, dst.layouts, src_strategy, dst_strategy)
    checkpoints = rank_checkpoints(src_checkpoint, src.world, src_strategy)
    unsplit = set()
    for stage, ranks in stage_ranks(src.layouts, src.stages, src_strategy).items():  # each stage's first rank
        held = {name: lay for name, lay in src.layouts.items() if src.stages[name] == stage}
        unsplit.update(check_checkpoint_matches(checkpoints[ranks[0]], held, src_strategy))
    _warn_copied(sorted(unsplit - set(src.layouts)), src_strategy)
    check_dst_dir(dst_checkpoint)
    with tempfile.TemporaryDirectory(prefix="transform_strategy_") as tmp:
        src_file = mindspore_strategy_file(src, tmp)
        dst_file = mindspore_strategy_file(dst, tmp) if dst is not None else None
        _run_mindspore(src_checkpoint, dst_checkpoint, prefix, src_file, dst_file)
    dst_world = dst.world if dst is not None else 1
    _check_outputs(dst_checkpoint, dst_world)
    if dst is not None:
        _write_folder_strategy(dst_checkpoint, dst.layouts, dst.stages)
    target = f"{dst_world} rank(s) of {dst_strategy}" if dst is not None else "one full checkpoint"
    return f"transformed {src.world} rank(s) of {src_strategy} into {target} in {dst_checkpoint}"


def _own_strategy(src_dir: str) -> str:
    path = os.path.join(src_dir, SHARD_STRATEGY)
    if not os.path.isfile(path):
        raise TransformError(f"--src_strategy: needed for the split checkpoint {src_dir} (it has no {SHARD_STRATEGY} "
                             "of its own); give the strategy file or folder of the job that wrote it")
    return path


def _run_mindspore(src_checkpoint: str, dst_checkpoint: str, prefix: str, src_file: str, dst_file: str | None) -> None:
    try:
        transform_checkpoints(src_checkpoint, dst_checkpoint, prefix, src_file, dst_file)
    except (ValueError, TypeError, OSError, RuntimeError) as err:
        raise TransformError(f"mindspore.parallel.transform_checkpoints failed: {err}") from err


def _check_outputs(dst_dir: str, dst_world: int) -> None:
    missing = [r for r in range(dst_world) if not glob.glob(os.path.join(dst_dir, f"rank_{r}", "*.ckpt"))]
    if missing:
        raise TransformError(f"--dst_checkpoint {dst_dir}: transform wrote no checkpoint for rank(s) {missing}")
