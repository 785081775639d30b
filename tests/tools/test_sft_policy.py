"""The SFT tool (tools/sft_policy.py) and the policies it built: the tests' tiny one and run_grpo.sh's default."""
import hashlib

import mindspore as ms
import numpy as np
import pytest
from support.paths import ARITH, TINY, TINY_SFT_CKPT, TOKENIZER, TUTORIAL_DATA
from support.policies import greedy_completions
from support.tools import tool_module

from mindrlhf.data.answers import r1_completion
from mindrlhf.data.mindrecord import read_problems
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from mindrlhf.models.qwen2.convert import convert_hf_to_ms
from mindrlhf.models.tokenizer import load_tokenizer
from mindrlhf.reward import accuracy_reward, format_reward

pytestmark = pytest.mark.usefixtures("graph_mode")


def load_tool():
    return tool_module("sft_policy")


def test_r1_completion_format():
    text = r1_completion("He buys 3 * 4 = <<3*4=12>>12 apples.\n#### 12")
    assert text == "<think>\nHe buys 3 * 4 = 12 apples.\n</think>\n<answer>12</answer>"
    direct = r1_completion("He buys 3 * 4 = <<3*4=12>>12 apples.\n#### 12", direct=True)
    assert direct == "<think>\n</think>\n<answer>12</answer>"
    assert format_reward([text, direct], ["12", "12"]) == [1.0, 1.0]


def test_direct_answers_start_at_their_step():
    tool = load_tool()
    data = tool.SFTData(load_tokenizer(TOKENIZER), TUTORIAL_DATA / "gsm8k_sample.jsonl", direct_fraction=0.5, seed=3)
    assert 0.2 < data.direct.mean() < 0.8
    marked, unmarked = int(np.flatnonzero(data.direct)[0]), int(np.flatnonzero(~data.direct)[0])
    assert data.response(marked, direct_phase=False) == data.responses[marked]
    assert data.response(marked, direct_phase=True) == data.direct_responses[marked]
    assert len(data.direct_responses[marked]) < len(data.responses[marked])
    assert data.response(unmarked, direct_phase=True) == data.responses[unmarked]


def test_padded_width_rounds_the_longest_row_up():
    tool = load_tool()
    assert tool.padded_width([[1] * 17, [1] * 3]) == 32
    assert tool.padded_width([[1] * 16]) == 16


def test_tiny_policy_loads_completely_and_follows_the_format():
    config = Qwen2Config.from_yaml(TINY / "model.yaml")
    model = Qwen2ForCausalLM(config)
    not_loaded, unused = ms.load_param_into_net(model, ms.load_checkpoint(str(TINY_SFT_CKPT)),
                                                strict_load=True)
    assert not_loaded == [] and unused == []
    tokenizer = load_tokenizer(TOKENIZER)
    problems = list(read_problems(TUTORIAL_DATA / "gsm8k_sample.jsonl"))[:8]
    completions = greedy_completions(model, tokenizer, problems, 96)
    # a random model scores 0 here; the bundled one has learned the <think>/<answer> layout
    assert np.mean(format_reward(completions, [p.answer for p in problems])) >= 0.5


@pytest.mark.slow
def test_arith_policy_converts_and_answers_part_of_the_heldout_problems(tmp_path):
    """run_grpo.sh's default policy goes through the converter like a user's model; it writes the R1 form, gets
    some held-out answers right, and answers many without the worked steps (the room GRPO has to improve)."""
    config = convert_hf_to_ms(ARITH / "policy", tmp_path / "policy.ckpt", config_path=ARITH / "train.yaml")
    model = Qwen2ForCausalLM(Qwen2Config.from_yaml(ARITH / "train.yaml"))
    ms.load_param_into_net(model, ms.load_checkpoint(str(tmp_path / "policy.ckpt")), strict_load=True)
    assert config.num_parameters() == sum(p.size for p in model.get_parameters())
    tokenizer = load_tokenizer(ARITH / "policy")
    problems = list(read_problems(TUTORIAL_DATA / "arithmetic_heldout.jsonl"))
    completions = greedy_completions(model, tokenizer, problems, 48)
    solutions = [p.answer for p in problems]
    correct = np.array(accuracy_reward(completions, solutions), bool)
    direct = np.array([c.startswith("<think>\n</think>") for c in completions])
    assert np.mean(format_reward(completions, solutions)) >= 0.9
    assert 0.05 <= correct.mean() <= 0.3 and direct.mean() >= 0.3
    assert correct[~direct].mean() > correct[direct].mean() + 0.15  # working it out pays


@pytest.mark.slow
def test_sft_tool_lowers_the_loss_and_rebuilds_bit_identically(tmp_path):
    tool = load_tool()
    config = Qwen2Config.from_yaml(TINY / "model.yaml")
    tokenizer = load_tokenizer(TOKENIZER)
    data = tool.SFTData(tokenizer, TUTORIAL_DATA / "gsm8k_sample.jsonl")
    digests = []
    for attempt in range(2):
        model, losses = tool.train(config, tokenizer, data, steps=30, batch_size=4, learning_rate=3e-3, seed=1)
        out = tmp_path / f"hf{attempt}"
        tool.save_policy(model, config, str(out), str(TOKENIZER))
        digests.append(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
        assert {"config.json", "vocab.json", "merges.txt"} <= {p.name for p in out.iterdir()}
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.5 * losses[0]
    assert digests[0] == digests[1]  # the same run twice (same kernels, same order), not a re-ordered equal one
