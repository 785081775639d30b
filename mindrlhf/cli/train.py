"""GRPO training of a Qwen2/Qwen2.5 policy: train and inference nets in two layouts on the same ranks.

    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True --log_dir=output/msrun_log \\
        examples/qwen_grpo_tutorial/grpo_one_stage.py --sft_path_train train.yaml --sft_path_infer infer.yaml \\
        --vocab_path vocab.json --merges_file_path merges.txt --mind_dataset_dir data.mindrecord \\
        --load_sft_checkpoint_train policy.ckpt --config grpo.yaml --steps 100

The same command is installed as `mindrlhf-train` (under msrun: `msrun ... $(command -v mindrlhf-train) ...`).
Every GRPOConfig field is a flag too (`--help` lists them); a flag overrides the `--config` YAML.
"""
from __future__ import annotations

import argparse
from typing import NoReturn

from mindrlhf.configs.cli import OneLineErrorParser, add_config_flags
from mindrlhf.configs.job import JobOptions
from mindrlhf.trainer.launch import run_job, run_script


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    JobOptions.add_flags(parser.add_argument_group("job (MindRLHF flag names)"))
    add_config_flags(parser.add_argument_group("GRPOConfig fields"))
    return parser


def main(argv: list[str] | None = None, callbacks=None) -> int:
    """Parses the flags and runs the job; returns the exit code (2 with a one-line error for bad input; a bad
    flag exits with 2 and `grpo_one_stage.py: error: ...`, without the usage)."""
    return run_job(build_parser().parse_args(argv), callbacks)


def run() -> NoReturn:
    """The process's entry (console script, tutorial path): `main` with the job's exit handling."""
    run_script(main)


if __name__ == "__main__":
    run()
