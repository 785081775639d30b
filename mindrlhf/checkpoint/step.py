"""The trainer's step folders: per-rank weights and optimizer moments, strategy files and a JSON meta, committed
atomically.

Layout of one checkpoint::

    <save_ckpt_dir>/step_000004/
        meta.json               step, world size, layouts, config, data position (written last)
        train_strategy.ckpt     strategy file of the train net (`ParallelStrategyMap`)
        infer_strategy.ckpt     strategy file of the inference layout (the reference net's shards)
        rank_<r>/train.ckpt     train-net shards + AdamW state (`adam_m.*`, `adam_v.*`, `adam_step`); with
                                `optimizer_shard` the moments are this dp rank's flat slice of each weight's
                                (`mindrlhf.optim.ShardedAdamW`), the weights stay whole
        rank_<r>/ref.ckpt       reference-net shards (inference layout)
        rank_<r>/state.json     each role's state on this rank (`Role.state_dict`: the training engines'
                                update counts, the sampling stream), by role name

Every rank writes into `.step_000004.partial/`; once every rank has written its files (an agreement: a rank that
cannot write ends every rank there) rank 0 writes `meta.json` and renames the folder, so a checkpoint cut off
mid-write is never a `step_*` folder with a meta and is never picked. The folder must be on a file system all nodes
share (as MindSpore's own distributed checkpoints assume).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from mindrlhf.utils.agreement import FailedRanks, agreed
from mindrlhf.utils.checkpoint_file import StoredTensor, stored_tensors, write_checkpoint

logger = logging.getLogger(__name__)

META = "meta.json"
TRAIN_CKPT = "train.ckpt"
REF_CKPT = "ref.ckpt"
RANK_STATE = "state.json"
TRAIN_STRATEGY = "train_strategy.ckpt"
INFER_STRATEGY = "infer_strategy.ckpt"
CRITIC_CKPT = "critic.ckpt"
CRITIC_STRATEGY = "critic_strategy.ckpt"
# prefixes of the nets' parameter names (each net shares the plain model names of a converted `.ckpt`)
INFER_PREFIX = "infer."
REF_PREFIX = "ref."
ROLLOUT_PREFIX = "rollout."  # the rollout's merged copy of the adapted weights (never saved: made from the others)
CRITIC_PREFIX = "critic."
REWARD_MODEL_PREFIX = "reward_model."
NET_PREFIXES = (INFER_PREFIX, REF_PREFIX, CRITIC_PREFIX, REWARD_MODEL_PREFIX)
# Nets a trainer step folder holds whole over its ranks: net -> (rank file, strategy file, parameter name prefix)
STEP_NETS = {"actor": (TRAIN_CKPT, TRAIN_STRATEGY, ""), "critic": (CRITIC_CKPT, CRITIC_STRATEGY, CRITIC_PREFIX)}
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Config sections/fields a resumed run may change: how long it runs, how it checkpoints and evaluates.
RESUMABLE_CHANGES = {("schedule", "steps"), ("checkpoint", "save_interval"), ("checkpoint", "keep_last"),
                     ("eval", "eval_interval"), ("eval", "eval_batch_size"), ("eval", "eval_max_new_tokens")}


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed or loaded; the message names the folder and what differs."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def rank_dir(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, f"rank_{rank}")


def save_parameters(params: Iterable, path: str) -> None:
    """Writes parameters as a MindSpore `.ckpt` under their names (`write_checkpoint`: streamed, atomic)."""
    write_checkpoint(((param.name, param) for param in params), path)


def _unreadable(path: str, err: Exception) -> CheckpointError:
    return CheckpointError(f"{path}: not a readable MindSpore checkpoint ({str(err).splitlines()[0]})")


@contextlib.contextmanager
def stored_parameters(path: str) -> Iterator[dict[str, StoredTensor]]:
    """name -> `StoredTensor` of a `.ckpt` (`stored_tensors`: read one tensor at a time, so that loading a file
    costs one tensor's copy, not the file's three: MindSpore's loader holds the file's bytes, their parsed records
    and the arrays at once); a file that is not one is a CheckpointError naming it."""
    with contextlib.ExitStack() as stack:
        try:
            stored = stack.enter_context(stored_tensors(path))
        except (OSError, ValueError) as err:
            raise _unreadable(path, err) from None
        yield stored


def read_arrays(path: str, keep: Callable[[str], bool] = lambda name: True) -> dict[str, np.ndarray]:
    """name -> numpy array of the entries of a `.ckpt` that `keep` accepts, in the file's order (the others are not
    read); errors name the file."""
    with stored_parameters(path) as stored:
        try:
            return {name: tensor.array() for name, tensor in stored.items() if keep(name)}
        except ValueError as err:
            raise _unreadable(path, err) from None


@dataclass
class CheckpointWriter:
    """Writes one checkpoint with every rank taking part; `failed_ranks` synchronises the ranks and tells each which
    failed (`mindrlhf.utils.agreement`), so that a rank that cannot write ends every rank at once."""

    save_dir: str
    rank: int
    world_size: int
    failed_ranks: FailedRanks

    def save(self, step: int, write_rank_files: Callable[[str], None], write_shared_files: Callable[[str], None],
             meta: dict, keep_last: int) -> str:
        """Runs the writers into a partial folder, then commits it as `step_<step>`; returns its path."""
        final = os.path.join(self.save_dir, step_dir_name(step))
        partial = os.path.join(self.save_dir, "." + step_dir_name(step) + ".partial")
        where = f"writing {final}"
        with agreed(self.failed_ranks, where), self._one_error(final, partial):
            if self.rank == 0:
                os.makedirs(self.save_dir, exist_ok=True)
                shutil.rmtree(partial, ignore_errors=True)
                os.makedirs(partial)
        with agreed(self.failed_ranks, where), self._one_error(final, partial):
            os.makedirs(rank_dir(partial, self.rank), exist_ok=True)
            write_rank_files(rank_dir(partial, self.rank))
            if self.rank == 0:
                write_shared_files(partial)
        with agreed(self.failed_ranks, where), self._one_error(final, partial):
            if self.rank == 0:
                with open(os.path.join(partial, META), "w", encoding="utf-8") as f:
                    json.dump(meta, f, indent=1, sort_keys=True)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(partial, final)
                self._prune(keep_last)
        return final

    @contextlib.contextmanager
    def _one_error(self, final: str, partial: str) -> Iterator[None]:
        """An OSError inside (e.g. a full disk) as one CheckpointError, with this rank's partial files removed."""
        try:
            yield
        except OSError as err:
            shutil.rmtree(rank_dir(partial, self.rank), ignore_errors=True)
            if self.rank == 0:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(partial, META))
            last = complete_checkpoints(self.save_dir)
            raise CheckpointError(f"{final}: cannot write this checkpoint ({err.strerror or err}); the last complete "
                                  f"one ({last[-1] if last else 'none'}) is untouched") from None

    def _prune(self, keep_last: int) -> None:
        for old in complete_checkpoints(self.save_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(save_dir: str) -> list[str]:
    """`step_*` folders of `save_dir` that hold a meta.json, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in os.listdir(save_dir):
        match = _STEP_DIR.match(name)
        path = os.path.join(save_dir, name)
        if match and os.path.isfile(os.path.join(path, META)):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def read_meta(step_dir: str) -> dict:
    path = os.path.join(step_dir, META)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read the checkpoint meta ({err})") from None


def plain_name(name: str) -> str:
    """`name` without a net's prefix (`NET_PREFIXES`): the name a converted whole `.ckpt` gives the parameter."""
    for prefix in NET_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def is_step_folder(path: str) -> bool:
    """Whether `path` is a trainer step folder (its meta or one of its nets' strategy files is there), as opposed to
    a folder of per-rank shards (`mindrlhf.checkpoint.shards`)."""
    marks = (META, *(strategy for _, strategy, _ in STEP_NETS.values()), INFER_STRATEGY)
    return any(os.path.isfile(os.path.join(path, mark)) for mark in marks)


def is_optimizer_state(name: str) -> bool:
    """True for the AdamW entries a trainer rank file holds besides the weights (`adam_m.*`, `adam_step`, and the
    critic's `critic_adam_m.*`, ...)."""
    return name.split(".", 1)[0].endswith(("adam_m", "adam_v", "adam_step", "learning_rate"))


def is_weight(name: str) -> bool:
    """True for a rank file's entries that are not optimizer state (`is_optimizer_state`)."""
    return not is_optimizer_state(name)


def find_resume_checkpoint(resume: str, save_dir: str | None, announce: bool = True) -> str | None:
    """The folder to resume from: `resume` = 'auto' (newest complete one in `save_dir`; None if there is none,
    which is logged unless `announce` is False: the run starts from step 0) or a path to a `step_*` folder."""
    if resume == "auto":
        if not save_dir:
            raise CheckpointError("--resume auto needs --save_ckpt_dir (where the checkpoints are)")
        found = complete_checkpoints(save_dir)
        if not found and announce:
            logger.warning("--resume: no complete checkpoint in %s; starting from step 0", save_dir)
        return found[-1] if found else None
    if not os.path.exists(resume):
        raise CheckpointError(f"{resume}: no such folder (--resume takes a step_* folder written by the trainer, or "
                              "auto)")
    if not os.path.isfile(os.path.join(resume, META)):
        raise CheckpointError(f"{resume}: not a complete checkpoint (no {META}); expected a step_* folder "
                              "written by the trainer")
    return resume


def check_resumable(step_dir: str, meta: dict, world_size: int, layouts: dict, config: dict,
                    rank_files: Iterable[str] = (TRAIN_CKPT, REF_CKPT, RANK_STATE)) -> None:
    """Raises a one-line CheckpointError naming what differs between the checkpoint and this job (including
    a missing `rank_files` entry of any rank)."""
    if meta.get("world_size") != world_size:
        raise CheckpointError(f"{step_dir}: written by a job of {meta.get('world_size')} ranks, this job has "
                              f"{world_size}; resume with the same world size (or convert it with "
                              "tools/transform_checkpoint.py)")
    for net, layout in layouts.items():
        if meta.get("layouts", {}).get(net) != layout:
            raise CheckpointError(f"{step_dir}: {net} layout {meta.get('layouts', {}).get(net)} differs from this "
                                  f"job's {layout}")
    saved = meta.get("config", {})
    differing = []
    for section, values in config.items():
        for name, value in values.items():
            if (section, name) in RESUMABLE_CHANGES:
                continue
            old = saved.get(section, {}).get(name, value)
            if old != value:
                differing.append(f"{section}.{name} {old!r} -> {value!r}")
    if differing:
        raise CheckpointError(f"{step_dir}: config differs from the checkpoint's: {'; '.join(differing)} (only "
                              "schedule.steps and the checkpoint settings may change on resume)")
    for rank in range(world_size):
        for name in rank_files:
            path = os.path.join(rank_dir(step_dir, rank), name)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: missing from the checkpoint")
