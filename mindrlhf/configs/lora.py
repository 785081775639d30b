"""`LoraConfig`: low-rank adapters on a net's linear layers (#68), in the names PEFT, TRL and verl users type."""
from __future__ import annotations

import math
from dataclasses import dataclass

from mindrlhf.configs.base import ConfigError, Validated, help_field

# Hugging Face module names of a Qwen2 / Llama decoder layer's linear layers (PEFT's target_modules)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (`<layer>.lora_a`, `<layer>.lora_b`)."""
    return name.endswith((".lora_a", ".lora_b"))


@dataclass(frozen=True)
class LoraConfig(Validated):
    """LoRA adapters: y = W x + (lora_alpha / lora_rank) B A x on each target module, A random and B zero at the start
    (PEFT's initialisation), the base weights frozen."""

    lora_rank: int = help_field(0, "Rank r of the adapters (verl's lora_rank, PEFT's r); 0 = no adapters, the whole "
                                   "net trains.")
    lora_alpha: float = help_field(16.0, "Scale numerator: the adapter's output is multiplied by lora_alpha / "
                                         "lora_rank (PEFT's lora_alpha).")
    lora_dropout: float = help_field(0.0, "Dropout on the adapters' input while training (PEFT's lora_dropout); "
                                          "0 keeps a step's log-probs those of the rollout's weights.")
    lora_target_modules: list[str] = help_field(
        [ALL_LINEAR], "The linear layers that get adapters, by their Hugging Face names: q_proj, k_proj, v_proj, "
                      "o_proj, gate_proj, up_proj, down_proj, or all-linear (all seven).")
    lora_merged_rollout: bool = help_field(
        True, "RL jobs: generate (and score the old policy) with a copy of the adapted layers' weights that has the "
              "adapters merged in, W + (lora_alpha / lora_rank) B A, made again after each update: the rollout runs "
              "at the speed of the model without adapters, for one more copy of those weights (the memory plan "
              "counts it). false: the rollout computes through the adapters, with no copy.")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.lora_rank

    def modules(self) -> tuple[str, ...]:
        """The target modules, all-linear expanded, in `TARGET_MODULES` order."""
        names = set(self.lora_target_modules)
        return TARGET_MODULES if ALL_LINEAR in names else tuple(m for m in TARGET_MODULES if m in names)

    def describe(self, trained_parameters: int) -> str:
        """The log's line of what trains: rank, alpha, targets and the count of trained parameters."""
        return (f"LoRA rank {self.lora_rank}, alpha {self.lora_alpha:g} on {', '.join(self.modules())}: "
                f"{trained_parameters / 1e6:.3f}M trained parameters on this rank, the base frozen")

    def validate(self) -> None:
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 0:
            raise ConfigError(f"lora.lora_rank must be an integer >= 0 (0 = no adapters), got {self.lora_rank!r}")
        if not (isinstance(self.lora_alpha, (int, float)) and math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ConfigError(f"lora.lora_alpha must be a number > 0, got {self.lora_alpha!r}")
        if not (isinstance(self.lora_dropout, (int, float)) and 0.0 <= self.lora_dropout < 1.0):
            raise ConfigError(f"lora.lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        targets = self.lora_target_modules
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, (list, tuple)) or not targets:
            raise ConfigError(f"lora.lora_target_modules must be a list of module names, got {targets!r}")
        unknown = [t for t in targets if t not in (*TARGET_MODULES, ALL_LINEAR)]
        if unknown:
            raise ConfigError(f"lora.lora_target_modules: unknown module {unknown[0]!r}; expected some of "
                              f"{', '.join(TARGET_MODULES)} or {ALL_LINEAR}")
        object.__setattr__(self, "lora_target_modules", list(targets))
        if not isinstance(self.lora_merged_rollout, bool):
            raise ConfigError(f"lora.lora_merged_rollout must be true or false, got {self.lora_merged_rollout!r}")

    def check_widths(self, widths: dict[str, tuple[int, int]]) -> None:
        """Refuses a rank above a target's smaller width (`widths`: module -> (in, out) features of the net)."""
        for module in self.modules():
            width = min(widths[module])
            if self.lora_rank > width:
                raise ConfigError(f"lora.lora_rank={self.lora_rank} is above the width {width} of {module} "
                                  f"({widths[module][0]} -> {widths[module][1]} features); give at most {width}")
