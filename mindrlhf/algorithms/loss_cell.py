"""`GRPOLossCell`: the GRPO policy loss as a MindSpore Cell (GRAPH_MODE, float32), mirroring the numpy
reference `mindrlhf.algorithms.policy_loss.grpo_policy_loss` formula for formula.
"""
from __future__ import annotations

from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from mindrlhf.algorithms.policy_loss import check_loss_hyperparameters

OUTPUT_NAMES = ("loss", "pg_loss", "kl", "clipfrac", "ratio_mean")


class GRPOLossCell(nn.Cell):
    """GRPO clipped surrogate + beta * KL(policy || ref), reduced with a named aggregation.

    `construct(logp, old_logp, ref_logp, advantages, mask)` takes [B, T] log-probs of the sampled tokens
    (policy, old policy, reference), advantages [B] and a 0/1 response mask [B, T]; it computes in float32
    and returns the 0-d tensors `(loss, pg_loss, kl, clipfrac, ratio_mean)` (`OUTPUT_NAMES`), with the
    stats aggregated like the loss (see `grpo_policy_loss`). The stats are wrapped in `stop_gradient`, so
    `mindspore.value_and_grad(cell, grad_position=0)` differentiates only the loss, with or without
    `has_aux=True`.

    Gradient: where the clip is active the token's policy term is taken as a constant (it is, locally);
    elsewhere, including a ratio exactly on a clip boundary, the unclipped `ratio * A` is used. This is done
    with `select` on a strict comparison rather than `ops.minimum`, whose gradient on ties is convention.
    Padding positions (mask 0) are zeroed before `exp`, so garbage there cannot produce inf or NaN.
    """

    def __init__(self, beta: float = 0.01, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                 aggregation: str = "seq-mean-token-mean", kl_estimator: str = "k3"):
        super().__init__()
        self.beta, self.epsilon_low, self.epsilon_high = check_loss_hyperparameters(
            beta, epsilon_low, epsilon_high, aggregation, kl_estimator)
        self.aggregation = aggregation
        self.kl_estimator = kl_estimator
        self.clip_low = 1.0 - self.epsilon_low
        self.clip_high = 1.0 + self.epsilon_high

    def _reduce(self, values: Tensor, mask: Tensor) -> Tensor:
        masked = values * mask
        if self.aggregation == "token-mean":
            return masked.sum() / ops.maximum(mask.sum(), 1.0)
        tokens_per_sequence = mask.sum(axis=1)
        nonempty_sequences = ops.maximum(ops.cast(tokens_per_sequence > 0.0, mstype.float32).sum(), 1.0)
        if self.aggregation == "seq-mean-token-sum":
            return masked.sum() / nonempty_sequences
        return (masked.sum(axis=1) / ops.maximum(tokens_per_sequence, 1.0)).sum() / nonempty_sequences

    def _kl(self, logp: Tensor, ref_logp: Tensor) -> Tensor:
        if self.kl_estimator == "k1":
            return logp - ref_logp
        if self.kl_estimator == "k2":
            return 0.5 * ops.square(logp - ref_logp)
        ref_log_ratio = ref_logp - logp
        return ops.exp(ref_log_ratio) - ref_log_ratio - 1.0

    def construct(self, logp: Tensor, old_logp: Tensor, ref_logp: Tensor, advantages: Tensor, mask: Tensor):
        mask = ops.cast(mask, mstype.float32)
        valid = mask > 0.0
        zeros = ops.zeros_like(mask)
        logp = ops.select(valid, ops.cast(logp, mstype.float32), zeros)
        old_logp = ops.select(valid, ops.cast(old_logp, mstype.float32), zeros)
        ref_logp = ops.select(valid, ops.cast(ref_logp, mstype.float32), zeros)
        token_advantages = ops.expand_dims(ops.cast(advantages, mstype.float32), 1)

        ratio = ops.exp(logp - old_logp)
        unclipped = ratio * token_advantages
        clipped = ops.stop_gradient(ops.clamp(ratio, self.clip_low, self.clip_high) * token_advantages)
        clip_active = clipped < unclipped
        pg_token = -ops.select(clip_active, clipped, unclipped)
        kl_token = self._kl(logp, ref_logp)

        loss = self._reduce(pg_token + self.beta * kl_token, mask)
        pg_loss = ops.stop_gradient(self._reduce(pg_token, mask))
        kl = ops.stop_gradient(self._reduce(kl_token, mask))
        clipfrac = ops.stop_gradient(self._reduce(ops.cast(clip_active, mstype.float32), mask))
        ratio_mean = ops.stop_gradient(self._reduce(ratio, mask))
        return loss, pg_loss, kl, clipfrac, ratio_mean
