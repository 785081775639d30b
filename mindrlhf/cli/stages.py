"""The stages before RL, on the train YAML's net and layout: supervised fine-tuning (`mindrlhf-sft`, on
`rlhf_data.py --kind sft` conversations), reward-model training (`mindrlhf-reward`) and DPO (`mindrlhf-dpo`), both on
`--kind pairwise` preference pairs.

    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True --log_dir=output/sft/msrun_log \\
        $(command -v mindrlhf-sft) --sft_path_train train.yaml --tokenizer_dir tokenizer/ \\
        --mind_dataset_dir sft.mindrecord --load_sft_checkpoint_train base/ --epochs 2 --learning_rate 1e-5

Every GRPOConfig field is a flag too (the optimizer, schedule, checkpoint and eval sections, sft.* for every stage,
dpo.*, reward_model.*); the last line says `held-out loss: before=X after=Y` (SFT) or `held-out pair accuracy` /
`held-out accuracy: before=A% after=B%` (reward model / DPO). The step folders under <output_dir>/checkpoints load
where the RL job takes the net: a policy (`--load_sft_checkpoint_train <step folder>`), a reward model
(`--load_critic_checkpoint`, `reward.reward_model_path`).
"""
from __future__ import annotations

import argparse
from typing import NoReturn

from mindrlhf.configs.cli import OneLineErrorParser, add_config_flags
from mindrlhf.configs.job import JobOptions
from mindrlhf.trainer.launch import run_job, run_script

OUTPUT_DIRS = {"sft": "output/sft", "reward": "output/reward", "dpo": "output/dpo"}


def build_parser(stage: str) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    JobOptions.add_flags(parser.add_argument_group("job"), optional=("sft_path_infer",),
                         defaults={"stage": stage, "output_dir": OUTPUT_DIRS[stage]})
    add_config_flags(parser.add_argument_group("config fields"))
    return parser


def main(stage: str, argv: list[str] | None = None) -> int:
    """Parses the flags and runs the stage's job; returns the exit code (2 with a one-line error for bad input)."""
    return run_job(build_parser(stage).parse_args(argv))


def sft() -> NoReturn:
    """`mindrlhf-sft`: the process's entry, with the job's exit handling."""
    run_script(lambda: main("sft"))


def reward() -> NoReturn:
    """`mindrlhf-reward`."""
    run_script(lambda: main("reward"))


def dpo() -> NoReturn:
    """`mindrlhf-dpo`."""
    run_script(lambda: main("dpo"))
