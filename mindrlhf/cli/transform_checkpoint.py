"""Offline checkpoint transform between parallel layouts (`mindrlhf-transform-checkpoint`; the transforms
themselves are mindrlhf/checkpoint/transform.py).

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
import sys

from mindrlhf.checkpoint.step import CheckpointError
from mindrlhf.checkpoint.transform import TransformError, transform
from mindrlhf.parallel.strategy import StrategyError


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(transform(args.src_checkpoint, args.dst_checkpoint, args.src_strategy, args.dst_strategy,
                        args.prefix))
    except (TransformError, StrategyError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
