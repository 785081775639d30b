"""Numpy GRPO math: advantages, dynamic sampling, KL estimators, clipped policy loss and aggregations."""
import math

import numpy as np
import pytest

from mindrlhf.algorithms import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    aggregate,
    dynamic_sampling_mask,
    expand_group_mask,
    get_advantage_estimator,
    group_advantages,
    grpo_policy_loss,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
)

# ----------------------------------------------------------------------------------------------- advantages


def test_group_advantages_hand_computed():
    # mean 0.5, std(ddof=1) = sqrt(1/3) for both groups' spread [1, 0, 0, 1]
    adv = group_advantages([1, 0, 0, 1], group_size=4)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # 0.86588...
    np.testing.assert_allclose(adv, [expected, -expected, -expected, expected], rtol=1e-6)
    assert abs(expected - 0.86588) < 1e-4
    # [0, 0, 0, 1]: mean 0.25, std(ddof=1) = 0.5
    np.testing.assert_allclose(group_advantages([0, 0, 0, 1], 4, eps=0.0), [-0.5, -0.5, -0.5, 1.5], rtol=1e-6)
    assert group_advantages([0, 0, 0, 1], 4).dtype == np.float32


def test_group_advantages_groups_are_independent_and_sum_to_zero():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=24)
    adv = group_advantages(rewards, group_size=6).reshape(4, 6)
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-5)
    np.testing.assert_allclose(adv[1], group_advantages(rewards[6:12], 6), rtol=1e-6)
    # ddof=1 std of each normalised group is ~1 (up to eps)
    np.testing.assert_allclose(adv.std(axis=1, ddof=1), 1.0, rtol=1e-3)


def test_group_advantages_scale_and_shift_invariant():
    rewards = np.array([0.3, 1.2, -0.7, 2.0, 5.0, 5.5])
    base = group_advantages(rewards, 3, eps=0.0)
    np.testing.assert_allclose(group_advantages(rewards * 10.0 + 3.0, 3, eps=0.0), base, rtol=1e-5)


def test_group_advantages_equal_rewards_give_zero_even_without_eps():
    np.testing.assert_array_equal(group_advantages([1, 1, 1, 0, 0, 0], 3, eps=0.0), np.zeros(6))


def test_group_size_one_gives_zero_advantages():
    np.testing.assert_array_equal(group_advantages([1.0, 0.0, 3.0], 1), np.zeros(3))


def test_estimators_return_token_level_advantages_and_returns():
    from types import SimpleNamespace

    mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], np.int32)
    settings = SimpleNamespace(advantage_eps=1e-4)

    def run(name, rewards):
        return get_advantage_estimator(name)({"rewards": np.array(rewards, np.float32), "response_mask": mask}, 4,
                                             settings)

    advantages, returns = run("dr_grpo", [1, 0, 0, 0])
    np.testing.assert_allclose(advantages, np.array([[0.75, 0.75, 0], [-0.25, 0, 0], [-0.25] * 3, [-0.25, -0.25, 0]]))
    np.testing.assert_array_equal(returns, advantages)
    advantages, _ = run("grpo", [1, 0, 0, 1])
    np.testing.assert_allclose(advantages, group_advantages([1, 0, 0, 1], 4)[:, None] * mask, rtol=1e-6)
    # RLOO: 1 - (0 + 0 + 1) / 3 = 2/3 for a winner, 0 - 2/3 for a loser
    advantages, _ = run("rloo", [1, 0, 0, 1])
    np.testing.assert_allclose(advantages[:, 0], [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    assert advantages.dtype == np.float32 and (advantages[mask == 0] == 0).all()
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        get_advantage_estimator("ppo")


@pytest.mark.parametrize("rewards,group_size,message", [
    ([1.0, 0.0, 1.0], 2, "batch size 3 is not divisible by group_size 2"),
    ([1.0, 0.0], 0, "group_size must be an integer >= 1"),
    ([1.0, 0.0], 1.5, "group_size must be an integer >= 1"),
    ([1.0, 0.0, float("nan"), 1.0], 2, "got nan at index 2"),
    ([1.0, float("inf")], 2, "got inf at index 1"),
    ([[1.0, 0.0]], 2, r"rewards must be 1-D"),
])
def test_group_advantages_errors(rewards, group_size, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_size)


def test_dynamic_sampling_mask():
    rewards = [1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.25]
    group_mask = dynamic_sampling_mask(rewards, 4)
    np.testing.assert_array_equal(group_mask, [True, False, False, True])
    np.testing.assert_array_equal(expand_group_mask(group_mask, 2), [1, 1, 0, 0, 0, 0, 1, 1])
    assert expand_group_mask(group_mask, 4).shape == (16,)
    with pytest.raises(ValueError, match="not divisible"):
        dynamic_sampling_mask(rewards, 3)


# ---------------------------------------------------------------------------------------------- KL estimators


def test_kl_estimators_values():
    logp, ref = np.log(0.5), np.log(0.25)
    assert kl_k1(logp, ref) == pytest.approx(math.log(2))
    assert kl_k2(logp, ref) == pytest.approx(0.5 * math.log(2) ** 2)
    # k3 = r - log r - 1 with r = ref_prob / prob = 0.5
    assert kl_k3(logp, ref) == pytest.approx(0.5 - math.log(0.5) - 1)
    assert set(KL_ESTIMATORS.names()) == {"k1", "k2", "k3"}
    np.testing.assert_array_equal(kl_penalty([logp], [ref], "k3"), kl_k3([logp], [ref]))
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, ref, "k4")


def test_k3_non_negative_and_zero_at_equality():
    rng = np.random.default_rng(1)
    logp, ref = rng.normal(-2, 3, size=1000), rng.normal(-2, 3, size=1000)
    assert (kl_k3(logp, ref) >= 0).all()
    np.testing.assert_array_equal(kl_k3(logp, logp), 0.0)


def test_k3_is_an_unbiased_kl_estimate():
    # policy p = [0.7, 0.3], ref q = [0.4, 0.6]: E_p[k3] = KL(p || q)
    p, q = np.array([0.7, 0.3]), np.array([0.4, 0.6])
    expected = float((p * kl_k3(np.log(p), np.log(q))).sum())
    assert expected == pytest.approx(float((p * np.log(p / q)).sum()))


# ---------------------------------------------------------------------------------------------- policy loss

def one_token_loss(ratio, advantage, epsilon_low=0.2, epsilon_high=0.2):
    """Loss and pg_clipfrac of a single token with logp - old_logp = log(ratio), no KL."""
    logp = np.array([[math.log(ratio)]])
    loss, stats = grpo_policy_loss(logp, np.zeros((1, 1)), logp, [advantage], np.ones((1, 1)), beta=0.0,
                                   epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    return loss, stats["pg_clipfrac"]


@pytest.mark.parametrize("ratio,advantage,epsilon_high,expected_loss,clipped", [
    (1.5, 1.0, 0.2, -1.2, 1.0),    # A > 0, ratio above 1 + eps_high: capped
    (1.5, 1.0, 0.28, -1.28, 1.0),  # clip-higher widens the cap
    (1.5, 1.0, 0.6, -1.5, 0.0),    # inside the range: unclipped
    (1.5, -1.0, 0.2, 1.5, 0.0),    # A < 0: the pessimistic unclipped term wins above the range
    (0.5, -1.0, 0.2, 0.8, 1.0),    # A < 0, ratio below 1 - eps_low: capped
    (0.5, 1.0, 0.2, -0.5, 0.0),    # A > 0 below the range: unclipped
    (1.1, 2.0, 0.2, -2.2, 0.0),    # inside the range
    (1.5, 0.0, 0.2, 0.0, 0.0),     # zero advantage never counts as clipped
])
def test_asymmetric_clip(ratio, advantage, epsilon_high, expected_loss, clipped):
    loss, clipfrac = one_token_loss(ratio, advantage, epsilon_high=epsilon_high)
    assert loss == pytest.approx(expected_loss)
    assert clipfrac == clipped


def test_eps_low_and_high_are_independent():
    assert one_token_loss(0.5, -1.0, epsilon_low=0.4, epsilon_high=0.0)[0] == pytest.approx(0.6)
    assert one_token_loss(1.5, 1.0, epsilon_low=0.0, epsilon_high=0.4)[0] == pytest.approx(-1.4)


def random_batch(seed=0, batch=4, length=6):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.0, 0.5, (batch, length))
    old_logp = logp + rng.normal(0.0, 0.3, (batch, length))
    ref_logp = logp + rng.normal(0.0, 0.2, (batch, length))
    advantages = rng.normal(size=batch)
    lengths = [2, 6, 4, 1][:batch]
    mask = (np.arange(length)[None, :] < np.array(lengths)[:, None]).astype(np.float64)
    return logp, old_logp, ref_logp, advantages, mask


def test_loss_matches_explicit_formula_and_stats_identity():
    logp, old, ref, adv, mask = random_batch()
    beta = 0.04
    loss, stats = grpo_policy_loss(logp, old, ref, adv, mask, beta=beta, epsilon_high=0.28)
    assert set(stats) == {"kl_loss", "pg_clipfrac", "pg_loss", "ratio_mean", "ppo_kl"}
    ratio = np.exp(logp - old)
    pg = -np.minimum(ratio * adv[:, None], np.clip(ratio, 0.8, 1.28) * adv[:, None])
    kl = np.exp(ref - logp) - (ref - logp) - 1
    per_token = pg + beta * kl
    expected = np.mean([(per_token[i] * mask[i]).sum() / mask[i].sum() for i in range(4)])
    assert loss == pytest.approx(expected, rel=1e-12)
    assert loss == pytest.approx(stats["pg_loss"] + beta * stats["kl_loss"], rel=1e-12)
    assert 0.0 < stats["pg_clipfrac"] < 1.0  # this batch has clipped and unclipped tokens
    assert stats["kl_loss"] > 0


def test_ppo_kl_is_old_minus_new_log_prob_under_the_loss_aggregation():
    """ppo_kl: the k1 estimate of KL(old policy || policy) on the sampled tokens, old_logp - logp, aggregated like
    pg_clipfrac; 0 when the policy has not moved, positive when it lowered the sampled tokens' log-probs."""
    logp = np.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, 9.0]])
    old = np.array([[-0.8, -2.5, -2.0], [-0.5, -0.3, 0.0]])  # [1, 2] is padding
    mask = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = np.array([1.0, -1.0])
    # per token: [0.2, -0.5, 1.0] and [0.0, 0.2]
    expected = {"token-mean": 0.9 / 5, "seq-mean-token-mean": (0.7 / 3 + 0.2 / 2) / 2,
                "seq-mean-token-sum": (0.7 + 0.2) / 2}
    for aggregation, value in expected.items():
        _, stats = grpo_policy_loss(logp, old, logp, adv, mask, aggregation=aggregation)
        assert stats["ppo_kl"] == pytest.approx(value, rel=1e-12), aggregation
        assert stats["ppo_kl"] == pytest.approx(aggregate(kl_k1(old, logp), mask, aggregation), rel=1e-12)
    _, unmoved = grpo_policy_loss(old, old, logp, adv, mask)
    assert unmoved["ppo_kl"] == 0.0 and unmoved["ratio_mean"] == pytest.approx(1.0)
    _, lowered = grpo_policy_loss(old - 0.25, old, logp, adv, mask, aggregation="token-mean")
    assert lowered["ppo_kl"] == pytest.approx(0.25)


def test_aggregations_differ_on_ragged_masks_and_agree_on_uniform():
    logp, old, ref, adv, mask = random_batch()
    seq, seq_stats = grpo_policy_loss(logp, old, ref, adv, mask, aggregation="seq-mean-token-mean")
    tok, tok_stats = grpo_policy_loss(logp, old, ref, adv, mask, aggregation="token-mean")
    assert abs(seq - tok) > 1e-3
    # token-mean: every masked token weighs 1 / 13
    ratio = np.exp(logp - old)
    pg = -np.minimum(ratio * adv[:, None], np.clip(ratio, 0.8, 1.2) * adv[:, None])
    kl = np.exp(ref - logp) - (ref - logp) - 1
    assert tok == pytest.approx(((pg + 0.01 * kl) * mask).sum() / 13, rel=1e-12)
    uniform = np.ones_like(mask)
    seq_u, seq_u_stats = grpo_policy_loss(logp, old, ref, adv, uniform, aggregation="seq-mean-token-mean")
    tok_u, tok_u_stats = grpo_policy_loss(logp, old, ref, adv, uniform, aggregation="token-mean")
    assert seq_u == pytest.approx(tok_u, rel=1e-12)
    for name in seq_u_stats:
        assert seq_u_stats[name] == pytest.approx(tok_u_stats[name], rel=1e-12)
    token_sum, _ = grpo_policy_loss(logp, old, ref, adv, uniform, aggregation="seq-mean-token-sum")
    assert token_sum == pytest.approx(6 * seq_u, rel=1e-12)


def test_aggregate_registry():
    assert set(AGGREGATIONS.names()) == {"seq-mean-token-mean", "token-mean", "seq-mean-token-sum"}
    values = np.array([[1.0, 3.0, 100.0], [2.0, 2.0, 2.0]])
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    assert aggregate(values, mask, "seq-mean-token-mean") == pytest.approx((2.0 + 2.0) / 2)
    assert aggregate(values, mask, "token-mean") == pytest.approx(10.0 / 5)
    assert aggregate(values, mask, "seq-mean-token-sum") == pytest.approx((4.0 + 6.0) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate(values, mask, "sum")


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_ranks_weighing_their_rows_with_the_whole_counts_give_the_whole_weights(aggregation):
    from mindrlhf.algorithms.aggregation import aggregation_weights, mini_batch_counts

    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]])
    assert mini_batch_counts(mask) == (12.0, 5.0)  # the empty row (a static shape's padding) is not a sequence
    whole = aggregation_weights(mask, aggregation)
    counts = mini_batch_counts(mask)
    parts = [aggregation_weights(mask[rows], aggregation, counts) for rows in (slice(0, 2), slice(2, 6))]
    np.testing.assert_array_equal(np.concatenate(parts), whole)  # bit for bit: the ranks' sums add up
    assert whole.sum() == pytest.approx(1.0 if aggregation != "seq-mean-token-sum" else 12 / 5)
    # a rank's own counts would weigh its rows as if they were the whole update
    assert not np.array_equal(aggregation_weights(mask[0:2], aggregation), whole[0:2])


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_weights_of_the_global_batch_split_over_ranks_add_up(aggregation):
    from mindrlhf.algorithms import aggregation_weights
    rng = np.random.default_rng(7)
    values = np.where(np.arange(6)[:, None] < 3, 1.0, -1.0) + 0.1 * rng.standard_normal((6, 8))
    lengths = np.array([1, 2, 0, 8, 8, 7])  # rank 0 (rows 0-2) short responses and an empty row, rank 1 long
    mask = (np.arange(8)[None, :] < lengths[:, None]).astype(np.float64)
    weights = aggregation_weights(mask, aggregation)
    shares = [(values[rows] * weights[rows]).sum() for rows in (slice(0, 3), slice(3, 6))]
    assert sum(shares) == pytest.approx(aggregate(values, mask, aggregation))
    # what per-rank normalisation (the old behaviour) would give differs on this data
    if aggregation != "seq-mean-token-sum":
        per_rank = np.mean([aggregate(values[rows], mask[rows], aggregation) for rows in (slice(0, 3), slice(3, 6))])
        assert abs(per_rank - aggregate(values, mask, aggregation)) > 0.1
    assert np.all(weights[2] == 0) and np.all(weights[mask == 0] == 0)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_zero_mask_sequence_is_ignored(aggregation):
    logp, old, ref, adv, mask = random_batch()
    mask[2] = 0.0
    logp[2, :] = np.nan  # padding rows may hold garbage
    old[2, 0] = np.inf
    loss, stats = grpo_policy_loss(logp, old, ref, adv, mask, aggregation=aggregation)
    keep = [0, 1, 3]
    loss_without, stats_without = grpo_policy_loss(logp[keep], old[keep], ref[keep], adv[keep], mask[keep],
                                                   aggregation=aggregation)
    assert np.isfinite(loss)
    assert loss == pytest.approx(loss_without, rel=1e-12)
    assert stats == pytest.approx(stats_without, rel=1e-12)
    empty_loss, empty_stats = grpo_policy_loss(logp, old, ref, adv, np.zeros_like(mask), aggregation=aggregation)
    assert empty_loss == 0.0 and all(value == 0.0 for value in empty_stats.values())


def test_policy_loss_validation():
    logp, old, ref, adv, mask = random_batch()
    with pytest.raises(ValueError, match=r"old_logp must have the shape of logp \(4, 6\), got \(4, 5\)"):
        grpo_policy_loss(logp, old[:, :5], ref, adv, mask)
    with pytest.raises(ValueError, match=r"advantages must have shape \(4,\)"):
        grpo_policy_loss(logp, old, ref, adv[:, None], mask)
    with pytest.raises(ValueError, match="logp must be 2-D"):
        grpo_policy_loss(logp[0], old[0], ref[0], adv, mask[0])
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        grpo_policy_loss(logp, old, ref, adv, mask * 2)
    bad = logp.copy()
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match=r"logp must be finite where mask is 1, got nan at \[1, 3\]"):
        grpo_policy_loss(bad, old, ref, adv, mask)
    with pytest.raises(ValueError, match="epsilon_low must be a number in"):
        grpo_policy_loss(logp, old, ref, adv, mask, epsilon_low=-0.1)
    with pytest.raises(ValueError, match="beta must be a number >= 0"):
        grpo_policy_loss(logp, old, ref, adv, mask, beta=-1.0)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        grpo_policy_loss(logp, old, ref, adv, mask, aggregation="mean")
