"""A multi-turn rollout's experience (#67): the tool turns' tokens are in the response (the passes read them) but out
of the loss (`loss_mask`): the policy's token weights are 0 there and its tokens share each response's weight; each
response's turns and calls are counted."""
from types import SimpleNamespace

import numpy as np
from support.experience import make_experience
from support.fake_engines import ACTOR_INPUTS, fake_engine

from mindrlhf.algorithms.policy_cells import GRPOLossNet
from mindrlhf.configs.tools import ToolsConfig
from mindrlhf.engine.batches import RankRows
from mindrlhf.trainer.experience_maker import tool_columns, trained_tokens
from mindrlhf.trainer.roles import actor_update_policy
from mindrlhf.trainer.specs import ActorSpec


def multi_turn_experience():
    """8 responses of up to 6 tokens; those of 4 tokens or more had a tool turn at tokens 1 and 2 (one call, an
    error for every other one)."""
    exp = make_experience(8, 3, 6, seed=3)
    tool_mask = np.zeros_like(exp.response_mask)
    called = exp.response_mask.sum(1) >= 4
    tool_mask[called, 1:3] = 1
    calls = [[{"name": "calculator", "status": "error" if i % 2 else "ok"}] if c else [] for i, c in enumerate(called)]
    out = SimpleNamespace(response_mask=exp.response_mask, tool_mask=tool_mask, tool_calls=calls)
    return exp.with_columns(**tool_columns(out)), tool_mask, called


def test_each_response_counts_its_turns_and_calls_and_trains_its_own_tokens():
    exp, tool_mask, called = multi_turn_experience()
    assert 0 < called.sum() < 8  # responses with and without a tool turn
    np.testing.assert_array_equal(exp.loss_mask, exp.response_mask * (1 - tool_mask))
    np.testing.assert_array_equal(exp.num_turns, 1 + called)
    np.testing.assert_array_equal(exp["tool/calls"], called)
    assert exp["tool/errors"].sum() == sum(1 for i in np.flatnonzero(called) if i % 2)
    assert trained_tokens(exp) == "loss_mask" and trained_tokens(make_experience(2, 2, 2)) == "response_mask"


def test_the_policy_update_weighs_the_models_tokens_only():
    """The actor's update policy of a job with tools reads `loss_mask`: token weights 0 on a tool's tokens, and with
    seq-mean-token-mean each response's weight shared by its own tokens (a tool turn does not dilute it)."""
    assert ActorSpec.token_mask.fget(SimpleNamespace(tools=ToolsConfig(tools=["calculator"]))) == "loss_mask"
    assert ActorSpec.token_mask.fget(SimpleNamespace(tools=ToolsConfig())) == "response_mask"
    exp, tool_mask, called = multi_turn_experience()
    seen = []
    config, engine = fake_engine("actor", [1.0] * 4, 2, ACTOR_INPUTS, GRPOLossNet.OUTPUTS, seen)
    spec = SimpleNamespace(optimizer=config.optimizer, schedule=config.schedule, shape=engine.shape,
                           loss=config.loss, token_mask=ActorSpec.token_mask.fget(SimpleNamespace(
                               tools=ToolsConfig(tools=["calculator"]))))
    engine.policy = actor_update_policy(spec)
    assert config.loss.aggregation == "seq-mean-token-mean"
    engine.update(RankRows.of_batch(exp, 1, 0, exp.num_rows, trained_tokens(exp)))
    assert len(seen) == 4  # one update a prompt (2 responses)
    for update, inputs in enumerate(seen):
        rows = slice(2 * update, 2 * update + 2)
        weights, mask = inputs[-1], exp.loss_mask[rows]
        assert (weights[tool_mask[rows] == 1] == 0).all() and (weights[mask == 1] > 0).all()
        np.testing.assert_allclose(weights.sum(1), 0.5, rtol=1e-6)  # each of the update's 2 responses: half
        for row_weights, row_mask in zip(weights, mask):
            np.testing.assert_allclose(row_weights[row_mask == 1], 0.5 / row_mask.sum(), rtol=1e-6)
