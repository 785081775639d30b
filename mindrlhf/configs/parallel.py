"""`parallel_config` section of a model YAML (MindFormers layout)."""
from __future__ import annotations

from dataclasses import dataclass

from mindrlhf.configs.base import ConfigError, help_field


@dataclass
class ParallelConfig:
    """How one network is split over the ranks of the job (MindFormers' `parallel_config`)."""

    data_parallel: int = help_field(1, "Data-parallel size: replicas that each see a slice of the batch.")
    model_parallel: int = help_field(
        1, "Tensor-parallel size (Megatron style): attention heads, MLP columns and the vocabulary are split.")
    pipeline_stage: int = help_field(
        1, "Pipeline stages of a trained net (the actor's train net, the critic; the others take 1): the decoder "
           "layers split into equal consecutive shares (it must divide num_layers), the embedding on the first "
           "stage, the final norm and head on the last.")
    micro_batch_num: int = help_field(
        1, "With pipeline_stage > 1: micro-batches each rank's rows of an update are split into, run through the "
           "stages on the 1F1B schedule (their gradients are accumulated; stage s keeps the inputs of at most "
           "pipeline_stage - s of them; the pipeline fills and drains once per update, so more micro-batches "
           "idle the stages less).")
    use_seq_parallel: bool = help_field(
        False, "Sequence parallel with model_parallel > 1 (Megatron's): the activations between the attention and "
               "MLP blocks (norms, residuals) are cut along the sequence over the tensor-parallel group, gathered "
               "before the column-parallel layers and reduce-scattered after the row-parallel ones. Same results; "
               "less activation memory (most with recompute, whose kept layer inputs are cut too). Applies to the "
               "forward/backward graphs, not to generation with the KV cache.")
    optimizer_shard: bool = help_field(
        False, "ZeRO-1 over data parallel (MindFormers' parallel optimizer; also read from "
               "parallel.enable_parallel_optimizer): each data-parallel rank keeps the AdamW moments of 1/"
               "data_parallel of every weight, updates that slice and the full weights are gathered after the update.")

    def validate(self) -> None:
        for name in ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel_config.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.model_parallel * self.pipeline_stage
