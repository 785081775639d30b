"""GRPO training of a Qwen2/Qwen2.5 policy: train and inference nets in two layouts on the same ranks.

    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True --log_dir=output/msrun_log \\
        examples/qwen_grpo_tutorial/grpo_one_stage.py --sft_path_train train.yaml --sft_path_infer infer.yaml \\
        --vocab_path vocab.json --merges_file_path merges.txt --mind_dataset_dir data.mindrecord \\
        --load_sft_checkpoint_train policy.ckpt --config grpo.yaml --steps 100

Every GRPOConfig field is a flag too (`--help` lists them); a flag overrides the `--config` YAML.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mindrlhf.configs.cli import add_config_flags
from mindrlhf.trainer.launch import run_job


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    job = parser.add_argument_group("job (MindRLHF flag names)")
    job.add_argument("--sft_path_train", required=True, help="model YAML of the train net (its parallel_config "
                                                             "is the train layout)")
    job.add_argument("--sft_path_infer", required=True, help="model YAML of the inference and reference nets")
    job.add_argument("--mind_dataset_dir", required=True, help="prompt MindRecord written by rlhf_data.py")
    job.add_argument("--eval_dataset_dir", default="", help="held-out prompt MindRecord: greedy accuracy on every "
                                                            "prompt before the first step, every eval_interval "
                                                            "steps and after the last")
    job.add_argument("--tokenizer_dir", default=None, help="Hugging Face tokenizer folder (tokenizer.json or "
                                                           "vocab.json + merges.txt)")
    job.add_argument("--vocab_path", default=None, help="vocab.json (with --merges_file_path)")
    job.add_argument("--merges_file_path", default=None, help="merges.txt (with --vocab_path)")
    job.add_argument("--config", default=None, help="GRPOConfig YAML (sections generation, loss, reward, optimizer, "
                                                    "schedule, checkpoint, eval)")
    job.add_argument("--output_dir", default="output/grpo", help="logs, metrics.jsonl, strategy files")
    job.add_argument("--save_ckpt_dir", default="", help="checkpoint folder (default <output_dir>/checkpoints)")
    job.add_argument("--load_sft_checkpoint_train", default="", help="starting policy: full .ckpt or trainer "
                                                                     "step folder (default: seeded random weights)")
    job.add_argument("--load_sft_checkpoint_infer", default="", help="inference weights (default: resharded from "
                                                                     "the train net)")
    job.add_argument("--load_ref_checkpoint", default="", help="reference weights (default: the starting policy)")
    job.add_argument("--save_data_file", default="", help="write each step's experience as MindRecord "
                                                          "<path>.step_<N>.mindrecord")
    job.add_argument("--tensorboard_dir", default="", help="write TensorBoard event files here")
    job.add_argument("--resume", nargs="?", const="auto", default="",
                     help="resume: 'auto' (newest complete checkpoint in save_ckpt_dir) or a step folder")
    job.add_argument("--use_parallel", default="auto", choices=["auto", "true", "false"],
                     help="initialise MindSpore communication (auto: when launched by msrun)")
    job.add_argument("--only_save_strategy", action="store_true", help="write the nets' strategy files and exit")
    job.add_argument("--enable_compile_cache", action="store_true", help="turn on MindSpore's compile cache")
    job.add_argument("--cpu_threads", type=int, default=0,
                     help="CPU backend: kernel threads per rank (0 = the host's cores / the ranks on this host)")
    job.add_argument("--init_seed", type=int, default=0, help="seed of random weights when no checkpoint is given")
    add_config_flags(parser.add_argument_group("GRPOConfig fields"))
    return parser


def main(argv: list[str] | None = None, callbacks=None) -> int:
    """Parses the flags and runs the job; returns the exit code (2 with a one-line error for bad input)."""
    return run_job(build_parser().parse_args(argv), callbacks)


if __name__ == "__main__":
    sys.exit(main())
