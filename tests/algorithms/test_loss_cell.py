"""GRPOLossCell (MindSpore, GRAPH_MODE, float32) against the numpy reference `grpo_policy_loss`:
values, stats, and gradients w.r.t. logp (central finite differences of the float64 numpy loss and the
analytic formula), on ragged masks with an empty row."""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindrlhf.algorithms import (  # noqa: E402
    KL_ESTIMATORS,
    GRPOLossCell,
    aggregation_weights,
    grpo_policy_loss,
    kl_penalty,
)

AGGREGATIONS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"]
BETA, EPS_LOW, EPS_HIGH = 0.04, 0.2, 0.28


pytestmark = pytest.mark.usefixtures("graph_mode")


def fixed_batch(seed=0):
    """[4, 6] float32-representable responses; lengths 3, 6, 0, 1; ratios on both sides of both clip
    bounds (0.8, 1.28) but at least 0.03 away from them, so finite differences never cross a kink."""
    rng = np.random.default_rng(seed)
    batch, length = 4, 6
    mask = (np.arange(length)[None, :] < np.array([3, 6, 0, 1])[:, None]).astype(np.float32)
    ratios = rng.choice([0.5, 0.7, 0.9, 1.0, 1.1, 1.2, 1.4, 2.0], size=(batch, length))
    ratios *= 1.0 + rng.uniform(-0.01, 0.01, size=ratios.shape)
    logp = rng.normal(-1.5, 0.5, size=(batch, length))
    old_logp = logp - np.log(ratios)
    ref_logp = logp + rng.normal(0.0, 0.3, size=(batch, length))
    advantages = np.array([1.3, -0.7, 0.5, -1.1])
    logp[2] = np.nan  # padding may hold anything, even NaN or inf: it must not leak into loss or grad
    old_logp[0, 5] = -np.inf
    arrays = [a.astype(np.float32) for a in (logp, old_logp, ref_logp, advantages, mask)]
    return arrays


def numpy_loss(logp, old_logp, ref_logp, advantages, mask, aggregation, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
               beta=BETA):
    return grpo_policy_loss(*(np.asarray(a, np.float64) for a in (logp, old_logp, ref_logp, advantages, mask)),
                            beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, aggregation=aggregation)


def finite_difference_grad(logp, old_logp, ref_logp, advantages, mask, aggregation, step=1e-6):
    logp = logp.astype(np.float64)
    grad = np.zeros_like(logp)
    for index in zip(*np.nonzero(mask)):  # the loss does not depend on logp where mask == 0
        plus, minus = logp.copy(), logp.copy()
        plus[index] += step
        minus[index] -= step
        grad[index] = (numpy_loss(plus, old_logp, ref_logp, advantages, mask, aggregation)[0]
                       - numpy_loss(minus, old_logp, ref_logp, advantages, mask, aggregation)[0]) / (2 * step)
    return grad


def analytic_grad(logp, old_logp, ref_logp, advantages, mask, aggregation, epsilon_low=EPS_LOW,
                  epsilon_high=EPS_HIGH, beta=BETA):
    """d loss / d logp = weight * (-A * ratio * [clip inactive] + beta * (1 - exp(ref - logp))) on masked tokens."""
    logp, old_logp, ref_logp, advantages, mask = (np.asarray(a, np.float64)
                                                  for a in (logp, old_logp, ref_logp, advantages, mask))
    valid = mask > 0
    logp, old_logp, ref_logp = (np.where(valid, a, 0.0) for a in (logp, old_logp, ref_logp))
    ratio = np.exp(logp - old_logp)
    adv = advantages[:, None]
    clip_active = np.clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv < ratio * adv
    per_token = -adv * ratio * ~clip_active + beta * (1.0 - np.exp(ref_logp - logp))
    lengths = mask.sum(axis=1, keepdims=True)
    sequences = max((lengths > 0).sum(), 1)
    weight = {"seq-mean-token-mean": 1.0 / (np.maximum(lengths, 1) * sequences),
              "token-mean": np.full_like(lengths, 1.0 / max(mask.sum(), 1)),
              "seq-mean-token-sum": np.full_like(lengths, 1.0 / sequences)}[aggregation]
    return per_token * weight * mask


def cell_value_and_grad(cell, arrays, aggregation, has_aux=True):
    """The cell on `arrays` with the token weights of `aggregation` over the whole batch."""
    weights = aggregation_weights(arrays[4], aggregation).astype(np.float32)
    grad_fn = ms.value_and_grad(cell, grad_position=0, has_aux=has_aux)
    outputs, grad = grad_fn(*(ms.Tensor(a) for a in [*arrays, weights]))
    return [float(o.asnumpy()) for o in outputs], grad.asnumpy()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_value_stats_and_grad_match_numpy(aggregation):
    arrays = fixed_batch()
    outputs, grad = cell_value_and_grad(GRPOLossCell(BETA, EPS_LOW, EPS_HIGH), arrays, aggregation)
    expected_loss, expected_stats = numpy_loss(*arrays, aggregation)
    values = dict(zip(GRPOLossCell.OUTPUTS, outputs))
    assert values["loss"] == pytest.approx(expected_loss, abs=1e-5)
    for name, expected in expected_stats.items():
        assert values[name] == pytest.approx(expected, abs=1e-5), name
    assert 0.0 < expected_stats["pg_clipfrac"]  # the batch exercises the clip
    assert abs(expected_stats["ppo_kl"]) > 1e-3  # and moved the policy
    fd = finite_difference_grad(*arrays, aggregation)
    np.testing.assert_allclose(grad, fd, atol=1e-5)
    np.testing.assert_allclose(grad, analytic_grad(*arrays, aggregation), atol=1e-5)
    assert np.all(grad[arrays[4] == 0] == 0.0)


def test_token_level_advantages_match_numpy_and_broadcast_per_response_ones():
    logp, old_logp, ref_logp, advantages, mask = fixed_batch(seed=2)
    rng = np.random.default_rng(3)
    token_advantages = (advantages[:, None] + rng.normal(0, 0.5, mask.shape)).astype(np.float32)
    token_advantages[0, 5] = np.inf  # padding
    arrays = [logp, old_logp, ref_logp, token_advantages, mask]
    outputs, grad = cell_value_and_grad(GRPOLossCell(BETA, EPS_LOW, EPS_HIGH), arrays, "token-mean")
    expected_loss, _ = numpy_loss(*arrays, "token-mean")
    assert outputs[0] == pytest.approx(expected_loss, abs=1e-5)
    np.testing.assert_allclose(grad, finite_difference_grad(*arrays, "token-mean"), atol=1e-5)
    assert abs(expected_loss - numpy_loss(logp, old_logp, ref_logp, advantages, mask, "token-mean")[0]) > 1e-3
    # a per-response advantage repeated over the tokens is the same loss as the [B] form
    repeated = [logp, old_logp, ref_logp, np.repeat(advantages[:, None], mask.shape[1], 1), mask]
    same, same_grad = cell_value_and_grad(GRPOLossCell(BETA, EPS_LOW, EPS_HIGH), repeated, "token-mean")
    broadcast, broadcast_grad = cell_value_and_grad(GRPOLossCell(BETA, EPS_LOW, EPS_HIGH),
                                                    [logp, old_logp, ref_logp, advantages, mask], "token-mean")
    np.testing.assert_allclose(same, broadcast, atol=1e-6)
    np.testing.assert_allclose(same_grad, broadcast_grad, atol=1e-6)


def test_at_beta_0_the_reference_is_not_read_and_no_kl_is_returned():
    """A job at beta 0 has no reference model: the cell must give the policy-gradient loss, stats and gradient of
    the numpy loss at beta 0 whatever stands in the reference's slot (NaN here), and no kl_loss."""
    logp, old_logp, ref_logp, advantages, mask = fixed_batch(seed=4)
    cell = GRPOLossCell(0.0, EPS_LOW, EPS_HIGH)
    assert cell.OUTPUTS == ("loss", "pg_loss", "pg_clipfrac", "ratio_mean", "ppo_kl")
    nan_ref = np.full_like(ref_logp, np.nan)
    outputs, grad = cell_value_and_grad(cell, [logp, old_logp, nan_ref, advantages, mask], "seq-mean-token-mean")
    expected_loss, expected_stats = numpy_loss(logp, old_logp, ref_logp, advantages, mask, "seq-mean-token-mean",
                                               beta=0.0)
    values = dict(zip(cell.OUTPUTS, outputs))
    assert values["loss"] == pytest.approx(expected_loss, abs=1e-5) and expected_loss != 0.0
    for name in cell.OUTPUTS[1:]:
        assert values[name] == pytest.approx(expected_stats[name], abs=1e-5), name
    np.testing.assert_allclose(grad, analytic_grad(logp, old_logp, ref_logp, advantages, mask, "seq-mean-token-mean",
                                                   beta=0.0), atol=1e-5)
    assert np.abs(grad).max() > 1e-3


def test_gradient_ignores_stats_without_has_aux():
    arrays = fixed_batch(seed=1)
    cell = GRPOLossCell(BETA, EPS_LOW, EPS_HIGH)
    _, grad = cell_value_and_grad(cell, arrays, "token-mean", has_aux=False)
    np.testing.assert_allclose(grad, analytic_grad(*arrays, "token-mean"), atol=1e-5)


def test_gradient_on_exact_clip_boundary():
    """With epsilon 0 and old_logp == logp every ratio is exactly 1 == both bounds: the clip is not active
    (the terms are equal) and the full unclipped gradient -A * ratio is used, by construction rather than by
    whatever tie convention `ops.minimum` and `ops.clamp` follow."""
    logp, _, ref_logp, advantages, mask = fixed_batch(seed=2)
    logp = np.where(mask > 0, logp, -1.0).astype(np.float32)
    arrays = [logp, logp.copy(), ref_logp, advantages, mask]
    cell = GRPOLossCell(BETA, 0.0, 0.0)
    outputs, grad = cell_value_and_grad(cell, arrays, "seq-mean-token-mean")
    values = dict(zip(GRPOLossCell.OUTPUTS, outputs))
    assert values["pg_clipfrac"] == 0.0 and values["ratio_mean"] == pytest.approx(1.0) and values["ppo_kl"] == 0.0
    expected = analytic_grad(*arrays, "seq-mean-token-mean", epsilon_low=0.0, epsilon_high=0.0)
    np.testing.assert_allclose(grad, expected, atol=1e-6)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_shares_of_row_blocks_add_up_to_the_whole_batch(aggregation):
    """Data parallel: weights of the global batch, each block of rows on its own 'rank'; the shares of loss,
    stats and gradient add up to the one-process values."""
    arrays = fixed_batch(seed=4)
    weights = aggregation_weights(arrays[4], aggregation).astype(np.float32)
    cell = GRPOLossCell(BETA, EPS_LOW, EPS_HIGH)
    grad_fn = ms.value_and_grad(cell, grad_position=0, has_aux=True)
    whole, whole_grad = grad_fn(*(ms.Tensor(a) for a in [*arrays, weights]))
    totals, grads = np.zeros(len(GRPOLossCell.OUTPUTS)), []
    for rows in (slice(0, 1), slice(1, 4)):  # blocks of 1 and 3 rows with very different token counts
        part = [a[rows] for a in arrays] + [weights[rows]]
        outputs, grad = grad_fn(*(ms.Tensor(a) for a in part))
        totals += [float(o.asnumpy()) for o in outputs]
        grads.append(grad.asnumpy())
    np.testing.assert_allclose(totals, [float(o.asnumpy()) for o in whole], atol=1e-6)
    np.testing.assert_allclose(np.concatenate(grads), whole_grad.asnumpy(), atol=1e-7)


def test_kl_estimators_are_the_same_names_and_values_in_numpy_and_mindspore():
    from mindrlhf.algorithms.loss_cell import KL_CELL_ESTIMATORS
    assert KL_CELL_ESTIMATORS.names() == KL_ESTIMATORS.names()
    rng = np.random.default_rng(5)
    logp, ref = rng.normal(-2, 1, (3, 4)).astype(np.float32), rng.normal(-2, 1, (3, 4)).astype(np.float32)
    for name in KL_ESTIMATORS.names():
        ours = KL_CELL_ESTIMATORS.get(name)(ms.Tensor(logp), ms.Tensor(ref)).asnumpy()
        np.testing.assert_allclose(ours, kl_penalty(logp, ref, name), rtol=1e-4, atol=1e-5, err_msg=name)


def test_invalid_settings_fail_at_construction():
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        GRPOLossCell(kl_estimator="k9")
    with pytest.raises(ValueError, match="epsilon_high must be a number >= 0"):
        GRPOLossCell(epsilon_high=-0.1)
