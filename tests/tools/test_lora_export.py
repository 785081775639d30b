"""A LoRA policy's export (#68): `convert_weight --reverse` of a checkpoint with adapters writes a PEFT folder that
`peft.PeftModel.from_pretrained(base, folder)` loads with mindrlhf's logits, and with --merge_lora a Hugging Face
model of the merged weights with the same logits; a checkpoint without its lora_alpha is refused in one line."""
import json

import numpy as np
import pytest

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")
ms = pytest.importorskip("mindspore")

from support.hf_fixtures import hf_logits, make_hf_model_dir  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from mindrlhf.cli import convert_weight  # noqa: E402
from mindrlhf.configs.lora import LoraConfig, is_adapter  # noqa: E402, is_adapter
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from mindrlhf.models.qwen2.convert import convert_hf_to_ms, read_ms_checkpoint, save_ms_checkpoint  # noqa: E402
from mindrlhf.parallel.layers import load_full_state, random_full_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("graph_mode")
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    """A random HF Qwen2 base, its MindSpore weights with random rank-4 adapters (alpha 8), and mindrlhf's logits."""
    root = tmp_path_factory.mktemp("lora_export")
    base_dir, _ = make_hf_model_dir(root / "base", arch="qwen2", rope_theta=1e6, seed=11)
    convert_hf_to_ms(base_dir, root / "base.ckpt", output_yaml=root / "model.yaml")
    cfg = Qwen2Config.from_yaml(root / "model.yaml")
    cfg.lora = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_target_modules=TARGETS)
    net = Qwen2ForCausalLM(cfg)
    adapters = {k: v * 0.5 for k, v in random_full_state(net, seed=2).items() if is_adapter(k)}
    state = {**read_ms_checkpoint(root / "base.ckpt"), **adapters}
    load_full_state(net, state)
    save_ms_checkpoint(state, str(root / "lora.ckpt"))
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 11))
    logits = net(ms.Tensor(ids.astype(np.int32))).asnumpy()
    return root, base_dir, ids, logits


def reverse(root, out, *extra) -> int:
    return convert_weight.main(["--reverse", "--mindspore_ckpt_path", str(root / "lora.ckpt"), "--torch_ckpt_dir",
                                str(out), "--config_path", str(root / "model.yaml"), *extra])


def test_the_peft_folder_loads_in_peft_with_mindrlhfs_logits(lora_checkpoint):
    root, base_dir, ids, logits = lora_checkpoint
    assert reverse(root, root / "adapter", "--lora_alpha", "8", "--base_model", str(base_dir)) == 0
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, TARGETS)
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").eval()
    without = hf_logits(base, ids).numpy()
    model = peft.PeftModel.from_pretrained(base, str(root / "adapter")).eval()
    np.testing.assert_allclose(hf_logits(model, ids).numpy(), logits, atol=2e-4, rtol=1e-4)
    assert np.abs(without - logits).max() > 1e-2  # the adapters matter


def test_merge_lora_writes_a_model_of_the_merged_weights(lora_checkpoint):
    root, _, ids, logits = lora_checkpoint
    assert reverse(root, root / "merged", "--lora_alpha", "8", "--merge_lora") == 0
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(merged, ids).numpy(), logits, atol=2e-4, rtol=1e-4)
    assert not (root / "merged" / "adapter_config.json").exists()


def test_an_adapter_checkpoint_without_its_alpha_is_refused_in_one_line(lora_checkpoint, capsys):
    root, *_ = lora_checkpoint
    assert reverse(root, root / "nowhere") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds LoRA adapters but not their lora_alpha" in err and "--lora_alpha A" in err
