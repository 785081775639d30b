"""Reward models / critics between Hugging Face and MindSpore: a random `*ForSequenceClassification` (one label)
converts into a `Qwen2ForValue` checkpoint that scores like it, and back into a folder `transformers` loads as
that class with the same scores; the trainer's `--load_critic_checkpoint` reads it."""
import mindspore as ms
import numpy as np
import pytest
import torch
from hf_fixtures import randomize_, tiny_hf_config
from transformers import (
    AutoModelForSequenceClassification,
    LlamaForSequenceClassification,
    Qwen2ForSequenceClassification,
)

from mindrlhf.models.qwen2 import Qwen2ForValue
from mindrlhf.models.qwen2.config import Qwen2Config
from mindrlhf.models.qwen2.convert import ConversionError, convert_hf_to_ms, convert_ms_to_hf, read_ms_checkpoint

pytestmark = pytest.mark.usefixtures("graph_mode")
CLASSES = {"qwen2": Qwen2ForSequenceClassification, "llama": LlamaForSequenceClassification}


def reward_model_dir(tmp_path, arch):
    config = tiny_hf_config(arch, num_labels=1)
    model = randomize_(CLASSES[arch](config), seed=3).eval()
    path = tmp_path / f"{arch}_rm"
    model.save_pretrained(path)
    return path, model


def batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 320, (3, 9)).astype(np.int64)
    mask = np.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # left padding (pad id 0)
    return ids, mask


def hf_scores(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits[:, 0].numpy()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_reward_model_converts_to_a_critic_that_scores_alike_and_back(tmp_path, arch):
    path, model = reward_model_dir(tmp_path, arch)
    ckpt = tmp_path / "critic.ckpt"
    yaml = tmp_path / "critic.yaml"
    cfg = convert_hf_to_ms(path, ckpt, output_yaml=yaml)
    weights = read_ms_checkpoint(ckpt)
    assert "score.weight" in weights and "lm_head.weight" not in weights and weights["score.weight"].shape == (1, 64)
    ids, mask = batch()
    expected = hf_scores(model, ids, mask)

    critic = Qwen2ForValue(Qwen2Config.from_yaml(yaml))
    ms.load_param_into_net(critic, {k: ms.Parameter(v, name=k) for k, v in weights.items()}, strict_load=True)
    values = critic(ms.Tensor(ids.astype(np.int32)), ms.Tensor(mask.astype(np.int32))).asnumpy()
    np.testing.assert_allclose(values[:, -1], expected, atol=1e-4)  # HF scores the last non-pad token

    back = tmp_path / "back"
    convert_ms_to_hf(ckpt, yaml, back)
    reloaded = AutoModelForSequenceClassification.from_pretrained(back, torch_dtype=torch.float32).eval()
    assert type(reloaded) is CLASSES[arch] and reloaded.config.num_labels == 1
    np.testing.assert_allclose(hf_scores(reloaded, ids, mask), expected, atol=1e-4)
    assert cfg.vocab_size == 320


def test_heads_that_are_not_one_label_value_heads_are_refused(tmp_path):
    two = randomize_(Qwen2ForSequenceClassification(tiny_hf_config("qwen2", num_labels=2)), seed=1)
    two.save_pretrained(tmp_path / "two")
    with pytest.raises(ConversionError, match=r"config.json: Qwen2ForSequenceClassification with 2 labels"):
        convert_hf_to_ms(tmp_path / "two", tmp_path / "two.ckpt")
    from transformers import Qwen2ForTokenClassification
    token = Qwen2ForTokenClassification(tiny_hf_config("qwen2", num_labels=1))
    token.save_pretrained(tmp_path / "token")
    with pytest.raises(ConversionError, match="Qwen2ForTokenClassification is not supported yet"):
        convert_hf_to_ms(tmp_path / "token", tmp_path / "token.ckpt")
    assert not (tmp_path / "two.ckpt").exists() and not (tmp_path / "token.ckpt").exists()


def test_a_trained_critic_exports_from_a_trainer_checkpoint_folder(tmp_path):
    """`convert_weight.py --reverse --net critic STEP_DIR`: the critic's tp=2 shards (next to the actor's) merge
    back into the reward model they came from, byte for byte, which `transformers` loads as its class."""
    from test_convert_weight import _safetensors_bytes, _write_trainer_checkpoint, run_cli

    from mindrlhf.trainer.checkpoint import read_policy_weights

    path, model = reward_model_dir(tmp_path, "qwen2")
    convert_hf_to_ms(path, tmp_path / "critic.ckpt", output_yaml=tmp_path / "critic.yaml")
    step_dir = tmp_path / "step_000002"
    critic = read_policy_weights(str(tmp_path / "critic.ckpt"))
    _write_trainer_checkpoint(critic, step_dir, net="critic")
    actor = {name: value + 1 for name, value in critic.items() if name != "score.weight"}
    actor["lm_head.weight"] = np.zeros((320, 64), np.float32)
    _write_trainer_checkpoint(actor, step_dir)  # the actor beside it must not leak into the export
    back = tmp_path / "back"
    res = run_cli("--reverse", "--net", "critic", "--mindspore_ckpt_path", step_dir, "--torch_ckpt_dir", back,
                  "--config_path", tmp_path / "critic.yaml")
    assert res.returncode == 0, res.stderr
    assert _safetensors_bytes(back) == _safetensors_bytes(path)
    reloaded = AutoModelForSequenceClassification.from_pretrained(back, torch_dtype=torch.float32).eval()
    ids, mask = batch()
    np.testing.assert_allclose(hf_scores(reloaded, ids, mask), hf_scores(model, ids, mask), atol=1e-6)
    res = run_cli("--reverse", "--net", "critic", "--mindspore_ckpt_path", tmp_path / "nowhere", "--torch_ckpt_dir",
                  tmp_path / "back2", "--config_path", tmp_path / "critic.yaml")
    assert res.returncode == 2 and "checkpoint not found" in res.stderr.strip().splitlines()[-1]
    (step_dir / "critic_strategy.ckpt").unlink()
    res = run_cli("--reverse", "--net", "critic", "--mindspore_ckpt_path", step_dir, "--torch_ckpt_dir",
                  tmp_path / "back2", "--config_path", tmp_path / "critic.yaml")
    assert res.returncode == 2 and "not a trainer checkpoint folder with a critic (no critic_strategy.ckpt)" in \
        res.stderr.strip().splitlines()[-1]
