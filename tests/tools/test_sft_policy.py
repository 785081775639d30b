"""The SFT tool (tools/sft_policy.py) and the policies it built: the tests' tiny one and run_grpo.sh's default."""
import hashlib
import json
import re

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
@pytest.mark.msrun
def test_sft_tool_trains_both_phases_with_the_sft_stage_and_rebuilds_bit_identically(tmp_path, capfd):
    """The tool's two mindrlhf-sft runs on the tiny model: the worked phase lowers the loss from random weights (and
    the held-out loss, which the tool reports), the direct phase starts where it ended (its first loss near the
    worked phase's last, far below its first); the same arguments twice write the same bytes."""
    tool = load_tool()
    digests = []
    for attempt in range(2):
        out, work = tmp_path / f"hf{attempt}", tmp_path / f"work{attempt}"
        tool.main(["--steps", "12", "--direct_steps", "3", "--batch_size", "4", "--seed", "1", "--work_dir", str(work),
                   "--output", str(out), "--eval_data", str(TUTORIAL_DATA / "gsm8k_heldout.jsonl")])
        digests.append(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
        assert {"config.json", "vocab.json", "merges.txt"} <= {p.name for p in out.iterdir()}
    worked, direct = (read_metrics(work / phase / "metrics.jsonl") for phase in ("worked", "direct"))
    assert len(worked) == 12 and len(direct) == 3
    assert np.isfinite(worked + direct).all()
    assert np.mean(worked[-3:]) < 0.5 * worked[0]
    assert direct[0] < 0.5 * worked[0] and direct[0] < 2 * worked[-1]
    assert digests[0] == digests[1]  # the same run twice (same kernels, same order), not a re-ordered equal one
    reported = capfd.readouterr().err
    before, after = (float(x) for x in re.search(r"sft_policy: worked: held-out loss: before=(\S+) after=(\S+)",
                                                 reported).groups())
    assert after < before - 1.0
    assert len(re.findall(r"sft_policy: held-out greedy accuracy: \d+\.\d%", reported)) == 2


def read_metrics(path):
    """The `sft/loss` of each step line of a stage's metrics.jsonl."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [m["sft/loss"] for m in lines if "sft/loss" in m]
