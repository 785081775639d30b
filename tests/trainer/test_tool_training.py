"""A multi-turn rollout's experience (#67): the tool turns' tokens are in the response (the passes read them) but out
of the loss (`loss_mask`): the policy's and the critic's token weights are 0 there and the policy's tokens share each
response's weight; each response's turns and calls are counted."""
from types import SimpleNamespace

import numpy as np
from support.experience import make_experience
from support.fake_engines import ACTOR_INPUTS, CRITIC_INPUTS, fake_engine

from mindrlhf.algorithms.policy_cells import GRPOLossNet, ValueLossNet
from mindrlhf.configs.tools import ToolsConfig
from mindrlhf.data.experience import trained_tokens
from mindrlhf.engine.batches import RankRows
from mindrlhf.generation import GenerationOutput
from mindrlhf.trainer.experience_maker import tool_columns
from mindrlhf.trainer.roles import actor_update_policy, critic_update_policy
from mindrlhf.trainer.specs import ActorSpec


def multi_turn_experience():
    """8 responses of up to 6 tokens; those of 4 tokens or more had a tool turn at tokens 1 and 2 (one call, an
    error for every other one)."""
    exp = make_experience(8, 3, 6, seed=3)
    tool_mask = np.zeros_like(exp.response_mask)
    called = exp.response_mask.sum(1) >= 4
    tool_mask[called, 1:3] = 1
    calls = [[{"name": "calculator", "status": "error" if i % 2 else "ok"}] if c else [] for i, c in enumerate(called)]
    out = GenerationOutput(exp.prompt_ids, exp.prompt_mask, exp.response_ids, exp.response_mask,
                           exp.response_mask.sum(1), tool_mask=tool_mask, tool_calls=calls)
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


def test_the_critic_fits_the_values_of_the_models_tokens_only():
    exp, tool_mask, _ = multi_turn_experience()
    exp = exp.with_columns(values=np.zeros(exp.response_mask.shape, np.float32),
                           returns=np.ones(exp.response_mask.shape, np.float32))
    seen = []
    config, engine = fake_engine("critic", [1.0] * 4, 2, CRITIC_INPUTS, ValueLossNet.OUTPUTS, seen)
    spec = SimpleNamespace(optimizer=config.optimizer, schedule=config.schedule, shape=engine.shape,
                           critic=config.critic, aggregation=config.loss.aggregation)
    engine.policy = critic_update_policy(spec, trained_tokens(exp))
    engine.update(RankRows.of_batch(exp, 1, 0, exp.num_rows, trained_tokens(exp)))
    assert len(seen) == 4
    for update, inputs in enumerate(seen):
        rows = slice(2 * update, 2 * update + 2)
        weights = inputs[-1]
        assert (weights[tool_mask[rows] == 1] == 0).all() and (weights[exp.loss_mask[rows] == 1] > 0).all()


def test_the_answer_rewards_and_the_evaluation_read_the_models_text_and_trl_functions_the_whole():
    """A response that called a tool (the tool turn answered 56) and then stopped without an answer: `accuracy`
    reads the model's own text (no answer: 0; the whole text's last number, the tool's 56, would score 1); a
    TRL-form function gets the whole text and the turns."""
    from support.paths import ROOT

    from mindrlhf.models.tokenizer import load_tokenizer
    from mindrlhf.reward.registry import WeightedRewards
    from mindrlhf.reward.rules import accuracy_reward
    from mindrlhf.trainer.roles import Reward

    tokenizer = load_tokenizer(str(ROOT / "model_configs" / "arith_tools" / "policy"))
    parts = [tokenizer.encode(text) for text in ("I will call it.", " 56", " done")]
    ids = np.array([sum(parts, [])], np.int32)
    mask = np.ones_like(ids)
    loss_mask = mask.copy()
    loss_mask[0, len(parts[0]):len(parts[0]) + len(parts[1])] = 0
    seen = {}

    def whole(prompts, completions, turns, **kwargs):
        seen.update(completions=completions, turns=turns)
        return [0.5] * len(completions)

    reward = Reward(SimpleNamespace(reward=SimpleNamespace(reward_funcs=[]), model=None), tokenizer)
    reward.rules = WeightedRewards(["accuracy", "whole"], [accuracy_reward, whole], [1.0, 1.0])
    rollout = {"prompt_ids": ids[:, :1], "prompt_mask": mask[:, :1], "response_ids": ids, "response_mask": mask,
               "loss_mask": loss_mask}
    scores = reward.score(rollout, ["#### 56"], columns={})
    assert accuracy_reward(tokenizer.completions(ids, mask), ["#### 56"]) == [1.0]  # the tool's number
    assert scores.terms["accuracy"].tolist() == [0.0] and scores.total.tolist() == [0.5]
    assert "56" in seen["completions"][0] and [t["role"] for t in seen["turns"][0]] == ["assistant", "tool",
                                                                                        "assistant"]
    # the held-out evaluation scores the model's text alike
    from mindrlhf.trainer.evaluation import score_greedy

    tool_mask = mask - loss_mask
    for tools, right in ((tool_mask, 0.0), (None, 1.0)):
        out = GenerationOutput(ids[:, :1], mask[:, :1], ids, mask, mask.sum(1), tool_mask=tools)
        generator = SimpleNamespace(generate=lambda prompts, progress=False, out=out: out)
        assert score_greedy(generator, tokenizer, [[1]], ["#### 56"], 1, {"accuracy": accuracy_reward}) == \
            {"accuracy": right}
