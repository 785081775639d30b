"""Loss nets on preference pairs: DPO (and IPO) on a policy, Bradley-Terry on a reward model.

A pair's two answers are consecutive rows (chosen at 2j, rejected at 2j + 1) sharing their prompt, which a call
reads once for both (`share_prompts`); a call holds whole pairs. Each net's outputs are this rank's shares of the
update's means over its pairs: the engine's `token_weights` come from the `seq-mean-token-mean` aggregation, so a
row's weights sum to 1 / (the update's rows), and a pair's share is twice its chosen row's.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from mindrlhf.algorithms.policy_cells import ResponseLogProbs

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def _pairs(values):
    """(chosen, rejected) rows of a per-row tensor [2 P]."""
    pairs = values.reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def _pair_weights(token_weights):
    """Each pair's share of the update's mean, [P]."""
    chosen, _ = _pairs(token_weights.astype(ms.float32).sum(axis=1))
    return 2.0 * chosen


class DPOLossNet(nn.Cell):
    """Direct preference optimisation on a causal LM, as TRL's `DPOTrainer` computes it: `sigmoid` (DPO, with
    `label_smoothing`, cDPO) or `ipo` (on each answer's mean token log-prob), against the reference's log-probs of
    each answer (`ref_logps`, per row: summed, or averaged for IPO; 0 without a reference). Outputs TRL's metrics."""

    INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "ref_logps", "token_weights")
    OUTPUTS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")

    def __init__(self, model: nn.Cell, beta: float, label_smoothing: float = 0.0, loss_type: str = "sigmoid"):
        super().__init__(auto_prefix=False)
        if loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"DPO loss_type {loss_type!r}, expected one of {DPO_LOSS_TYPES}")
        self.response_log_probs = ResponseLogProbs(model)
        self.beta, self.label_smoothing, self.ipo = float(beta), float(label_smoothing), loss_type == "ipo"

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask, ref_logps, token_weights,
                  hidden_in=None):
        logp = self.response_log_probs(prompt_ids, prompt_mask, response_ids, response_mask, hidden_in)
        mask = response_mask.astype(ms.float32)
        logps = (logp * mask).sum(axis=1)
        if self.ipo:
            logps = logps / ops.maximum(mask.sum(axis=1), 1.0)
        chosen, rejected = _pairs(logps)
        ref_chosen, ref_rejected = _pairs(ref_logps.astype(ms.float32))
        logits = (chosen - rejected) - (ref_chosen - ref_rejected)
        if self.ipo:
            losses = (logits - 1.0 / (2.0 * self.beta)) ** 2
        else:
            losses = -(1.0 - self.label_smoothing) * ops.logsigmoid(self.beta * logits) - \
                self.label_smoothing * ops.logsigmoid(-self.beta * logits)
        weights = _pair_weights(token_weights)
        chosen_rewards = ops.stop_gradient(self.beta * (chosen - ref_chosen))
        rejected_rewards = ops.stop_gradient(self.beta * (rejected - ref_rejected))
        stats = (chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).astype(ms.float32),
                 chosen_rewards - rejected_rewards, ops.stop_gradient(chosen), ops.stop_gradient(rejected))
        return ((losses * weights).sum(),) + tuple((stat * weights).sum() for stat in stats)


class PairwiseRewardLoss(nn.Cell):
    """Bradley-Terry loss of a reward model (a `Qwen2ForValue`) scoring each answer at its last token, as TRL's
    `RewardTrainer`: -log sigmoid(r_chosen - r_rejected - margin), plus `center_rewards_coefficient` times the mean
    of (r_chosen + r_rejected)^2. Outputs the loss, the pairs ranked right (`accuracy`), the mean score gap
    (`margin`) and the mean scores."""

    INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "token_weights")
    OUTPUTS = ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected")

    def __init__(self, model: nn.Cell, margin: float = 0.0, center_rewards_coefficient: float = 0.0):
        super().__init__(auto_prefix=False)
        self.model = model
        self.margin, self.center = float(margin), float(center_rewards_coefficient)

    def construct(self, prompt_ids, prompt_mask, response_ids, response_mask, token_weights):
        values = self.model.response_values(prompt_ids, prompt_mask, response_ids, response_mask, False)
        mask = response_mask.astype(ms.float32)
        following = ops.concat((mask[:, 1:], ops.zeros_like(mask[:, :1])), 1)
        chosen, rejected = _pairs((values * (mask - following)).sum(axis=1))  # the score at the last token
        weights = _pair_weights(token_weights)
        gap = chosen - rejected
        losses = -ops.logsigmoid(gap - self.margin) + self.center * (chosen + rejected) ** 2
        stats = ((gap > 0).astype(ms.float32), gap, chosen, rejected)
        return ((losses * weights).sum(),) + tuple((ops.stop_gradient(stat) * weights).sum() for stat in stats)
