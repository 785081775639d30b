"""Offline checkpoint transform between parallel layouts.

Split one whole checkpoint into per-rank shards for a net's strategy (MindRLHF's tutorial):

    python tools/transform_checkpoint.py --src_checkpoint=/path/qwen2_5_7b.ckpt --dst_checkpoint=/path/ckpt_dir \\
        --dst_strategy=/path/strategy_dir

A whole `.ckpt` (as tools/convert_weight.py writes it) is unsplit, so it needs no `--src_strategy`. The
destination strategy is the folder of per-rank strategy files `grpo_one_stage.py --only_save_strategy` wrote for
one net (`<output_dir>/strategy/train/`, `.../infer/`, `.../ref/`; with pipeline stages each stage's files differ
and are merged here), or one strategy file. Its parameter names may carry the net's prefix (`infer.`, `ref.`,
`critic.`, `reward_model.`); each is matched to the checkpoint entry of the same name, else to the entry without
the prefix, and a strategy parameter with neither is an error. Each rank's shards are cut here (by the strategy's
device matrices and tensor maps, as `mindspore.parallel.transform_checkpoints` cuts them, bit for bit) and written
to `<dst>/rank_<i>/<prefix><i>.ckpt` under the checkpoint's names, with the (merged) strategy under the same names
in `<dst>/strategy.ckpt`, so the folder describes itself. Every file is written to a temporary name and renamed.
Entries of the checkpoint that the strategy does not name are copied whole to every rank (with a warning), as
MindSpore does. Give the folder to `--load_sft_checkpoint_train`, `--load_sft_checkpoint_infer` or
`--load_ref_checkpoint`: each rank reads only its own shards.

Transform split checkpoints (a thin CLI over `mindspore.parallel.transform_checkpoints`):

    python tools/transform_checkpoint.py --src_checkpoint ckpt/ --src_strategy strategy/ --dst_checkpoint out/
    python tools/transform_checkpoint.py ... --dst_strategy infer_strategy.ckpt   # re-split for another layout

Such a `--src_checkpoint` holds one folder per rank, `rank_<i>/*.ckpt` (MindSpore takes the last file in name
order); without `--src_strategy` its own `strategy.ckpt` is used (folders this tool wrote have one). A strategy is
a protobuf strategy file or a folder of them (`*.ckpt`, one per rank: files of one pipeline stage must agree, the
stages' files are merged as `mindspore.parallel.merge_pipeline_strategys` does), or a net's merged strategy (the
trainer's `train_strategy.ckpt`); each rank's checkpoint holds its stage. Without `--dst_strategy` the
checkpoint is merged into one full checkpoint, `<dst>/rank_0/`.

Everything that can be checked is checked before anything is written, so mistakes fail with a message naming the
file instead of producing wrong weights.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
from dataclasses import dataclass

try:
    from mindrlhf.checkpoint.shards import RANK_DIR, SHARD_STRATEGY, rank_files
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mindrlhf.checkpoint.shards import RANK_DIR, SHARD_STRATEGY, rank_files
from mindrlhf.checkpoint.step import NET_PREFIXES, plain_name
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
from mindrlhf.utils.checkpoint_file import read_checkpoint, write_checkpoint

_LISTED = 20


class TransformError(Exception):
    """A problem found before (or while) transforming; the message names the path."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src_checkpoint", required=True,
                        help="one whole .ckpt (unsplit), or a folder with rank_<i>/*.ckpt of the source job")
    parser.add_argument("--src_strategy", default=None,
                        help="source strategy file, or a folder of per-rank files; not used with a whole .ckpt; "
                             "default for a folder: its own strategy.ckpt")
    parser.add_argument("--dst_checkpoint", required=True, help="output folder (rank_<i>/ are created in it)")
    parser.add_argument("--dst_strategy", default=None,
                        help="destination strategy file or folder of per-rank (per-stage) files, e.g. "
                             "<output_dir>/strategy/train; omitted = merge into one full checkpoint")
    parser.add_argument("--prefix", default="checkpoint_",
                        help="output file name prefix: <dst>/rank_<i>/<prefix><i>.ckpt")
    return parser.parse_args(argv)


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
    from mindspore.parallel import merge_pipeline_strategys

    merged = os.path.join(tmp_dir, f"merged_{len(os.listdir(tmp_dir))}.ckpt")
    merge_pipeline_strategys(strategy.path, merged)
    return merged


# ---------------------------------------------------------------- checkpoints
def rank_checkpoints(src_dir: str, world_size: int, strategy_file: str) -> dict[int, str]:
    """rank -> the checkpoint file MindSpore will read; every rank of the strategy must have one."""
    if not os.path.isdir(src_dir):
        raise TransformError(f"--src_checkpoint {src_dir}: no such folder")
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
    shapes = {name: tuple(param.shape) for name, param in read_checkpoint(ckpt_file).items()}
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
    """name -> numpy array of a whole `.ckpt`, in the file's order; an error names the file."""
    try:
        params = read_checkpoint(path)
    except (RuntimeError, ValueError) as err:
        raise TransformError(f"--src_checkpoint {path}: not a readable MindSpore checkpoint "
                             f"({str(err).splitlines()[0]})") from None
    return {name: params.pop(name).asnumpy() for name in list(params)}


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


def split_whole(args: argparse.Namespace) -> str:
    """Cuts the whole checkpoint `args.src_checkpoint` into the shards of every rank of `args.dst_strategy`."""
    src = args.src_checkpoint
    if args.src_strategy is not None:
        raise TransformError(f"--src_strategy: not used with a whole checkpoint (--src_checkpoint {src} is one .ckpt, "
                             "unsplit); for split checkpoints give their folder of rank_<i>/*.ckpt")
    if args.dst_strategy is None:
        raise TransformError(f"--src_checkpoint {src} is already one whole checkpoint: give --dst_strategy (the net's "
                             "strategy files, e.g. <output_dir>/strategy/train) to split it")
    dst = resolve_strategy(args.dst_strategy, "--dst_strategy")
    full = read_whole_checkpoint(src)
    names = checkpoint_names(dst.layouts, list(full), src, args.dst_strategy)
    stage_layouts = {stage: _renamed(held, names) for stage, held in dst.stage_layouts.items()}
    for held in stage_layouts.values():  # every shape fits its layout, before anything is written
        split_full(full, held, 0, src)
    check_dst_dir(args.dst_checkpoint)
    extra = [name for name in full if name not in set(names.values())]
    _warn_copied(extra, args.dst_strategy)
    for rank in range(dst.world):
        stage, local = divmod(rank, dst.stage_size)
        shards = split_full(full, stage_layouts[stage], local, src)
        entries = ((name, shards.get(name, full[name])) for name in full if name in shards or name in extra)
        write_checkpoint(entries, os.path.join(args.dst_checkpoint, f"rank_{rank}", f"{args.prefix}{rank}.ckpt"))
    _write_folder_strategy(args.dst_checkpoint, _renamed(dst.layouts, names),
                           {names[n]: s for n, s in dst.stages.items()})
    return (f"split {src} into {dst.world} rank(s) of {args.dst_strategy} in {args.dst_checkpoint} "
            f"(strategy: {os.path.join(args.dst_checkpoint, SHARD_STRATEGY)})")


def _write_folder_strategy(folder: str, layouts: dict[str, ParamLayout], stages: dict[str, int]) -> None:
    """`<folder>/strategy.ckpt`: the shards' strategy under their names (merged, with pipeline stages)."""
    staged = len(set(stages.values())) > 1
    write_strategy_file(os.path.join(folder, SHARD_STRATEGY), layouts, stages=stages if staged else None)


# ---------------------------------------------------------------- split checkpoints (MindSpore's transform)
def transform(args: argparse.Namespace) -> str:
    """Checks everything, runs the transform, returns a one-line summary."""
    if os.path.isfile(args.src_checkpoint):
        return split_whole(args)
    src_strategy = args.src_strategy or _own_strategy(args.src_checkpoint)
    src = resolve_strategy(src_strategy, "--src_strategy")
    dst = resolve_strategy(args.dst_strategy, "--dst_strategy") if args.dst_strategy is not None else None
    if dst is not None:
        check_same_names(src.layouts, dst.layouts, src_strategy, args.dst_strategy)
    checkpoints = rank_checkpoints(args.src_checkpoint, src.world, src_strategy)
    unsplit = set()
    for stage, ranks in stage_ranks(src.layouts, src.stages, src_strategy).items():  # each stage's first rank
        held = {name: lay for name, lay in src.layouts.items() if src.stages[name] == stage}
        unsplit.update(check_checkpoint_matches(checkpoints[ranks[0]], held, src_strategy))
    _warn_copied(sorted(unsplit - set(src.layouts)), src_strategy)
    check_dst_dir(args.dst_checkpoint)
    with tempfile.TemporaryDirectory(prefix="transform_strategy_") as tmp:
        src_file = mindspore_strategy_file(src, tmp)
        dst_file = mindspore_strategy_file(dst, tmp) if dst is not None else None
        _run_mindspore(args, src_file, dst_file)
    dst_world = dst.world if dst is not None else 1
    _check_outputs(args.dst_checkpoint, dst_world)
    if dst is not None:
        _write_folder_strategy(args.dst_checkpoint, dst.layouts, dst.stages)
    target = f"{dst_world} rank(s) of {args.dst_strategy}" if dst is not None else "one full checkpoint"
    return f"transformed {src.world} rank(s) of {src_strategy} into {target} in {args.dst_checkpoint}"


def _own_strategy(src_dir: str) -> str:
    path = os.path.join(src_dir, SHARD_STRATEGY)
    if not os.path.isfile(path):
        raise TransformError(f"--src_strategy: needed for the split checkpoint {src_dir} (it has no {SHARD_STRATEGY} "
                             "of its own); give the strategy file or folder of the job that wrote it")
    return path


def _run_mindspore(args: argparse.Namespace, src_file: str, dst_file: str | None) -> None:
    from mindspore.parallel import transform_checkpoints

    try:
        transform_checkpoints(args.src_checkpoint, args.dst_checkpoint, args.prefix, src_file, dst_file)
    except (ValueError, TypeError, OSError, RuntimeError) as err:
        raise TransformError(f"mindspore.parallel.transform_checkpoints failed: {err}") from err


def _check_outputs(dst_dir: str, dst_world: int) -> None:
    missing = [r for r in range(dst_world) if not glob.glob(os.path.join(dst_dir, f"rank_{r}", "*.ckpt"))]
    if missing:
        raise TransformError(f"--dst_checkpoint {dst_dir}: transform wrote no checkpoint for rank(s) {missing}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(transform(args))
    except (TransformError, StrategyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
