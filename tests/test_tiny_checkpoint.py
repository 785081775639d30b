"""The bundled tiny policy (run_grpo.sh's default) and the tool that builds it."""
import importlib.util
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

from mindrlhf.data import build_prompt, read_problems
from mindrlhf.generation import GenerationConfig, Generator
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from mindrlhf.reward import format_reward

ROOT = Path(__file__).parents[1]
TINY = ROOT / "model_configs" / "tiny"
SAMPLE = ROOT / "examples" / "qwen_grpo_tutorial" / "data" / "gsm8k_sample.jsonl"

pytestmark = pytest.mark.usefixtures("graph_mode")


def load_tool():
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", ROOT / "tools" / "make_tiny_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_r1_completion_format():
    tool = load_tool()
    text = tool.r1_completion("He buys 3 * 4 = <<3*4=12>>12 apples.\n#### 12")
    assert text == "<think>\nHe buys 3 * 4 = 12 apples.\n</think>\n<answer>12</answer>"
    assert format_reward([text], ["12"]) == [1.0]


def test_bundled_policy_loads_completely_and_follows_the_format():
    config = Qwen2Config.from_yaml(TINY / "model.yaml")
    model = Qwen2ForCausalLM(config)
    not_loaded, unused = ms.load_param_into_net(model, ms.load_checkpoint(str(TINY / "tiny_sft.ckpt")),
                                                strict_load=True)
    assert not_loaded == [] and unused == []
    tokenizer = Qwen2Tokenizer(TINY / "tokenizer" / "vocab.json", TINY / "tokenizer" / "merges.txt")
    problems = list(read_problems(SAMPLE))[:8]
    prompts = [tokenizer.encode(build_prompt(p.question, "r1_think")) for p in problems]
    generator = Generator(model, GenerationConfig(max_new_tokens=96, num_generations=1, do_sample=False,
                                                  eos_token_ids=tokenizer.stop_token_ids,
                                                  pad_token_id=tokenizer.pad_token_id, prompt_buckets=[160]))
    out = generator.generate(prompts)
    completions = tokenizer.batch_decode([ids[m.astype(bool)].tolist() for ids, m in
                                          zip(out.response_ids, out.response_mask)], skip_special_tokens=True)
    # a random model scores 0 here; the bundled one has learned the <think>/<answer> layout
    assert np.mean(format_reward(completions, [p.answer for p in problems])) >= 0.5


def test_sft_tool_lowers_the_loss():
    tool = load_tool()
    _, losses = tool.train(steps=30, batch_size=4, learning_rate=3e-3, seed=1, data_path=SAMPLE)
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.5 * losses[0]
