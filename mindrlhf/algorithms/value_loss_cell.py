"""`ValueLossCell`: PPO's clipped value loss as a MindSpore Cell (GRAPH_MODE, float32), formula for formula the
numpy reference `mindrlhf.algorithms.ppo.value_loss`."""
from __future__ import annotations

from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype


class ValueLossCell(nn.Cell):
    """0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old + clip(v - old, -c, c) (exactly v within the range),
    reduced with token weights.

    `construct(values, old_values, returns, mask, token_weights)` takes [B, T] float tensors and returns the 0-d
    float32 `(vf_loss, vf_clipfrac)` (`OUTPUTS`), each `sum(token_weights * per-token value)` (on a data-parallel
    rank its share of the global value); the clip fraction is in `stop_gradient`. Where the clipped error is strictly
    larger, the token's gradient is that of the clipped branch (zero outside the clip range), as the numpy
    reference's `max`; `select` on a strict comparison keeps ties on the unclipped branch. Padding is zeroed
    before any arithmetic, so garbage there cannot produce NaN.
    """

    OUTPUTS = ("vf_loss", "vf_clipfrac")

    def __init__(self, cliprange_value: float = 0.5):
        super().__init__()
        if cliprange_value < 0:
            raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
        self.cliprange_value = float(cliprange_value)

    def construct(self, values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, token_weights: Tensor):
        mask = ops.cast(mask, mstype.float32)
        valid = mask > 0.0
        zeros = ops.zeros_like(mask)
        values = ops.select(valid, ops.cast(values, mstype.float32), zeros)
        old_values = ops.select(valid, ops.cast(old_values, mstype.float32), zeros)
        returns = ops.select(valid, ops.cast(returns, mstype.float32), zeros)
        weights = ops.select(valid, ops.cast(token_weights, mstype.float32), zeros)
        moved = values - old_values
        # within the range the clipped value is the value itself, not old + (v - old), which rounds
        clipped = ops.select(ops.abs(moved) > self.cliprange_value,
                             old_values + ops.clamp(moved, -self.cliprange_value, self.cliprange_value), values)
        unclipped_error = ops.square(values - returns)
        clipped_error = ops.square(clipped - returns)
        clip_wins = clipped_error > unclipped_error
        per_token = 0.5 * ops.select(clip_wins, clipped_error, unclipped_error)
        loss = (weights * per_token).sum()
        clipfrac = ops.stop_gradient((weights * ops.cast(clip_wins, mstype.float32)).sum())
        return loss, clipfrac
