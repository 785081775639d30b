"""Phases of an RL step: entering one applies its swap plan, times it and names it in the metrics.

In the spirit of verl's `marked_timer` and MindSpeed-RL's sharding manager, but as one mechanism: a phase
is the only place where residency changes, so the plan (what is on device when) cannot drift from the code
that uses the nets.
"""
from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator

from mindrlhf.parallel.swap import SwapManager

# The phases of a step, in order (eval runs between steps). What is resident in each follows from the roles
# (`mindrlhf.trainer.roles`); a phase no role claims runs with every group offloaded.
PHASES = ("generate", "reward", "ref", "old", "gather", "values", "update_critic", "train", "reshard", "sync_ref",
          "eval")


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, GiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Phases:
    """`with phases("generate"):` applies the phase's swap plan, then times the block.

    Times accumulate per step (a phase may run several times, e.g. generation rounds of dynamic sampling);
    `step_metrics()` returns `timing/<phase>` (seconds), `memory/peak_gib_after_<phase>` (the process's peak resident
    memory so far when the phase last ended: the phase where it jumps is the one that raised it) and the swap
    bytes moved since `start_step()`.
    """

    def __init__(self, swap: SwapManager, resident: dict[str, tuple[str, ...]]):
        self.swap = swap
        self.resident = dict(resident)
        self.seconds: dict[str, float] = {}
        self.peak_gib: dict[str, float] = {}
        self.swap_bytes = 0

    def start_step(self) -> None:
        self.seconds = {}
        self.peak_gib = {}
        self.swap_bytes = 0

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if name not in self.resident:
            raise KeyError(f"unknown phase {name!r}; phases: {list(self.resident)}")
        resident = tuple(g for g in self.swap.groups if g in self.resident[name])
        offloaded = tuple(g for g in self.swap.groups if g not in resident)
        start = time.perf_counter()
        self.swap_bytes += self.swap.apply_plan(name, resident=resident, offloaded=offloaded)
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.peak_gib[name] = round(peak_rss_gib(), 3)

    def step_metrics(self) -> dict[str, float]:
        metrics = {f"timing/{name}": round(seconds, 4) for name, seconds in self.seconds.items()}
        metrics.update({f"memory/peak_gib_after_{name}": gib for name, gib in self.peak_gib.items()})
        metrics["swap/bytes_moved"] = int(self.swap_bytes)
        return metrics
