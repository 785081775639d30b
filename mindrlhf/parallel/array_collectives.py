"""Collectives on host numpy arrays between the phases of a step (experience, metrics, barriers).

Each call runs a tiny compiled graph (one per input shape): AllGather over the world group and AllReduce(SUM)
over sub-groups, the collectives every backend has. With one rank every call is the identity.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore.communication import GlobalComm

from mindrlhf.parallel.comm import GroupSum, WorldAllGather
from mindrlhf.parallel.layout import Layout


class ArrayCollectives:
    """World gather, group sums and a barrier for numpy arrays, on `world_size` ranks seen from `rank`."""

    def __init__(self, world_size: int = 1, rank: int = 0):
        self.world_size = world_size
        self.rank = rank
        self._gather = None
        self._sums: dict[str, object] = {}

    def all_gather(self, array: np.ndarray) -> np.ndarray:
        """[world * n, ...]: every rank's `array` ([n, ...], same shape everywhere) in rank order."""
        array = np.ascontiguousarray(array)
        if self.world_size == 1:
            return array
        if self._gather is None:
            self._gather = WorldAllGather()
        return self._gather(ms.Tensor(array)).asnumpy()

    def group_sum(self, array: np.ndarray, group: str | None) -> np.ndarray:
        """Sum of `array` over `group` (None = this rank alone)."""
        array = np.asarray(array, dtype=np.float32)
        if group is None or self.world_size == 1:
            return array
        if group not in self._sums:
            self._sums[group] = GroupSum(group)
        return self._sums[group](ms.Tensor(array)).asnumpy()

    def world_sum(self, array: np.ndarray) -> np.ndarray:
        return self.group_sum(array, GlobalComm.WORLD_COMM_GROUP if self.world_size > 1 else None)

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        self.world_sum(np.ones(1, np.float32))

    def failed_ranks(self, failed: bool) -> list[int]:
        """The ranks that called it with `failed` true, on every rank (`mindrlhf.utils.agreement`): a barrier that
        carries one flag per rank."""
        flags = np.zeros(self.world_size, np.float32)
        flags[self.rank] = float(failed)
        return np.flatnonzero(self.world_sum(flags)).tolist()

    def gather_data_parallel_rows(self, array: np.ndarray, layout: Layout) -> np.ndarray:
        """The global batch from per-dp-rank rows: every rank's rows gathered, one tp rank per dp rank kept
        (tp peers hold identical rows; with pipeline stages, those of the first stage), in dp order."""
        gathered = self.all_gather(array)
        if self.world_size == 1:
            return gathered
        rows = array.shape[0]
        return np.concatenate([gathered[r * rows:(r + 1) * rows] for r in layout.row_owners()], axis=0)
