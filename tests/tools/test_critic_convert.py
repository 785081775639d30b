"""Reward models / critics between Hugging Face and MindSpore: a random `*ForSequenceClassification` (one label)
converts into a `Qwen2ForValue` checkpoint that scores like it, and back into a folder `transformers` loads as
that class with the same scores; the trainer's `--load_critic_checkpoint` reads it."""
import dataclasses

import mindspore as ms
import numpy as np
import pytest
import torch
from support.checkpoints import write_trainer_checkpoint
from support.hf_fixtures import randomize_, safetensors_bytes, tiny_hf_config
from support.tools import run_convert_weight
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
    assert cfg.arch == Qwen2Config.from_yaml(yaml).arch == "Qwen2ForValue"
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
    assert not (tmp_path / "two.ckpt").exists()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_token_classification_critic_converts_with_its_head_bias_and_back(tmp_path, arch):
    """verl's critic format, `*ForTokenClassification` with one label (a head with a bias): every token's value
    equals HF's per-token logit, the YAML says `value_head_bias: true`, and the reverse is that class again."""
    from transformers import AutoModelForTokenClassification, LlamaForTokenClassification, Qwen2ForTokenClassification

    from mindrlhf.parallel.layout import Layout
    from mindrlhf.trainer.roles import CRITIC_PREFIX, load_value_model

    cls = {"qwen2": Qwen2ForTokenClassification, "llama": LlamaForTokenClassification}[arch]
    model = randomize_(cls(tiny_hf_config(arch, num_labels=1)), seed=4).eval()
    with torch.no_grad():
        model.score.bias.fill_(0.75)  # far from 0: a dropped bias shows in every value
    model.save_pretrained(tmp_path / "hf")
    ckpt, yaml = tmp_path / "critic.ckpt", tmp_path / "critic.yaml"
    cfg = convert_hf_to_ms(tmp_path / "hf", ckpt, output_yaml=yaml)
    assert cfg.value_head_bias and Qwen2Config.from_yaml(yaml).value_head_bias
    weights = read_ms_checkpoint(ckpt)
    np.testing.assert_array_equal(weights["score.bias"], [0.75])
    ids, mask = batch()
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits[..., 0].numpy()
    critic = Qwen2ForValue(Qwen2Config.from_yaml(yaml))
    critic.update_parameters_name(CRITIC_PREFIX)
    load_value_model(critic, Layout(), weights, str(ckpt), CRITIC_PREFIX, str(yaml))
    values = critic(ms.Tensor(ids.astype(np.int32)), ms.Tensor(mask.astype(np.int32))).asnumpy()
    np.testing.assert_allclose(values[mask > 0], expected[mask > 0], atol=1e-4)

    back = tmp_path / "back"
    convert_ms_to_hf(ckpt, yaml, back)
    reloaded = AutoModelForTokenClassification.from_pretrained(back, torch_dtype=torch.float32).eval()
    assert type(reloaded) is cls and reloaded.config.num_labels == 1
    with torch.no_grad():
        again = reloaded(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits[..., 0].numpy()
    np.testing.assert_allclose(again[mask > 0], expected[mask > 0], atol=1e-5)


def test_a_value_head_bias_the_yaml_does_not_declare_is_one_line(tmp_path):
    from mindrlhf.configs.base import ConfigError
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.trainer.roles import load_value_model

    path, _ = reward_model_dir(tmp_path, "qwen2")
    convert_hf_to_ms(path, tmp_path / "rm.ckpt", output_yaml=tmp_path / "rm.yaml")
    weights = read_ms_checkpoint(tmp_path / "rm.ckpt")
    net = Qwen2ForValue(Qwen2Config.from_yaml(tmp_path / "rm.yaml"))
    with pytest.raises(ConfigError, match=r"x.ckpt: the value head has bias 'score.bias' \(a \*ForTokenClassification\)"
                                          r", but rm.yaml sets model_config.value_head_bias: false"):
        load_value_model(net, Layout(), {**weights, "score.bias": np.zeros(1, np.float32)}, "x.ckpt", "", "rm.yaml")
    biased = Qwen2ForValue(dataclasses.replace(Qwen2Config.from_yaml(tmp_path / "rm.yaml"), value_head_bias=True))
    with pytest.raises(ConfigError, match=r"the value head has no bias 'score.bias' .*value_head_bias: true"):
        load_value_model(biased, Layout(), weights, "x.ckpt", "", "rm.yaml")
    with pytest.raises(ConversionError, match=r"score.bias.*\(a value head with a bias: set value_head_bias: true\)"):
        convert_ms_to_hf_from({**weights, "score.bias": np.zeros(1, np.float32)}, tmp_path)


def convert_ms_to_hf_from(weights, tmp_path):
    import mindspore as ms
    path = tmp_path / "biased.ckpt"
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in weights.items()], str(path))
    convert_ms_to_hf(path, tmp_path / "rm.yaml", tmp_path / "biased_hf")


@pytest.mark.slow
def test_a_trained_critic_exports_from_a_trainer_checkpoint_folder(tmp_path):
    """`convert_weight.py --reverse --net critic STEP_DIR`: the critic's tp=2 shards (next to the actor's) merge
    back into the reward model they came from, byte for byte, which `transformers` loads as its class."""
    from mindrlhf.checkpoint.weights import read_weights

    path, model = reward_model_dir(tmp_path, "qwen2")
    convert_hf_to_ms(path, tmp_path / "critic.ckpt", output_yaml=tmp_path / "critic.yaml")
    step_dir = tmp_path / "step_000002"
    critic = read_weights(str(tmp_path / "critic.ckpt"))
    write_trainer_checkpoint(critic, step_dir, net="critic")
    actor = {name: value + 1 for name, value in critic.items() if name != "score.weight"}
    actor["lm_head.weight"] = np.zeros((320, 64), np.float32)
    write_trainer_checkpoint(actor, step_dir)  # the actor beside it must not leak into the export
    back = tmp_path / "back"
    res = run_convert_weight("--reverse", "--net", "critic", "--mindspore_ckpt_path", step_dir, "--torch_ckpt_dir",
                             back, "--config_path", tmp_path / "critic.yaml")
    assert res.returncode == 0, res.stderr
    assert safetensors_bytes(back) == safetensors_bytes(path)
    reloaded = AutoModelForSequenceClassification.from_pretrained(back, torch_dtype=torch.float32).eval()
    ids, mask = batch()
    np.testing.assert_allclose(hf_scores(reloaded, ids, mask), hf_scores(model, ids, mask), atol=1e-6)
    res = run_convert_weight("--reverse", "--net", "critic", "--mindspore_ckpt_path", tmp_path / "nowhere",
                             "--torch_ckpt_dir", tmp_path / "back2", "--config_path", tmp_path / "critic.yaml")
    assert res.returncode == 2 and "checkpoint not found" in res.stderr.strip().splitlines()[-1]
    (step_dir / "critic_strategy.ckpt").unlink()
    res = run_convert_weight("--reverse", "--net", "critic", "--mindspore_ckpt_path", step_dir, "--torch_ckpt_dir",
                             tmp_path / "back2", "--config_path", tmp_path / "critic.yaml")
    assert res.returncode == 2 and "not a trainer checkpoint folder with a critic (no critic_strategy.ckpt)" in \
        res.stderr.strip().splitlines()[-1]
