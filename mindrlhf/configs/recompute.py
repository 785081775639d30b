"""`recompute_config` section of a model YAML: which decoder layers of a trained net recompute their activations in
the backward pass instead of keeping them (activation checkpointing).

Read from MindFormers' keys (`recompute`, `select_recompute`, ...) or MindSpeed-RL's (`recompute_granularity`,
`recompute_method`, `recompute_num_layers`); `RecomputeConfig.layers_of_stage` says what each pipeline stage does.
"""
from __future__ import annotations

from dataclasses import dataclass

from mindrlhf.configs.base import ConfigError, help_field

GRANULARITIES = ("full", "selective")


@dataclass
class RecomputeConfig:
    """Activation recompute of the decoder layers of trained nets (MindFormers `recompute_config`)."""

    recompute: bool | list[int] = help_field(
        False, "Full recompute: a layer keeps only its input for the backward pass and runs its forward again there. "
               "true = every layer; a list = per pipeline stage, how many of its first layers (MindFormers).")
    select_recompute: bool | list[int] = help_field(
        False, "Selective recompute: only the attention sub-block (projections, rotary, scores, softmax) is run "
               "again; the MLP keeps its activations. true = every layer; a list = per pipeline stage, how many of "
               "its first layers. A layer that recomputes fully ignores this.")
    mp_comm_recompute: bool = help_field(
        True, "The tensor-parallel collectives inside a recomputed layer run again with it. Only true is possible "
              "here (the collectives are part of the layer's graph).")
    parallel_optimizer_comm_recompute: bool = help_field(
        True, "No effect here: with optimizer_shard the weights are gathered once after each update, not before "
              "each forward, so there is no gather to recompute.")
    recompute_slice_activation: bool = help_field(
        False, "Slice the kept layer inputs over the tensor-parallel group. Not implemented: only false.")
    select_recompute_exclude: bool = help_field(False, "Per-operator exclusion lists: not implemented, only false.")
    select_comm_recompute: bool = help_field(False, "Per-operator communication recompute: not implemented, only "
                                                    "false.")
    select_comm_recompute_exclude: bool = help_field(False, "Not implemented: only false.")
    recompute_granularity: str = help_field(
        "", "MindSpeed-RL's form: 'full' (as recompute: true) or 'selective' (as select_recompute: true); '' = not "
            "used.")
    recompute_method: str = help_field(
        "block", "MindSpeed-RL's form: 'block' recomputes the first recompute_num_layers layers of each stage; "
                 "'uniform' (every layer in groups) is taken as all layers.")
    recompute_num_layers: int = help_field(
        0, "MindSpeed-RL's form: with recompute_granularity, how many layers of each stage recompute (0 = all).")

    def validate(self) -> None:
        for name in ("recompute_slice_activation", "select_recompute_exclude", "select_comm_recompute",
                     "select_comm_recompute_exclude"):
            if getattr(self, name):
                raise ConfigError(f"recompute_config.{name}=true is not implemented; set it to false (recompute "
                                  "and select_recompute are)")
        if not self.mp_comm_recompute:
            raise ConfigError("recompute_config.mp_comm_recompute=false is not possible here: the tensor-parallel "
                              "collectives are part of a recomputed layer's graph; set it to true")
        if self.recompute_granularity not in ("",) + GRANULARITIES:
            raise ConfigError(f"recompute_config.recompute_granularity={self.recompute_granularity!r}; expected "
                              f"{' or '.join(GRANULARITIES)} (or leave it empty)")
        if self.recompute_method not in ("block", "uniform"):
            raise ConfigError(f"recompute_config.recompute_method={self.recompute_method!r}; expected block or "
                              "uniform")
        if self.recompute_num_layers < 0:
            raise ConfigError(f"recompute_config.recompute_num_layers must be >= 0, got {self.recompute_num_layers}")
        for name in ("recompute", "select_recompute"):
            value = getattr(self, name)
            if isinstance(value, list) and any(n < 0 for n in value):
                raise ConfigError(f"recompute_config.{name}={value}: layer counts must be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.recompute or self.select_recompute or self.recompute_granularity)

    def layers_of_stage(self, stage: int, stages: int, stage_layers: int) -> tuple[int, int]:
        """(layers that recompute fully, layers that recompute the attention only) among the first layers of
        pipeline stage `stage` of `stages`, which owns `stage_layers` layers; full layers come first."""
        full = _count(self.recompute, stage, stages, stage_layers, "recompute")
        selective = _count(self.select_recompute, stage, stages, stage_layers, "select_recompute")
        if self.recompute_granularity:
            if self.recompute_method == "uniform" or not self.recompute_num_layers:
                count = stage_layers
            else:
                count = min(self.recompute_num_layers, stage_layers)
            if self.recompute_granularity == "full":
                full = max(full, count)
            else:
                selective = max(selective, count)
        return full, max(selective - full, 0)


def _count(value: bool | list[int], stage: int, stages: int, stage_layers: int, name: str) -> int:
    """Layers of a stage a MindFormers `recompute` / `select_recompute` value names: all (true), none (false), or
    the stage's entry of a per-stage list."""
    if isinstance(value, bool):
        return stage_layers if value else 0
    if len(value) != stages:
        raise ConfigError(f"recompute_config.{name}={value} has {len(value)} entries; expected one per pipeline "
                          f"stage ({stages})")
    return min(value[stage], stage_layers)
