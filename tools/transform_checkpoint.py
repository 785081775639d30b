"""Offline checkpoint transform between parallel layouts (thin CLI over `mindspore.parallel.transform_checkpoints`).

    python tools/transform_checkpoint.py --src_checkpoint ckpt/ --src_strategy strategy/ --dst_checkpoint out/
    python tools/transform_checkpoint.py ... --dst_strategy infer_strategy.ckpt   # re-split for another layout

`--src_checkpoint` holds one folder per rank, `rank_<i>/*.ckpt` (MindSpore takes the last file in name order).
A strategy is a protobuf strategy file or a folder of them (`*.ckpt`, one per rank, all describing the same
layout); a net in pipeline stages is given by its merged strategy (the trainer's `train_strategy.ckpt`, or
`mindspore.parallel.merge_pipeline_strategys` of the stages' files), each rank's checkpoint holding its stage.
Without `--dst_strategy` the checkpoint is merged into one full checkpoint, `<dst>/rank_0/`.
Everything that can be checked is checked before MindSpore is called, so mistakes fail with a message
naming the file instead of producing wrong weights.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys

try:
    from mindrlhf.parallel.strategy import (
        ParamLayout,
        StrategyError,
        read_staged_strategy_file,
        stage_ranks,
        staged_world_size,
    )
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mindrlhf.parallel.strategy import (
        ParamLayout,
        StrategyError,
        read_staged_strategy_file,
        stage_ranks,
        staged_world_size,
    )

_RANK_DIR = re.compile(r"^rank_(\d+)$")


class TransformError(Exception):
    """A problem found before (or while) transforming; the message names the path."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src_checkpoint", required=True, help="folder with rank_<i>/*.ckpt of the source job")
    parser.add_argument("--src_strategy", required=True, help="source strategy file, or a folder of per-rank files")
    parser.add_argument("--dst_checkpoint", required=True, help="output folder (rank_<i>/ are created in it)")
    parser.add_argument("--dst_strategy", default=None,
                        help="destination strategy file or folder; omitted = merge into one full checkpoint")
    parser.add_argument("--prefix", default="checkpoint_",
                        help="output file name prefix: <dst>/rank_<i>/<prefix><i>.ckpt")
    return parser.parse_args(argv)


# ---------------------------------------------------------------- strategies
def _numeric_key(path: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(path)))


def resolve_strategy(path: str, flag: str) -> tuple[str, dict[str, ParamLayout], dict[str, int]]:
    """(one strategy file to give MindSpore, its layouts, each parameter's pipeline stage); a folder's files
    must all agree."""
    if not os.path.exists(path):
        raise TransformError(f"{flag} {path}: no such file or folder")
    files = sorted(glob.glob(os.path.join(path, "*.ckpt")), key=_numeric_key) if os.path.isdir(path) else [path]
    if not files:
        raise TransformError(f"{flag} {path}: folder holds no strategy files (*.ckpt)")
    read = {}
    for file in files:
        try:
            read[file] = read_staged_strategy_file(file)
        except StrategyError as err:
            raise TransformError(f"{flag}: strategy not readable: {err}") from None
    _check_same_world_size(read, flag)
    _check_same_layouts(read, flag)
    return files[0], *read[files[0]]


def _check_same_world_size(read: dict[str, tuple[dict, dict]], flag: str) -> None:
    sizes = {}
    for file, (layouts, stages) in read.items():
        try:
            sizes[file] = staged_world_size(layouts, stages, file)
        except StrategyError as err:
            raise TransformError(f"{flag}: {err}") from None
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{os.path.basename(f)}: {n}" for f, n in sizes.items())
        raise TransformError(f"{flag}: strategy files of different world sizes ({listing}); "
                             "give the files of one job")


def _check_same_layouts(read: dict[str, tuple[dict, dict]], flag: str) -> None:
    (first, (reference, _)), *others = read.items()
    for file, (layouts, _) in others:
        if layouts == reference:
            continue
        differing = sorted(set(layouts) ^ set(reference)) or sorted(
            n for n in layouts if layouts[n] != reference[n])
        name = differing[0]
        raise TransformError(f"{flag}: {file} and {first} disagree on parameter '{name}' "
                             f"({_describe(layouts.get(name))} vs {_describe(reference.get(name))}); "
                             "pipeline-stage files must be merged first (mindspore.parallel.merge_pipeline_strategys)")


def _describe(layout: ParamLayout | None) -> str:
    return "absent" if layout is None else layout.describe()


# ---------------------------------------------------------------- checkpoints
def rank_checkpoints(src_dir: str, world_size: int, strategy_file: str) -> dict[int, str]:
    """rank -> the checkpoint file MindSpore will read; every rank of the strategy must have one."""
    if not os.path.isdir(src_dir):
        raise TransformError(f"--src_checkpoint {src_dir}: no such folder")
    found = {}
    for entry in os.listdir(src_dir):
        match = _RANK_DIR.match(entry)
        files = sorted(glob.glob(os.path.join(src_dir, entry, "*.ckpt")))
        if match and files:
            found[int(match.group(1))] = files[-1]
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
    import mindspore as ms

    shapes = {name: tuple(param.shape) for name, param in ms.load_checkpoint(ckpt_file).items()}
    absent = sorted(set(layouts) - set(shapes))
    if absent:
        raise TransformError(f"{strategy_file} names parameters missing from {ckpt_file}: {', '.join(absent[:20])}"
                             f"{' ...' if len(absent) > 20 else ''}")
    for name, layout in layouts.items():
        if len(shapes[name]) != layout.ndim:
            raise TransformError(f"parameter '{name}': shape {list(shapes[name])} in {ckpt_file} does not fit "
                                 f"{layout.describe()} in {strategy_file}")
    return sorted(set(shapes) - set(layouts))


def check_dst_dir(dst_dir: str) -> None:
    if os.path.isfile(dst_dir):
        raise TransformError(f"--dst_checkpoint {dst_dir}: is a file, expected a folder")
    if os.path.isdir(dst_dir) and any(_RANK_DIR.match(e) for e in os.listdir(dst_dir)):
        raise TransformError(f"--dst_checkpoint {dst_dir}: already holds rank_<i> folders; choose an empty folder")


def check_same_names(src: dict[str, ParamLayout], dst: dict[str, ParamLayout], src_file: str, dst_file: str) -> None:
    only_src, only_dst = sorted(set(src) - set(dst)), sorted(set(dst) - set(src))
    if only_src or only_dst:
        raise TransformError(f"strategies name different parameters: only in {src_file}: "
                             f"{', '.join(only_src[:20]) or '-'}; "
                             f"only in {dst_file}: {', '.join(only_dst[:20]) or '-'}")


# ---------------------------------------------------------------- main
def transform(args: argparse.Namespace) -> str:
    """Checks everything, runs the transform, returns a one-line summary."""
    src_file, src_layouts, src_stages = resolve_strategy(args.src_strategy, "--src_strategy")
    src_world = staged_world_size(src_layouts, src_stages, src_file)
    dst_file, dst_world = None, 1
    if args.dst_strategy is not None:
        dst_file, dst_layouts, dst_stages = resolve_strategy(args.dst_strategy, "--dst_strategy")
        dst_world = staged_world_size(dst_layouts, dst_stages, dst_file)
        check_same_names(src_layouts, dst_layouts, src_file, dst_file)
    checkpoints = rank_checkpoints(args.src_checkpoint, src_world, src_file)
    unsplit = set()
    for stage, ranks in stage_ranks(src_layouts, src_stages, src_file).items():  # each stage's first rank
        held = {name: lay for name, lay in src_layouts.items() if src_stages[name] == stage}
        unsplit.update(check_checkpoint_matches(checkpoints[ranks[0]], held, src_file))
    unsplit = sorted(unsplit - set(src_layouts))
    if unsplit:
        print(f"warning: {len(unsplit)} checkpoint entries not in {src_file} are copied unchanged "
              f"(fine for step counters, wrong for split tensors): {', '.join(unsplit[:10])}", file=sys.stderr)
    check_dst_dir(args.dst_checkpoint)
    _run_mindspore(args, src_file, dst_file)
    _check_outputs(args.dst_checkpoint, dst_world)
    target = f"{dst_world} rank(s) of {dst_file}" if dst_file else "one full checkpoint"
    return f"transformed {src_world} rank(s) of {src_file} into {target} in {args.dst_checkpoint}"


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
