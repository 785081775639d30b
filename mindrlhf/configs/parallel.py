"""`parallel_config` section of a model YAML (MindFormers layout)."""
from __future__ import annotations

from dataclasses import dataclass

from mindrlhf.configs.base import ConfigError, help_field

# MindFormers parallel_config keys we accept for compatibility but do not use (yet).
IGNORED_PARALLEL_KEYS = frozenset({
    "use_seq_parallel", "micro_batch_num", "vocab_emb_dp", "gradient_aggregation_group",
    "expert_parallel", "context_parallel", "micro_batch_interleave_num", "recompute",
    "optimizer_shard",
})


@dataclass
class ParallelConfig:
    """How one network is split over the ranks of the job (MindFormers' `parallel_config`)."""

    data_parallel: int = help_field(1, "Data-parallel size: replicas that each see a slice of the batch.")
    model_parallel: int = help_field(
        1, "Tensor-parallel size (Megatron style): attention heads, MLP columns and the vocabulary are split.")
    pipeline_stage: int = help_field(1, "Pipeline stages. Only 1 is supported for now.")

    def validate(self) -> None:
        for name in ("data_parallel", "model_parallel", "pipeline_stage"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel_config.{name} must be >= 1, got {getattr(self, name)}")
        if self.pipeline_stage != 1:
            raise ConfigError(f"parallel_config.pipeline_stage={self.pipeline_stage}: pipeline parallelism "
                              "is not supported yet; use 1")

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.model_parallel * self.pipeline_stage
