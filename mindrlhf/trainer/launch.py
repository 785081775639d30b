"""Runs an RL job from parsed command-line flags: config, tokenizer, communication, trainer; one-line errors."""
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
from mindrlhf.configs.job import JobOptions

logger = logging.getLogger("mindrlhf.trainer")

_LAUNCHED_BY_MSRUN = ("MS_WORKER_NUM", "MS_ROLE")


def load_config(job: JobOptions, args: argparse.Namespace) -> GRPOConfig:
    """`--config` YAML (or the defaults) with the command-line overrides of `args` applied, validated."""
    config = GRPOConfig.from_yaml(*job.config) if job.config else GRPOConfig()
    overrides = config_overrides(args)
    if overrides:
        config = config.replace(overrides)
    config.validate()
    return config


def load_job_tokenizer(job: JobOptions):
    from mindrlhf.models.tokenizer import load_tokenizer

    if not job.tokenizer_dir and not (job.vocab_path and job.merges_file_path):
        raise ConfigError("tokenizer: give --tokenizer_dir, or --vocab_path and --merges_file_path")
    return load_tokenizer(tokenizer_dir=job.tokenizer_dir or None, vocab_path=job.vocab_path or None,
                          merges_file_path=job.merges_file_path or None)


def _check_files(job: JobOptions) -> None:
    for flag in ("sft_path_train", "sft_path_infer", "mind_dataset_dir"):
        path = getattr(job, flag)
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: --{flag} file not found")
    if job.eval_dataset_dir and not os.path.isfile(job.eval_dataset_dir):
        raise ConfigError(f"{job.eval_dataset_dir}: --eval_dataset_dir file not found")
    for flag in ("load_sft_checkpoint_train", "load_sft_checkpoint_infer", "load_ref_checkpoint"):
        path = getattr(job, flag)
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


def cores_of_rank(cores: list[int], ranks_on_host: int, local_rank: int) -> list[int]:
    """This rank's share of the host's `cores`: consecutive, as even as the count allows; every core when the
    host has fewer cores than ranks (they must share them anyway).

    MindSpore's CPU matmuls run on every core the process may use, whatever its kernel thread setting, so ranks
    sharing a host oversubscribe the cores unless each keeps to its own (on 2 cores, 2 ranks of the bundled job
    generated 23% faster pinned, `docs/performance.md`)."""
    if ranks_on_host <= 1 or len(cores) < ranks_on_host:
        return list(cores)
    return list(cores[local_rank * len(cores) // ranks_on_host:(local_rank + 1) * len(cores) // ranks_on_host])


def memory_pool_gib(host_memory_gib: float, ranks_on_host: int) -> int:
    """The CPU memory pool's initial size for one rank: this host's memory shared evenly by its ranks (at least
    MindSpore's default 2 GiB).

    The pool grows in separate 2 GiB blocks by default, and a buffer never spans two blocks: a train step whose
    gradients and logits are each hundreds of MiB then fragments the blocks and the pool grows from one call to
    the next (a Qwen2.5-0.5B-shaped train step: 12.6, 13.5, 13.9 GiB after calls 1-3; with one block the size of
    the rank's share, 12.5 GiB from the first call on). Reserving the block costs nothing until pages are
    touched."""
    return max(2, int(host_memory_gib // max(1, ranks_on_host)))


def _ranks_on_host(world_size: int) -> int:
    if world_size <= 1:
        return 1
    from mindspore.communication import get_local_rank_size
    return get_local_rank_size()


def configure_cpu_memory_pool(world_size: int) -> int | None:
    """Sizes the CPU backend's memory pool as one block of this rank's share of the host's memory
    (`memory_pool_gib`; once per process, before the first graph runs); returns the GiB set, or None (another
    backend, or the pool was set already)."""
    import mindspore as ms

    if ms.get_context("device_target") != "CPU":
        return None
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gib = memory_pool_gib(host_gib, _ranks_on_host(world_size))
    try:
        ms.runtime.set_memory(init_size=f"{gib}GB")
    except RuntimeError:  # "can not be set repeatedly": a caller (tests, a notebook) chose it already
        return None
    return gib


def configure_cpu_threads(requested: int, world_size: int) -> int | None:
    """Sets the CPU kernel thread pool of this process (CPU backend only, once per process: MindSpore refuses
    a second setting); returns the threads set, or None."""
    import mindspore as ms
    from mindspore._c_expression import RuntimeConf

    if ms.get_context("device_target") != "CPU" or RuntimeConf.get_instance().is_op_threads_num_configured():
        return None
    from mindspore.device_context.cpu.op_tuning import threads_num

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = threads_per_rank(cores, _ranks_on_host(world_size), requested)
    threads_num(threads)
    return threads


def pin_cpu_cores(mode: str, world_size: int) -> list[int] | None:
    """Keeps this process's threads on its share of the host's cores (`cores_of_rank`; CPU backend, several
    ranks on the host, `mode` "auto"); returns the cores it may now use, or None when nothing was pinned.
    Threads created later inherit the setting."""
    import mindspore as ms

    if mode != "auto" or world_size <= 1 or ms.get_context("device_target") != "CPU" or \
            not hasattr(os, "sched_setaffinity"):
        return None
    from mindspore.communication import get_local_rank

    cores = sorted(os.sched_getaffinity(0))
    mine = cores_of_rank(cores, _ranks_on_host(world_size), get_local_rank())
    if mine == cores:
        return None
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), mine)
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(os.sched_getaffinity(0))


def share_data_parallel_sums(mode: str, layouts, world_size: int, rank: int) -> list[str]:
    """CPU backend with every rank on this host and `mode` "auto": the data-parallel groups of `layouts` (their
    gradient sums) go through shared memory (`mindrlhf.parallel.host_collective`); returns those groups. Every rank
    must call it with the same layouts (it waits for the others)."""
    import mindspore as ms

    from mindrlhf.parallel import host_collective
    from mindrlhf.parallel.host import HostCollectives

    if mode != "auto" or world_size <= 1 or ms.get_context("device_target") != "CPU" or \
            not host_collective.available() or _ranks_on_host(world_size) != world_size:
        return []
    groups = []
    for layout in layouts:
        if layout is not None and layout.dp > 1:
            host_collective.enable(layout.dp_group, layout.dp_group_ranks(), rank)
            groups.append(layout.dp_group)
    if groups:
        host_collective.finish_setup(HostCollectives(world_size, rank).barrier)
    return sorted(set(groups))


def run_job(args: argparse.Namespace, callbacks: list[Callable] | None = None) -> int:
    """Runs the job; returns the process exit code. Bad input prints `error: <where>: <problem>` and gives 2."""
    import mindspore as ms

    from mindrlhf.trainer.rl_trainer import RLTrainer
    from mindrlhf.utils.logging import setup_logging

    job = JobOptions.from_args(args)
    try:
        config = load_config(job, args)
        if job.cpu_threads < 0:
            raise ConfigError(f"--cpu_threads must be >= 0 (0 = cores / ranks on this host), got {job.cpu_threads}")
        _check_files(job)
        tokenizer = load_job_tokenizer(job)
    except (ConfigError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    ms.set_context(mode=ms.GRAPH_MODE)
    world_size, rank = init_communication(job.use_parallel)
    setup_logging(rank=rank)
    threads = configure_cpu_threads(job.cpu_threads, world_size)
    if threads:
        logger.info("CPU kernel threads per rank: %d", threads)
    cores = pin_cpu_cores(job.cpu_affinity, world_size)
    if cores:
        logger.info("CPU cores of rank %d: %s", rank, ",".join(map(str, cores)))
    pool_gib = configure_cpu_memory_pool(world_size)
    if pool_gib:
        logger.info("CPU memory pool: one %d GiB block per rank (reserved, used as needed)", pool_gib)
    # the pid lets `mindrlhf.trainer.postmortem` map msrun's "Worker process <pid> exit" to this rank
    logger.info("rank %d of %d started as pid %d on %s", rank, world_size, os.getpid(), socket.gethostname())
    try:
        trainer = RLTrainer(config, job, tokenizer, world_size, rank, callbacks)
    except ValueError as err:  # ConfigError, DataError, LayoutError, StrategyError, CheckpointError
        print(f"error: {err}", file=sys.stderr)
        return 2
    if job.only_save_strategy:
        paths = trainer.save_strategies(os.path.join(job.output_dir, "strategy"))
        logger.info("strategy files written: %s", ", ".join(paths.values()))
        return 0
    from mindrlhf.trainer.roles import NonFiniteUpdates

    try:
        trainer.fit()
    except NonFiniteUpdates as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
