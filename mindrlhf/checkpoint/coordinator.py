"""Saves and restores a job's state as one step folder (`mindrlhf.checkpoint.step`): every role's rank files,
strategy files and per-rank state, and the loop's state in the meta.

A role is anything with `name`, `rank_files()` (file name -> parameters), `shared_files()` (strategy file name ->
(layouts, stages)), `state_dict()` / `load_state_dict(state)` (JSON-able per-rank state) and `after_resume()`.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from mindrlhf.checkpoint.step import (
    RANK_STATE,
    CheckpointError,
    CheckpointWriter,
    check_resumable,
    rank_dir,
    read_meta,
    save_parameters,
)
from mindrlhf.checkpoint.weights import load_rank_params
from mindrlhf.parallel.strategy import strategy_file_name, write_strategy_file
from mindrlhf.utils.agreement import FailedRanks, agree

logger = logging.getLogger("mindrlhf.trainer")


class CheckpointCoordinator:
    """The checkpoints of one job: `roles` on `rank` of `world_size`, their `layouts` (net -> layout text, checked on
    resume) and `config` (a dict, checked on resume); the ranks agree on each write and read (`failed_ranks`)."""

    def __init__(self, roles: Sequence, save_dir: str, rank: int, world_size: int, failed_ranks: FailedRanks,
                 layouts: dict[str, str], config: dict):
        self.roles, self.rank, self.world_size = list(roles), rank, world_size
        self.failed_ranks, self.layouts, self.config = failed_ranks, layouts, config
        self.writer = CheckpointWriter(save_dir, rank, world_size, failed_ranks)

    def _rank_files(self) -> dict[str, list]:
        files = {}
        for role in self.roles:
            files.update(role.rank_files())
        return files

    def save(self, step: int, loop_state: dict, keep_last: int) -> str:
        """Writes step `step` (every rank must call it): the roles' files and states, and `loop_state` in the meta
        (with the step, world size, layouts and config); returns the folder."""
        def rank_files(folder: str) -> None:
            for name, params in self._rank_files().items():
                save_parameters(params, os.path.join(folder, name))
            with open(os.path.join(folder, RANK_STATE), "w", encoding="utf-8") as f:
                json.dump({role.name: role.state_dict() for role in self.roles}, f)

        def shared_files(folder: str) -> None:
            for role in self.roles:
                for name, (layouts, stages) in role.shared_files().items():
                    write_strategy_file(os.path.join(folder, name), layouts, stages=stages)

        meta = {"step": step, "world_size": self.world_size, "layouts": self.layouts, "config": self.config,
                **loop_state}
        path = self.writer.save(step, rank_files, shared_files, meta, keep_last)
        logger.info("checkpoint written: %s", path)
        return path

    def restore(self, step_dir: str) -> dict:
        """Loads every role's state of `step_dir` on this rank, once every rank could read its files (a damaged file
        on one rank ends every rank here); returns the meta, which holds the loop's state."""
        meta = read_meta(step_dir)
        rank_files = self._rank_files()
        check_resumable(step_dir, meta, self.world_size, self.layouts, self.config, [*rank_files, RANK_STATE])
        folder = rank_dir(step_dir, self.rank)
        failure = None
        try:
            for name, params in rank_files.items():
                load_rank_params(params, os.path.join(folder, name))
            self._load_role_states(os.path.join(folder, RANK_STATE))
        except (OSError, ValueError) as err:  # CheckpointError is a ValueError
            failure = err if isinstance(err, CheckpointError) else CheckpointError(f"{folder}: not readable ({err})")
        agree(self.failed_ranks, failure, f"reading {step_dir}")
        for role in self.roles:
            role.after_resume()
        return meta

    def _load_role_states(self, path: str) -> None:
        with open(path, encoding="utf-8") as f:
            states = json.load(f)
        try:
            for role in self.roles:
                role.load_state_dict(states.get(role.name, {}))
        except (KeyError, TypeError) as err:
            raise CheckpointError(f"{path}: not the state this job saves (no {err} for its roles "
                                  f"{[role.name for role in self.roles]})") from None


def write_strategies(roles: Sequence, folder: str, rank: int) -> dict[str, str]:
    """Writes the strategy file of each of the roles' nets for `rank` under `folder/<net>/`; returns the paths."""
    paths = {}
    for role in roles:
        for net, layouts in role.strategies().items():
            paths[net] = write_strategy_file(os.path.join(folder, net, strategy_file_name(rank)), layouts,
                                             stage=role.strategy_stage(net))
    return paths
