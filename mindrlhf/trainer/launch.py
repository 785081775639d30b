"""Runs an RL job from parsed command-line flags: config, tokenizer, communication, trainer; one-line errors."""
from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import faulthandler
import gc
import hashlib
import json
import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from mindrlhf.checkpoint.step import find_resume_checkpoint
from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.cli import config_overrides
from mindrlhf.configs.grpo_configs import GRPOConfig
from mindrlhf.configs.job import JobOptions
from mindrlhf.models.tokenizer import load_tokenizer
from mindrlhf.parallel.host_setup import (
    configure_cpu_memory_pool,
    configure_cpu_threads,
    pin_cpu_cores,
    share_data_parallel_sums,
)
from mindrlhf.trainer.plan import JobPlan, check_write_targets, claim_output, yaml_world_size
from mindrlhf.utils.agreement import PeerFailure
from mindrlhf.utils.logging import setup_logging
from mindrlhf.utils.tracebacks import where_raised

# MindSpore, and the modules that load it, are imported by the functions that need them: `mindrlhf-train --help` and
# a bad flag import this module and answer without loading it (MINDSPORE_FREE in tests/test_architecture.py)
logger = logging.getLogger("mindrlhf.trainer")

_LAUNCHED_BY_MSRUN = ("MS_WORKER_NUM", "MS_ROLE")
# the line each rank logs last; `mindrlhf.utils.postmortem` reads it to tell a crash after the work from a failure
FINISHED = "rank %d finished with exit %d"
# after a failed rank has unregistered from MindSpore's scheduler, the seconds it waits before exiting: msrun kills
# every other worker as soon as one exits non-zero, and the scheduler then waits ~30 s for the heartbeats of those
# it killed before they unregistered; a rank that fails usually fails on every rank at once (a bad flag, a checkpoint
# of another model), and in this time the peers unregister too, so that the job ends in seconds
PEER_GRACE_S = 3.0
# MindSpore's CPU collectives give up on a peer that has not joined a call within ~30-45 s (`MS_CPU_COMM_OP_TIMEOUT`);
# ranks compile different graphs before their first exchanges (pipeline stages: the last one's loss and backward),
# which on a loaded CPU can take minutes, so a rank may wait that long for a healthy peer (a dead one ends the job
# through msrun and the scheduler's heartbeats instead)
CPU_COLLECTIVE_TIMEOUT_S = 1800
# MindSpore's ranks send the scheduler a heartbeat every 3-5 s (`MS_RETRY_INTERVAL_LOWER`/`_UPPER`): a rank learns
# that the cluster has formed from a heartbeat's answer, and its exit joins the heartbeat thread, so each launch
# waited up to a period at `init()` and another at exit (~8 s of a 60 s bundled run, measured). Jobs of up to
# QUICK_HEARTBEAT_MAX_RANKS ranks beat every 0-1 s (HEARTBEAT_S: MindSpore draws each period between the bounds);
# larger ones keep MindSpore's period (the scheduler answers every heartbeat).
HEARTBEAT_S = (0, 1)
QUICK_HEARTBEAT_MAX_RANKS = 64


def collective_environment(environ) -> dict[str, str]:
    """The variables `start_communication` sets before MindSpore's `init()`: `MS_CPU_COMM_OP_TIMEOUT`, and the
    heartbeat period's bounds (`HEARTBEAT_S`) of a job of at most `QUICK_HEARTBEAT_MAX_RANKS` ranks (msrun's
    `MS_WORKER_NUM`), each unless the user set it."""
    variables = {}
    if not environ.get("MS_CPU_COMM_OP_TIMEOUT"):
        variables["MS_CPU_COMM_OP_TIMEOUT"] = str(CPU_COLLECTIVE_TIMEOUT_S)
    heartbeat_set = environ.get("MS_RETRY_INTERVAL_LOWER") or environ.get("MS_RETRY_INTERVAL_UPPER")
    ranks = environ.get("MS_WORKER_NUM", "")
    if not heartbeat_set and ranks.isdigit() and int(ranks) <= QUICK_HEARTBEAT_MAX_RANKS:
        variables.update(MS_RETRY_INTERVAL_LOWER=str(HEARTBEAT_S[0]), MS_RETRY_INTERVAL_UPPER=str(HEARTBEAT_S[1]))
    return variables


def start_communication() -> tuple[int, int]:
    """MindSpore communication initialised for this msrun worker (`collective_environment` first): (world size,
    rank)."""
    from mindspore.communication import get_group_size, get_rank, init

    os.environ.update(collective_environment(os.environ))
    init()
    return get_group_size(), get_rank()


def load_config(job: JobOptions, args: argparse.Namespace) -> GRPOConfig:
    """`--config` YAML (or the defaults) with the command-line overrides of `args` applied (each YAML section's
    fields are checked as it is read; the whole config by `JobPlan.build`)."""
    config = GRPOConfig.from_yaml(*job.config) if job.config else GRPOConfig()
    overrides = config_overrides(args)
    return config.replace(overrides) if overrides else config


def load_job_tokenizer(job: JobOptions):
    if not job.tokenizer_dir and not (job.vocab_path and job.merges_file_path):
        raise ConfigError("tokenizer: give --tokenizer_dir, or --vocab_path and --merges_file_path")
    return load_tokenizer(tokenizer_dir=job.tokenizer_dir or None, vocab_path=job.vocab_path or None,
                          merges_file_path=job.merges_file_path or None)


def parallel_run(use_parallel: str) -> bool:
    """Whether this process is one rank of a job of several (launched by msrun, or `--use_parallel true`)."""
    launched = any(os.environ.get(name) for name in _LAUNCHED_BY_MSRUN)
    return use_parallel == "true" or (use_parallel == "auto" and launched)


def planned_world_size(job: JobOptions) -> int | None:
    """The ranks the job's plan is built for before MindSpore's communication forms the cluster: the train YAML's
    layout with `--check_flags` (no msrun; `MS_WORKER_NUM` when set, as run_grpo.sh sets it to the ranks it will
    start), 1 for a single process, msrun's worker count; None when only the cluster can tell (`--use_parallel
    true` without msrun's variables)."""
    workers = os.environ.get("MS_WORKER_NUM", "")
    if job.check_flags:
        return int(workers) if workers.isdigit() else yaml_world_size(job)
    if not parallel_run(job.use_parallel):
        return 1
    return int(workers) if workers.isdigit() else None


def init_communication(use_parallel: str) -> tuple[int, int]:
    """(world size, rank); initialises MindSpore communication when running under msrun (or asked to)."""
    return start_communication() if parallel_run(use_parallel) else (1, 0)


def run_job(args: argparse.Namespace, callbacks: list[Callable] | None = None) -> int:
    """Runs the job; returns the process exit code. Bad input prints `error: <where>: <problem>` and gives 2."""
    import mindspore as ms

    from mindrlhf.engine.train import NonFiniteUpdates

    job = JobOptions.from_args(args)
    plan = None
    try:
        config = load_config(job, args)
        tokenizer = load_job_tokenizer(job)
        if job.plan and job.stage == "rl":
            return print_memory_plan(config, job, tokenizer)
        # every check, once, before the cluster forms (a bad flag ends each rank in seconds); the rank comes after
        world_size = planned_world_size(job)
        if world_size is not None:
            plan = build_plan(config, job, tokenizer, world_size, 0, ms.get_context("device_target"))
        claim_output(job)  # one run per --output_dir: its lock, before anything is written
        check_write_targets(job)
        if job.check_flags:
            return 0
    except (ValueError, OSError) as err:  # ConfigError, LayoutError, DataError
        print(f"error: {err}", file=sys.stderr)
        return 2
    ms.set_context(mode=ms.GRAPH_MODE)
    world_size, rank = init_communication(job.use_parallel)
    set_up_host(job, world_size, rank)
    try:
        plan = plan_for_rank(plan, config, job, tokenizer, world_size, rank)
        host_sums = set_up_communication(job, config, plan.layouts(), plan.trained_layouts(), world_size, rank)
        trainer = make_trainer(plan, config, job, tokenizer, host_sums, callbacks)
    except (ValueError, PeerFailure) as err:  # ConfigError, DataError, LayoutError, StrategyError, CheckpointError
        print(f"error: {rank_prefix(rank, world_size)}{err}", file=sys.stderr)
        return 2
    if job.only_save_strategy:
        paths = trainer.save_strategies(os.path.join(job.output_dir, "strategy"))
        logger.info("strategy files written: %s", ", ".join(paths.values()))
        return 0
    freeze_long_lived_objects()
    try:
        trainer.fit()
    except Exception as err:  # every failure of a step ends the rank in one line (the traceback goes to a file)
        line = failure_line(err, rank, world_size, trainer.step, job.output_dir, isinstance(err, NonFiniteUpdates))
        print(f"error: {line}", file=sys.stderr)
        return 1
    return 0


def rank_prefix(rank: int, world_size: int) -> str:
    """"rank r: " before a rank's error line in a job of several ranks, nothing in a one-process job."""
    return f"rank {rank}: " if world_size > 1 else ""


def failure_line(err: Exception, rank: int, world_size: int, step: int, output_dir: str | None,
                 clear: bool = False) -> str:
    """The one line a rank prints for a failure in `fit`: which rank (of several) and step, and what failed. Our own
    errors (`clear`, ValueErrors such as CheckpointError and RewardError, `PeerFailure`) say it in their message; an
    unexpected exception is named with where it was raised (`where_raised`: its innermost frame outside the
    libraries). A traceback worth reading (an unexpected exception, or one a user's function raised) is written to
    `<output_dir>/traceback_rank_<r>.txt`, and the line names it."""
    where = rank_prefix(rank, world_size) + (f"step {step}: " if step else "before the first step: ")
    message = str(err).strip().splitlines()
    ours = clear or isinstance(err, (ValueError, PeerFailure))
    if ours:
        line = message[0] if message else type(err).__name__
    else:
        where_it_was = where_raised(err)
        line = f"{type(err).__name__}{': ' + message[0] if message else ''}" + \
            (f" at {where_it_was}" if where_it_was else "")
    if output_dir and (not ours or err.__cause__ is not None):
        path = os.path.join(output_dir, f"traceback_rank_{rank}.txt")
        with contextlib.suppress(OSError):
            os.makedirs(output_dir, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write("".join(traceback.format_exception(err)))
            line += f" (traceback: {path})"
    return where + line


def run_script(main: Callable[[], int]) -> NoReturn:
    """The end of a launched script (`if __name__ == "__main__": run_script(main)`): a crash prints every thread's
    stack (faulthandler), and the process ends through `end_process` with `main()`'s exit code."""
    faulthandler.enable()
    end_process(main())


def end_process(code: int) -> NoReturn:
    """Ends the process with `code`, the same way on every rank: after a successful job the ranks wait for each
    other (a barrier over the world), each logs `FINISHED`, the exit handlers run (MindSpore's cluster finalise,
    shared memory, logging) and the process leaves without the interpreter's teardown, in which MindSpore's threads
    and C++ objects were destroyed in no fixed order. MindSpore's exit handler (which the scheduler needs, to see the
    rank leave) still crashes now and then in its network threads' teardown; after `FINISHED` on every rank the
    launchers count the job as done (`postmortem.crashed_after_finishing`). A failed rank of a multi-rank job waits
    `PEER_GRACE_S` after the exit handlers, for its peers to unregister too."""
    from mindspore.communication import GlobalComm

    world_size, rank = 1, 0
    if GlobalComm.INITED:
        from mindspore.communication import get_group_size, get_rank

        world_size, rank = get_group_size(), get_rank()
    if code == 0 and world_size > 1:
        world_barrier()
    logger.info(FINISHED, rank, code)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    atexit._run_exitfuncs()
    if code != 0 and world_size > 1:
        time.sleep(PEER_GRACE_S)
    os._exit(code)


def world_barrier() -> None:
    """Returns once every rank of the job has called it (an AllReduce of one number over the world group)."""
    import mindspore as ms
    from mindspore import ops

    ops.AllReduce()(ms.Tensor(np.ones(1, np.float32))).asnumpy()


def build_plan(config: GRPOConfig, job: JobOptions, tokenizer, world_size: int, rank: int, device: str):
    """The checked plan of the job's stage (`--stage`): the RL job's `JobPlan`, or a stage's before RL (`StagePlan`:
    SFT, reward model, DPO)."""
    if job.stage != "rl":
        from mindrlhf.trainer.stage_trainer import StagePlan

        return StagePlan.build(config, job, tokenizer, world_size, rank)
    return JobPlan.build(config, job, tokenizer, world_size, rank, device)


def make_trainer(plan, config: GRPOConfig, job: JobOptions, tokenizer, host_sums: dict, callbacks):
    """The trainer of the planned stage, its nets built."""
    if job.stage != "rl":
        from mindrlhf.trainer.stage_trainer import StageTrainer

        return StageTrainer(plan, config, job, host_sums)
    from mindrlhf.trainer.rl_trainer import RLTrainer

    return RLTrainer(plan, tokenizer, host_sums, callbacks)


def plan_for_rank(plan, config: GRPOConfig, job: JobOptions, tokenizer, world_size: int, rank: int):
    """The checked plan at this rank: the one built before the cluster formed, for the world the cluster has (or,
    when the world size was not known before, built now)."""
    import mindspore as ms

    if plan is None:
        return build_plan(config, job, tokenizer, world_size, rank, ms.get_context("device_target"))
    if plan.world_size != world_size:
        raise ConfigError(f"msrun's MS_WORKER_NUM={plan.world_size}, but MindSpore's communication has {world_size} "
                          "ranks")
    return plan.for_rank(rank)


def print_memory_plan(config: GRPOConfig, job: JobOptions, tokenizer) -> int:
    """`--plan`: prints the memory plan (`memory_report.plan_report`) and returns 0, or 2 with a one-line error;
    builds no net, needs no msrun."""
    from mindrlhf.trainer.memory_report import plan_report

    try:
        print(plan_report(config, job, tokenizer))
    except ValueError as err:  # ConfigError, LayoutError
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def set_up_host(job: JobOptions, world_size: int, rank: int) -> None:
    """Logging, this rank's CPU threads and cores, and the CPU memory pool (each logged when set)."""
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
    # the pid lets `mindrlhf.utils.postmortem` map msrun's "Worker process <pid> exit" to this rank
    logger.info("rank %d of %d started as pid %d on %s", rank, world_size, os.getpid(), socket.gethostname())


def freeze_long_lived_objects() -> None:
    """Puts every Python object alive now (modules, nets, data) out of the cyclic garbage collector's reach
    (`gc.freeze`). MindSpore calls `gc.collect()` before every graph compile, which walked them all each time: ~0.1 s a
    compile in a trainer rank, ~0.3 s in a process with torch and transformers loaded. Garbage is collected first
    (a frozen object is never freed by the collector); objects created later are collected as before."""
    gc.collect()
    gc.freeze()


def set_up_communication(job: JobOptions, config: GRPOConfig, layouts, trained_layouts, world_size: int,
                         rank: int) -> dict:
    """The communication groups of the nets' `layouts`, the data-parallel gradient sums of the `trained_layouts`
    through shared memory (CPU, every rank on one host; returned by dp group name) and MindSpore's compile cache
    (`--enable_compile_cache`)."""
    import mindspore as ms

    host_sums = {}
    if world_size > 1:
        for layout in layouts:
            layout.init_groups()
        host_sums = share_data_parallel_sums(job.cpu_collectives, tuple(trained_layouts), world_size, rank)
        if host_sums:
            logger.info("data-parallel gradient sums through shared memory (CPU, one host): %s", ", ".join(host_sums))
    if job.enable_compile_cache and host_sums:
        # a cached graph names its Python callbacks by their address in the process that compiled it
        logger.info("compile cache off: the shared-memory gradient sums are Python callbacks inside graphs, which "
                    "a graph loaded from the cache cannot call (--cpu_collectives native keeps the cache)")
    elif job.enable_compile_cache:
        path = compile_cache_path(job, config, world_size, rank)
        logger.info("compile cache: %s", path)
        ms.set_context(enable_compile_cache=True, compile_cache_path=path)
    return host_sums


def compile_cache_path(job: JobOptions, config: GRPOConfig, world_size: int, rank: int) -> str:
    """`<output_dir>/compile_cache/<run key>/rank_<r>`. MindSpore matches cached graphs by the order in which a
    process compiles them, not by their inputs, and an RL job compiles its shape buckets in the order its
    sampled lengths need them; so a cache serves only a run that repeats the same job from the same start: the
    key hashes the flags, the config, the dataset file's size and time, the world size and the checkpoint
    resumed from (a resumed run gets a cache of its own)."""
    resume_dir = find_resume_checkpoint(job.resume, job.checkpoint_dir, announce=False) if job.resume else None
    data = job.mind_dataset_dir
    stat = os.stat(data) if data and os.path.isfile(data) else None
    data_stat = [stat.st_size, stat.st_mtime_ns] if stat else None
    key = {"job": dataclasses.asdict(job), "config": config.to_dict(), "data": data_stat,
           "world_size": world_size, "resume": os.path.abspath(resume_dir) if resume_dir else None}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return os.path.join(job.output_dir, "compile_cache", digest, f"rank_{rank}")
