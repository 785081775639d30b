"""Tolerances for weights compared after Adam(W) updates, between two runs that are mathematically equal (another
layout, micro-batches, resume, tp vs dp, msrun vs one process) but do not add floats in the same order.

Adam's update of a weight is lr * m_hat / (sqrt(v_hat) + eps): the gradient's size cancels, so each update moves
a weight by at most ~lr whatever its gradient is. A weight whose gradient is near zero (mathematically zero, or
smaller than the rounding error of the sums that make it) gets an update whose size and sign come from float
noise: two equal runs can move it differently by a sizeable fraction of lr per update. A bare `atol=1e-6` is
therefore not a statement about correctness; it fails or passes by the learning rate and by luck in the rounding.

So a weight difference is measured in units of what the updates could move it, lr * updates, and checked twice:
- every element: |diff| <= max_fraction * lr * updates (+ a few float32 ulps of the weight). This tolerates the
  rare noise-driven weight; a bug that moves even one small tensor consistently (~lr per update) exceeds it 10x.
- the bulk: the `quantile`-th percentile of |diff| over all elements of all tensors <= typical_fraction * lr *
  updates. Weights with a real gradient agree to a tiny fraction of an update, so this stays tight; a wrong
  accumulation, reduction or resume moves most weights by ~lr and fails it by orders of magnitude (weights that
  all move 1% more than they should already fail it 5x). Pass the whole model at once, so that the percentile is
  taken over many elements.
Losses, gradients and gradient norms do not go through Adam's normalisation: compare those tightly, not with this.
"""
from collections.abc import Mapping

import numpy as np

# A typical weight moves by ~0.4 of lr * updates. The tiny GRPO run micro-batched vs whole (4 updates at lr 1e-3,
# 164k weights): worst element 1.2e-2 of lr * updates on one machine and 1.3e-3 on another, 99.9th percentile 5e-5.
MAX_FRACTION = 0.1  # of lr * updates, any element
TYPICAL_FRACTION = 1e-3  # of lr * updates, the QUANTILE-th percentile of all elements
QUANTILE = 99.9
ULPS = 4  # rounding of the weight itself: the update is added to it in float32


def adam_weight_atol(lr: float, updates: int, fraction: float = MAX_FRACTION) -> float:
    """Absolute tolerance on a weight after `updates` Adam(W) updates at learning rate (peak) `lr`."""
    assert lr > 0 and updates >= 1, (lr, updates)
    return fraction * lr * updates


def assert_weights_close_after_adam(actual: Mapping, expected: Mapping, lr: float, updates: int, what: str = "",
                                    max_fraction: float = MAX_FRACTION, typical_fraction: float = TYPICAL_FRACTION,
                                    quantile: float = QUANTILE) -> None:
    """Asserts that the named weights `actual` equal `expected` (dicts name -> array, the whole model) after
    `updates` Adam(W) updates at peak learning rate `lr` since the two runs could first differ: every element within
    `max_fraction` of lr * updates (plus ULPS float32 ulps of the expected weight), and the `quantile`-th
    percentile of |diff| over all elements within `typical_fraction` of it."""
    label = f"{what}: " if what else ""
    assert actual.keys() == expected.keys(), f"{label}{sorted(set(actual) ^ set(expected))}"
    max_atol = adam_weight_atol(lr, updates, max_fraction)
    typical_atol = adam_weight_atol(lr, updates, typical_fraction)
    diffs, too_far = [], []
    for name, want in expected.items():
        want = np.asarray(want, np.float32)
        got = np.asarray(actual[name], np.float32)
        assert got.shape == want.shape, f"{label}{name}: shape {got.shape} != {want.shape}"
        assert np.isfinite(got).all() and np.isfinite(want).all(), f"{label}{name}: not finite"
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        allowed = max_atol + ULPS * np.spacing(np.abs(want)).astype(np.float64)
        over = diff > allowed
        if over.any():
            too_far.append(f"{name}: {int(over.sum())} of {diff.size} elements differ by up to {diff.max():.3g} "
                           f"(= {diff.max() / (lr * updates):.3g} of lr * updates)")
        diffs.append(diff.ravel())
    assert not too_far, (f"{label}weights differ by more than {max_fraction} of lr * updates = {max_atol:.3g} "
                         f"(lr {lr}, {updates} updates):\n" + "\n".join(too_far))
    pooled = np.concatenate(diffs)
    typical = float(np.percentile(pooled, quantile))
    assert typical <= typical_atol, (
        f"{label}the {quantile}th percentile of |weight diff| over {pooled.size} elements is {typical:.3g} "
        f"(= {typical / (lr * updates):.3g} of lr * updates), more than {typical_fraction} of lr * updates "
        f"(lr {lr}, {updates} updates): too many weights moved differently to be the few noise-driven ones")
