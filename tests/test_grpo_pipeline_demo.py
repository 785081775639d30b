"""The bundled end-to-end GRPO path (run_grpo.sh's script) on the tiny model, in one process."""
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parents[1]
TOKENIZER = ROOT / "model_configs" / "tiny" / "tokenizer"


def load_demo():
    spec = importlib.util.spec_from_file_location("grpo_pipeline_demo",
                                                  ROOT / "examples" / "qwen_grpo_tutorial" / "grpo_pipeline_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mindrecord(tmp_path_factory):
    from mindrlhf.data import convert_to_mindrecord
    from mindrlhf.models.qwen2 import Qwen2Tokenizer
    out = tmp_path_factory.mktemp("data") / "sample.mindrecord"
    tokenizer = Qwen2Tokenizer(TOKENIZER / "vocab.json", TOKENIZER / "merges.txt")
    convert_to_mindrecord(ROOT / "examples" / "qwen_grpo_tutorial" / "data" / "gsm8k_sample.jsonl", out, tokenizer,
                          template="raw", max_prompt_length=120)
    return out


def test_grpo_steps_update_the_policy_and_reshard_it_into_the_inference_net(tmp_path, monkeypatch, mindrecord):
    # A reward with spread even for a random model: the share of digits in the completion.
    (tmp_path / "digit_reward.py").write_text(
        "def digits(completions, solutions):\n"
        "    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    demo = load_demo()
    from mindrlhf.parallel.layers import random_full_state
    initial = random_full_state(demo.Qwen2ForCausalLM(demo.Qwen2Config.from_yaml(ROOT / "model_configs/tiny/model.yaml")),
                                seed=0)
    result = demo.main([
        "--config", str(ROOT / "model_configs/tiny/model.yaml"), "--vocab_path", str(TOKENIZER / "vocab.json"),
        "--merges_file_path", str(TOKENIZER / "merges.txt"), "--mindrecord", str(mindrecord), "--steps", "2",
        "--batch_size", "2", "--num_samples", "4", "--max_new_tokens", "16", "--learning_rate", "1e-2",
        "--reward_funcs", "digit_reward:digits", "--reward_weights", "1.0", "--ref_sync_steps", "0"])
    metrics = result.metrics
    assert metrics["step"] == "2/2"
    for name in ("reward", "loss", "pg_loss", "kl", "resp_len"):
        assert math.isfinite(metrics[name]), name
    assert 0 < metrics["resp_len"] <= 16
    changed = 0
    for param in result.policy.trainable_params():
        new = param.asnumpy()
        changed += not np.array_equal(new, initial[param.name])
        # the inference net got exactly the updated weights
        infer = dict((p.name, p) for p in result.infer_net.get_parameters())["infer." + param.name]
        np.testing.assert_array_equal(infer.asnumpy(), new)
        # the reference net (never re-synced) still holds the initial weights
        ref = dict((p.name, p) for p in result.ref_net.get_parameters())["ref." + param.name]
        np.testing.assert_array_equal(ref.asnumpy(), initial[param.name])
    assert changed == len(result.policy.trainable_params())
    assert result.swap.is_resident("train_weights") and not result.swap.is_resident("ref_weights")
