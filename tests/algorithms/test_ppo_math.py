"""PPO math (numpy): token rewards, GAE, whitening, clipped value loss, explained variance, KL controllers."""
from types import SimpleNamespace

import numpy as np
import pytest

from mindrlhf.algorithms import get_advantage_estimator
from mindrlhf.algorithms.ppo import (
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    explained_variance,
    gae_advantages_returns,
    masked_whiten,
    token_level_rewards,
    value_loss,
)


def reference_gae(rewards, values, gamma, lam):
    """A = sum_k (gamma * lam)^k delta_{t+k}, delta_t = r_t + gamma V_{t+1} - V_t (V_T = 0), one unpadded row."""
    length = len(rewards)
    next_values = np.append(values[1:], 0.0)
    deltas = rewards + gamma * next_values - values
    return np.array([sum((gamma * lam) ** k * deltas[t + k] for k in range(length - t)) for t in range(length)])


def test_gae_by_hand_on_three_tokens():
    # gamma 0.5, lam 0.5; r = [0, 0, 1], V = [0.5, 0.25, 0.5]
    # delta_2 = 1 + 0 - 0.5 = 0.5; delta_1 = 0 + 0.5*0.5 - 0.25 = 0; delta_0 = 0 + 0.5*0.25 - 0.5 = -0.375
    # A_2 = 0.5; A_1 = 0 + 0.25 * 0.5 = 0.125; A_0 = -0.375 + 0.25 * 0.125 = -0.34375; returns = A + V
    advantages, returns = gae_advantages_returns([[0, 0, 1]], [[0.5, 0.25, 0.5]], [[1, 1, 1]], 0.5, 0.5)
    np.testing.assert_allclose(advantages, [[-0.34375, 0.125, 0.5]])
    np.testing.assert_allclose(returns, [[0.15625, 0.375, 1.0]])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.9)])
def test_gae_equals_the_sum_of_discounted_deltas_and_skips_padding(gamma, lam):
    rng = np.random.default_rng(0)
    rewards, values = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
    mask = np.ones((3, 7), np.int32)
    mask[1, 5:] = 0  # padding at the end
    mask[2, [2, 3]] = 0  # padding in the middle: transparent
    rewards[mask == 0], values[mask == 0] = 99.0, -99.0  # garbage there must not matter
    advantages, returns = gae_advantages_returns(rewards, values, mask, gamma, lam)
    for row in range(3):
        keep = mask[row] > 0
        expected = reference_gae(rewards[row][keep], values[row][keep], gamma, lam)
        np.testing.assert_allclose(advantages[row][keep], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(returns[row][keep], expected + values[row][keep], rtol=1e-5, atol=1e-6)
        assert (advantages[row][~keep] == 0).all() and (returns[row][~keep] == 0).all()


def test_token_rewards_put_the_reward_on_the_last_token_and_subtract_the_kl():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 1]])
    kl = np.full((3, 4), 0.5)
    out = token_level_rewards([1.0, -1.0, 2.0], mask, kl, kl_coef=0.1)
    np.testing.assert_allclose(out, [[-0.05, -0.05, 0.95, 0], [-1.05, 0, 0, 0], [-0.05, -0.05, 0, 1.95]])
    np.testing.assert_array_equal(token_level_rewards([1.0, 0.0, 0.0], mask)[0], [0, 0, 1, 0])
    with pytest.raises(ValueError, match="response 1 has no valid token"):
        token_level_rewards([1.0, 1.0], [[1, 0], [0, 0]])


def test_whitening_uses_valid_entries_only():
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    values = np.array([[1.0, 2.0, 1000.0], [3.0, 4.0, 5.0]])
    out = masked_whiten(values, mask)
    valid = out[mask > 0]
    assert abs(valid.mean()) < 1e-6 and valid.std(ddof=1) == pytest.approx(1.0, abs=1e-6)
    assert out[0, 2] == 0
    np.testing.assert_allclose(masked_whiten(values, mask, shift_mean=False)[mask > 0], valid + 3.0, rtol=1e-6)
    with pytest.raises(ValueError, match="at least 2 valid entries"):
        masked_whiten([[1.0, 2.0]], [[1, 0]])


def test_gae_estimator_whitens_the_advantages_of_the_batch_and_keeps_raw_returns():
    rng = np.random.default_rng(1)
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    batch = {"token_rewards": rng.normal(size=(2, 4)), "values": rng.normal(size=(2, 4)), "response_mask": mask}
    advantages, returns = get_advantage_estimator("gae")(batch, 1, SimpleNamespace(gamma=1.0, lam=0.95))
    raw, expected_returns = gae_advantages_returns(batch["token_rewards"], batch["values"], mask, 1.0, 0.95)
    np.testing.assert_allclose(advantages, masked_whiten(raw, mask), rtol=1e-6)
    np.testing.assert_allclose(returns, expected_returns)


def test_gae_passes_over_a_tool_turn_as_if_its_tokens_were_not_there():
    """A multi-turn response (`loss_mask`: tool tokens at 2..4): its advantages and returns are those of the response
    without the tool's tokens (0 at them), whitened over the model's tokens only."""
    rng = np.random.default_rng(4)
    response = np.array([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0]])
    loss_mask = response.copy()
    loss_mask[0, 2:5] = 0
    rewards, values = rng.normal(size=(2, 8)), rng.normal(size=(2, 8))
    batch = {"token_rewards": rewards, "values": values, "response_mask": response, "loss_mask": loss_mask}
    advantages, returns = get_advantage_estimator("gae")(batch, 1, SimpleNamespace(gamma=0.9, lam=0.8))
    own = np.flatnonzero(loss_mask[0])
    np.testing.assert_allclose(returns[0, own] - values[0, own], reference_gae(rewards[0, own], values[0, own], 0.9,
                                                                                0.8), rtol=1e-5)
    assert (advantages[0, 2:5] == 0).all() and (returns[0, 2:5] == 0).all()
    raw, _ = gae_advantages_returns(rewards, values, loss_mask, 0.9, 0.8)
    np.testing.assert_allclose(advantages, masked_whiten(raw, loss_mask), rtol=1e-5)
    assert not np.allclose(advantages, masked_whiten(gae_advantages_returns(rewards, values, response, 0.9, 0.8)[0],
                                                     response), atol=1e-3)


def test_value_loss_by_hand():
    # clip 0.5; token 0: v moved 0.2 from old (inside): both errors (0.2-1)^2 = 0.64 -> 0.5 * 0.64 = 0.32
    # token 1: v = 2, old = 0 -> clipped 0.5, R = 0: errors 4 and 0.25 -> 0.5 * 4 = 2 (unclipped larger)
    # token 2: v = 0, old = 2 -> clipped 1.5, R = 2: errors 4 and 0.25 -> 2 again;
    # token 3: v = 1.2, old = 0 -> clipped 0.5, R = 2: errors 0.64 and 2.25 -> 0.5 * 2.25 = 1.125 (clipped larger)
    values, old, returns = [[0.2, 2.0, 0.0, 1.2, 9.0]], [[0.0, 0.0, 2.0, 0.0, 9.0]], [[1.0, 0.0, 2.0, 2.0, 9.0]]
    mask = [[1, 1, 1, 1, 0]]
    loss, clipfrac = value_loss(values, old, returns, mask, cliprange_value=0.5)
    assert loss == pytest.approx((0.32 + 2 + 2 + 1.125) / 4)
    assert clipfrac == pytest.approx(1 / 4)
    weights = np.array([[0.0, 0.0, 0.0, 1.0, 0.0]])
    assert value_loss(values, old, returns, mask, 0.5, weights) == pytest.approx((1.125, 1.0))


def test_explained_variance():
    mask = np.array([[1, 1, 1, 1]])
    returns = np.array([[1.0, 2.0, 3.0, 4.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(returns, np.full((1, 4), 2.5), mask) == pytest.approx(0.0)
    assert np.isnan(explained_variance(np.ones((1, 4)), returns, mask))


def test_kl_controllers():
    fixed = build_kl_controller("fixed", 0.01)
    fixed.update(10.0, 64)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.01
    adaptive = build_kl_controller("adaptive", 0.1, target_kl=1.0, horizon=100)
    assert isinstance(adaptive, AdaptiveKLController)
    adaptive.update(2.0, 10)  # error clipped to +0.2: 0.1 * (1 + 0.2 * 0.1) = 0.102
    assert adaptive.value == pytest.approx(0.102)
    adaptive.update(0.9, 50)  # error -0.1: 0.102 * (1 - 0.1 * 0.5) = 0.0969
    assert adaptive.value == pytest.approx(0.0969)
    restored = build_kl_controller("adaptive", 0.5, target_kl=1.0, horizon=100)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value
    with pytest.raises(ValueError, match="unknown KL controller 'pid'"):
        build_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="target_kl > 0 and horizon > 0"):
        build_kl_controller("adaptive", 0.1, target_kl=0.0)


@pytest.mark.parametrize("bad,message", [
    (dict(values=[[1.0, 2.0]]), "values must have the response mask's shape"),
    (dict(response_mask=[[1, 2, 1]]), "only 0 and 1"),
    (dict(gamma=1.5), "gamma must be in"),
])
def test_gae_errors(bad, message):
    args = dict(token_rewards=[[0.0, 0.0, 1.0]], values=[[0.0, 0.0, 0.0]], response_mask=[[1, 1, 1]], gamma=1.0,
                lam=1.0)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        gae_advantages_returns(**args)


def test_value_loss_cell_equals_numpy_in_value_and_gradient(graph_mode):
    import mindspore as ms

    from mindrlhf.algorithms import ValueLossCell, aggregation_weights

    rng = np.random.default_rng(2)
    mask = (np.arange(6)[None, :] < np.array([6, 3, 1, 4])[:, None]).astype(np.float32)
    old = rng.normal(size=(4, 6)).astype(np.float32)
    # moves of the value both inside and well outside the clip range (never within 0.05 of a kink)
    moves = rng.choice([-1.5, -0.3, 0.2, 0.35, 1.2], size=(4, 6)).astype(np.float32)
    values = old + moves
    returns = (old + rng.choice([-2.0, -0.8, 0.7, 1.9], size=(4, 6))).astype(np.float32)
    values[1, 5] = np.nan  # padding
    weights = aggregation_weights(mask, "token-mean").astype(np.float32)
    expected_loss, expected_clipfrac = value_loss(values, old, returns, mask, 0.5, weights)
    assert 0 < expected_clipfrac < 1  # both branches are exercised
    cell = ValueLossCell(0.5)
    grad_fn = ms.value_and_grad(cell, grad_position=0, has_aux=True)
    (loss, clipfrac), grad = grad_fn(*(ms.Tensor(a) for a in (values, old, returns, mask, weights)))
    assert float(loss.asnumpy()) == pytest.approx(expected_loss, abs=1e-5)
    assert float(clipfrac.asnumpy()) == pytest.approx(expected_clipfrac, abs=1e-6)
    # analytic: the unclipped branch gives w * (v - R); the clipped one w * (v_clip - R) * [|v - old| < c]
    valid_values = np.where(mask > 0, values, 0.0)
    clipped = old + np.clip(valid_values - old, -0.5, 0.5)
    clip_wins = (clipped - returns) ** 2 > (valid_values - returns) ** 2
    inside = np.abs(valid_values - old) < 0.5
    expected_grad = np.where(clip_wins, (clipped - returns) * inside, valid_values - returns) * weights * mask
    np.testing.assert_allclose(grad.asnumpy(), expected_grad, atol=1e-5)
    step = 1e-3  # central differences of the float64 numpy loss agree too
    index = (0, 2)
    plus, minus = values.astype(np.float64), values.astype(np.float64)
    plus[index] += step
    minus[index] -= step
    numeric = (value_loss(plus, old, returns, mask, 0.5, weights)[0] -
               value_loss(minus, old, returns, mask, 0.5, weights)[0]) / (2 * step)
    assert grad.asnumpy()[index] == pytest.approx(numeric, abs=1e-4)


def test_values_within_the_clip_range_are_never_counted_clipped(graph_mode):
    """Inside the clip range the clipped value is the value itself, so no token there counts as clipped: in floating
    point `old + (v - old)` is `v` only up to rounding, and comparing the two (then equal) errors flipped tokens
    at random, so two layouts of the same run reported different clip fractions."""
    import mindspore as ms

    from mindrlhf.algorithms import ValueLossCell

    rng = np.random.default_rng(3)
    old = rng.uniform(-0.05, 0.05, (8, 64)).astype(np.float32)
    values = rng.uniform(-0.4, 0.4, old.shape).astype(np.float32)  # moved, but within the clip range 0.5
    values[0, :4] = old[0, :4] + np.array([0.7, -0.7, 0.3, -0.3], np.float32)  # two clipped, two in range
    returns = rng.normal(0, 1, old.shape).astype(np.float32)
    returns[0, :4] = old[0, :4] + np.array([1.5, -1.5, 1.5, -1.5], np.float32)  # the clipped errors are larger
    mask, weights = np.ones(old.shape, np.float32), np.ones(old.shape, np.float32)
    _, clipfrac = value_loss(values, old, returns, mask, 0.5, weights)
    assert clipfrac == 2.0
    _, cell_clipfrac = ValueLossCell(0.5)(*(ms.Tensor(a) for a in (values, old, returns, mask, weights)))
    assert float(cell_clipfrac.asnumpy()) == 2.0
