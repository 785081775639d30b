"""Runs a GRPO job from parsed command-line flags: config, tokenizer, communication, trainer; one-line errors."""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable

from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.cli import config_overrides
from mindrlhf.configs.grpo_configs import GRPOConfig

logger = logging.getLogger("mindrlhf.trainer")

_LAUNCHED_BY_MSRUN = ("MS_WORKER_NUM", "MS_ROLE")


def load_config(args: argparse.Namespace) -> GRPOConfig:
    """`--config` YAML (or the defaults) with the command-line overrides applied, validated."""
    config = GRPOConfig.from_yaml(args.config) if args.config else GRPOConfig()
    overrides = config_overrides(args)
    if overrides:
        config = config.replace(overrides)
    config.validate()
    return config


def load_job_tokenizer(args: argparse.Namespace):
    from mindrlhf.models.tokenizer import load_tokenizer

    if not args.tokenizer_dir and not (args.vocab_path and args.merges_file_path):
        raise ConfigError("tokenizer: give --tokenizer_dir, or --vocab_path and --merges_file_path")
    return load_tokenizer(tokenizer_dir=args.tokenizer_dir, vocab_path=args.vocab_path,
                          merges_file_path=args.merges_file_path)


def _check_files(args: argparse.Namespace) -> None:
    for flag in ("sft_path_train", "sft_path_infer", "mind_dataset_dir"):
        path = getattr(args, flag)
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: --{flag} file not found")
    if args.eval_dataset_dir and not os.path.isfile(args.eval_dataset_dir):
        raise ConfigError(f"{args.eval_dataset_dir}: --eval_dataset_dir file not found")
    for flag in ("load_sft_checkpoint_train", "load_sft_checkpoint_infer", "load_ref_checkpoint"):
        path = getattr(args, flag)
        if path and not os.path.exists(path):
            raise ConfigError(f"{path}: --{flag} not found")


def init_communication(use_parallel: str) -> tuple[int, int]:
    """(world size, rank); initialises MindSpore communication when running under msrun (or asked to)."""
    launched = any(os.environ.get(name) for name in _LAUNCHED_BY_MSRUN)
    if use_parallel == "false" or (use_parallel == "auto" and not launched):
        return 1, 0
    from mindspore.communication import get_group_size, get_rank, init
    init()
    return get_group_size(), get_rank()


def threads_per_rank(cores: int, ranks_on_host: int, requested: int = 0) -> int:
    """CPU kernel threads for one rank: `requested`, or (0) this host's cores shared evenly by its ranks.

    MindSpore sizes each process's kernel thread pool on its own (25 threads by default); ranks sharing a few
    cores then oversubscribe them, and barrier-style pools collapse (2 ranks on 2 cores: the bundled job's
    updates ran 2x slower than one process)."""
    return requested or max(1, cores // max(1, ranks_on_host))


def configure_cpu_threads(requested: int, world_size: int) -> int | None:
    """Sets the CPU kernel thread pool of this process (CPU backend only, once per process: MindSpore refuses
    a second setting); returns the threads set, or None."""
    import mindspore as ms
    from mindspore._c_expression import RuntimeConf

    if ms.get_context("device_target") != "CPU" or RuntimeConf.get_instance().is_op_threads_num_configured():
        return None
    from mindspore.device_context.cpu.op_tuning import threads_num

    ranks_on_host = 1
    if world_size > 1:
        from mindspore.communication import get_local_rank_size
        ranks_on_host = get_local_rank_size()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = threads_per_rank(cores, ranks_on_host, requested)
    threads_num(threads)
    return threads


def run_job(args: argparse.Namespace, callbacks: list[Callable] | None = None) -> int:
    """Runs the job; returns the process exit code. Bad input prints `error: <where>: <problem>` and gives 2."""
    import mindspore as ms

    from mindrlhf.trainer.grpo_trainer import GRPOTrainer, JobOptions
    from mindrlhf.utils.logging import setup_logging

    try:
        config = load_config(args)
        if args.cpu_threads < 0:
            raise ConfigError(f"--cpu_threads must be >= 0 (0 = cores / ranks on this host), got {args.cpu_threads}")
        _check_files(args)
        tokenizer = load_job_tokenizer(args)
    except (ConfigError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    ms.set_context(mode=ms.GRAPH_MODE)
    world_size, rank = init_communication(args.use_parallel)
    setup_logging(rank=rank)
    threads = configure_cpu_threads(args.cpu_threads, world_size)
    if threads:
        logger.info("CPU kernel threads per rank: %d", threads)
    # the pid lets `mindrlhf.trainer.postmortem` map msrun's "Worker process <pid> exit" to this rank
    logger.info("rank %d of %d started as pid %d on %s", rank, world_size, os.getpid(), socket.gethostname())
    job = JobOptions(sft_path_train=args.sft_path_train, sft_path_infer=args.sft_path_infer,
                     mind_dataset_dir=args.mind_dataset_dir, eval_dataset_dir=args.eval_dataset_dir,
                     output_dir=args.output_dir,
                     save_ckpt_dir=args.save_ckpt_dir, load_sft_checkpoint_train=args.load_sft_checkpoint_train,
                     load_sft_checkpoint_infer=args.load_sft_checkpoint_infer,
                     load_ref_checkpoint=args.load_ref_checkpoint, save_data_file=args.save_data_file,
                     tensorboard_dir=args.tensorboard_dir, resume=args.resume, init_seed=args.init_seed,
                     only_save_strategy=args.only_save_strategy, enable_compile_cache=args.enable_compile_cache)
    try:
        trainer = GRPOTrainer(config, job, tokenizer, world_size, rank, callbacks)
    except ValueError as err:  # ConfigError, DataError, LayoutError, StrategyError, CheckpointError
        print(f"error: {err}", file=sys.stderr)
        return 2
    if job.only_save_strategy:
        paths = trainer.save_strategies(os.path.join(job.output_dir, "strategy"))
        logger.info("strategy files written: %s", ", ".join(paths.values()))
        return 0
    trainer.fit()
    return 0
