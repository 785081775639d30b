"""`GRPOLossCell`: the GRPO policy loss as a MindSpore Cell (GRAPH_MODE, float32), mirroring the numpy
reference `mindrlhf.algorithms.policy_loss.grpo_policy_loss` formula for formula.
"""
from __future__ import annotations

from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype

from mindrlhf.algorithms.policy_loss import check_loss_hyperparameters
from mindrlhf.utils.registry import Registry

# The MindSpore twins of the numpy KL estimators, under the same names (tests check both registries agree).
KL_CELL_ESTIMATORS: Registry = Registry("KL estimator")


@KL_CELL_ESTIMATORS.register("k1")
def _kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


@KL_CELL_ESTIMATORS.register("k2")
def _kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * ops.square(logp - ref_logp)


@KL_CELL_ESTIMATORS.register("k3")
def _kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    ref_log_ratio = ref_logp - logp
    return ops.exp(ref_log_ratio) - ref_log_ratio - 1.0


class GRPOLossCell(nn.Cell):
    """GRPO clipped surrogate + beta * KL(policy || ref), reduced with token weights.

    `construct(logp, old_logp, ref_logp, advantages, mask, token_weights)` takes [B, T] log-probs of the
    sampled tokens (policy, old policy, reference), advantages [B, T] (or [B], broadcast over the tokens), a
    0/1 response mask [B, T] and the token weights [B, T] of the aggregation
    (`mindrlhf.algorithms.aggregation_weights`, computed on the global mini-batch); every output is
    `sum(token_weights * per-token value)`: on a data-parallel rank its share
    of the global value. Returns the 0-d float32 tensors `(loss, pg_loss, kl_loss, pg_clipfrac, ratio_mean,
    ppo_kl)` (`OUTPUTS`, the numpy reference's stats); the stats are wrapped in `stop_gradient`, so
    `mindspore.value_and_grad(cell, grad_position=0)` differentiates only the loss, with or without `has_aux=True`.
    With `beta` 0 the KL term is neither computed nor returned (`self.OUTPUTS` lacks `kl_loss`) and `ref_logp` is
    not read: the job runs no reference model (`mindrlhf.trainer.plan.needs_reference`).

    Gradient: where the clip is active the token's policy term is taken as a constant (it is, locally);
    elsewhere, including a ratio exactly on a clip boundary, the unclipped `ratio * A` is used. This is done
    with `select` on a strict comparison rather than `ops.minimum`, whose gradient on ties is convention.
    Padding positions (mask 0) are zeroed before `exp`, so garbage there cannot produce inf or NaN.
    """

    OUTPUTS = ("loss", "pg_loss", "kl_loss", "pg_clipfrac", "ratio_mean", "ppo_kl")
    OUTPUTS_WITHOUT_KL = tuple(name for name in OUTPUTS if name != "kl_loss")

    def __init__(self, beta: float = 0.01, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                 kl_estimator: str = "k3"):
        super().__init__()
        self.beta, self.epsilon_low, self.epsilon_high = check_loss_hyperparameters(
            beta, epsilon_low, epsilon_high, "token-mean", kl_estimator)
        self.kl_estimator = kl_estimator
        self.kl = KL_CELL_ESTIMATORS.get(kl_estimator)
        self.clip_low = 1.0 - self.epsilon_low
        self.clip_high = 1.0 + self.epsilon_high
        self.with_kl = self.beta > 0
        self.OUTPUTS = self.OUTPUTS if self.with_kl else self.OUTPUTS_WITHOUT_KL

    def construct(self, logp: Tensor, old_logp: Tensor, ref_logp: Tensor, advantages: Tensor, mask: Tensor,
                  token_weights: Tensor):
        mask = ops.cast(mask, mstype.float32)
        valid = mask > 0.0
        zeros = ops.zeros_like(mask)
        weights = ops.select(valid, ops.cast(token_weights, mstype.float32), zeros)
        logp = ops.select(valid, ops.cast(logp, mstype.float32), zeros)
        old_logp = ops.select(valid, ops.cast(old_logp, mstype.float32), zeros)
        advantages = ops.cast(advantages, mstype.float32)
        if advantages.ndim == 1:
            advantages = ops.expand_dims(advantages, 1)
        else:
            advantages = ops.select(valid, advantages, zeros)

        ratio = ops.exp(logp - old_logp)
        unclipped = ratio * advantages
        clipped = ops.stop_gradient(ops.clamp(ratio, self.clip_low, self.clip_high) * advantages)
        clip_active = clipped < unclipped
        pg_token = -ops.select(clip_active, clipped, unclipped)
        pg_loss = ops.stop_gradient((weights * pg_token).sum())
        pg_clipfrac = ops.stop_gradient((weights * ops.cast(clip_active, mstype.float32)).sum())
        ratio_mean = ops.stop_gradient((weights * ratio).sum())
        ppo_kl = ops.stop_gradient((weights * (old_logp - logp)).sum())  # k1 of KL(old policy || policy)
        if not self.with_kl:
            return (weights * pg_token).sum(), pg_loss, pg_clipfrac, ratio_mean, ppo_kl
        ref_logp = ops.select(valid, ops.cast(ref_logp, mstype.float32), zeros)
        kl_token = self.kl(logp, ref_logp)
        loss = (weights * (pg_token + self.beta * kl_token)).sum()
        kl_loss = ops.stop_gradient((weights * kl_token).sum())
        return loss, pg_loss, kl_loss, pg_clipfrac, ratio_mean, ppo_kl
