"""Settings of the stages before RL (`--stage sft | reward | dpo`): the RL job's optimizer, schedule, checkpoint and
eval sections apply to them too; what only they need is here."""
from __future__ import annotations

from dataclasses import dataclass

from mindrlhf.configs.base import ConfigError, Validated, help_field


@dataclass(frozen=True)
class SFTConfig(Validated):
    """Every stage before RL (SFT, reward model, DPO): passes over the data and its held-out split."""

    epochs: int = help_field(
        1, "Passes over the training split: the run makes epochs x (training records / schedule.batch_size) "
           "optimizer updates, one a step (a schedule.steps given in a YAML or a flag wins).")
    eval_fraction: float = help_field(
        0.05, "Share of the records held out (a seeded draw, at least one record; the pairs of one prompt are held "
              "out together) when no --eval_dataset_file is given: scored (SFT: eval/loss; reward model and DPO: "
              "eval/accuracy of the pairs) before the first step, every eval.eval_interval steps and after the last "
              "one. 0 = no held-out split.")
    packing: bool = help_field(
        False, "SFT: whole conversations packed into rows of up to sft.max_length tokens (best fit decreasing, TRL's "
               "packing_strategy='bfd'), positions restarting and attention kept within each conversation; "
               "schedule.batch_size then counts packed rows.")
    max_length: int = help_field(
        0, "SFT with packing: the tokens of a packed row (0 = the longest conversation, rounded up to 8); a longer "
           "conversation is refused.")

    def validate(self) -> None:
        if self.max_length < 0:
            raise ConfigError(f"sft.max_length must be >= 0, got {self.max_length}")
        if self.epochs < 1:
            raise ConfigError(f"sft.epochs must be >= 1, got {self.epochs}")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"sft.eval_fraction must be in [0, 1), got {self.eval_fraction}")


@dataclass(frozen=True)
class DPOConfig(Validated):
    """Direct preference optimisation (`--stage dpo`), as TRL's `DPOConfig` names it."""

    beta: float = help_field(0.1, "Strength of the KL constraint to the reference: the implicit reward is beta x the "
                                  "log-ratio of policy and reference (TRL's default 0.1).")
    label_smoothing: float = help_field(
        0.0, "The share of pairs taken to be labelled the wrong way round (cDPO; sigmoid loss only), in [0, 0.5).")
    loss_type: str = help_field("sigmoid", "sigmoid (DPO) or ipo (IPO, on each answer's mean token log-prob).")
    reference_free: bool = help_field(
        False, "No reference model: the reference log-probs are 0 (the policy's own log-ratio is the reward).")

    def validate(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ConfigError(f"dpo.loss_type must be 'sigmoid' or 'ipo', got {self.loss_type!r}")
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ConfigError("dpo.label_smoothing applies to the sigmoid loss only, not to ipo")


@dataclass(frozen=True)
class RewardModelConfig(Validated):
    """Reward-model training (`--stage reward`): the Bradley-Terry loss on each pair's scores, as TRL's
    `RewardTrainer`."""

    margin: float = help_field(0.0, "The gap the chosen answer's score should exceed the rejected one's by "
                                    "(-log sigmoid(r_chosen - r_rejected - margin)).")
    center_rewards_coefficient: float = help_field(
        0.0, "Weight of the mean of (r_chosen + r_rejected)^2 added to the loss, which keeps the scores centred on 0 "
             "(TRL's center_rewards_coefficient; 0.01 in its docs).")

    def validate(self) -> None:
        if self.center_rewards_coefficient < 0:
            raise ConfigError(f"reward_model.center_rewards_coefficient must be >= 0, got "
                              f"{self.center_rewards_coefficient}")
