"""HF <-> MindSpore checkpoint conversion: exact tensors, round trips, the CLI and its bad-input errors."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
import torch
from safetensors.torch import save_file as torch_save_safetensors
from support.checkpoints import write_trainer_checkpoint
from support.hf_fixtures import hf_logits, make_hf_model_dir, safetensors_bytes
from support.paths import TOKENIZER
from support.tools import run_convert_weight
from transformers import AutoModelForCausalLM, AutoTokenizer

from mindrlhf.cli import convert_weight
from mindrlhf.models.qwen2.config import Qwen2Config
from mindrlhf.models.qwen2.convert import (
    ConversionError,
    cast_array,
    convert_hf_to_ms,
    convert_ms_to_hf,
    expected_shapes,
    read_hf_state_dict,
)
from mindrlhf.models.qwen2.names import hf_to_ms_name, ms_to_hf_name

INPUT_IDS = [[1, 17, 42, 99, 250, 3, 7, 311], [5, 6, 7, 8, 9, 10, 11, 12]]

# name -> make_hf_model_dir kwargs. Together: Qwen2 (qkv bias) / Llama (none), tied / untied, sharded
# safetensors, single and sharded .bin (with legacy inv_freq buffers), a bf16 source.
VARIANTS = {
    "qwen2": dict(arch="qwen2", rope_theta=1e6),
    "qwen2_tied": dict(arch="qwen2", tie=True, vocab_size=500, seed=1),
    "llama": dict(arch="llama", rope_theta=5e5, seed=2),
    "llama_tied": dict(arch="llama", tie=True, seed=3),
    "qwen2_sharded": dict(arch="qwen2", max_shard_size="40KB", seed=4),
    "qwen2_tied_bin": dict(arch="qwen2", tie=True, fmt="bin", seed=5),
    "llama_bin_sharded": dict(arch="llama", fmt="bin", max_shard_size=60_000, seed=6),
    "qwen2_bf16": dict(arch="qwen2", dtype="bfloat16", seed=7),
    "llama_attention_bias": dict(arch="llama", qkv_bias=True, seed=8),  # o_proj gets a bias: unsupported
}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """hf_model(name) -> (folder, model); each variant is built once per module."""
    cache = {}
    root = tmp_path_factory.mktemp("hf")

    def get(name):
        if name not in cache:
            kwargs = dict(VARIANTS[name])
            extra = {}
            if name == "llama_bin_sharded":  # older Llama .bin files carry the rotary buffer per layer
                extra = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)}
            cache[name] = make_hf_model_dir(root / name, **kwargs)
            if extra:
                _add_bin_buffers(cache[name].path, extra)
        return cache[name]

    return get


def _add_bin_buffers(folder: Path, extra: dict) -> None:
    """Appends buffers to the first shard of a sharded .bin folder and to its index."""
    index_path = folder / "pytorch_model.bin.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shard = torch.load(folder / first, weights_only=True)
    shard.update(extra)
    torch.save(shard, folder / first)
    index["weight_map"].update(dict.fromkeys(extra, first))
    index_path.write_text(json.dumps(index))


def _hf_weights(model) -> dict[str, torch.Tensor]:
    """The HF state dict the MindSpore ckpt must reproduce (a tied lm_head is not stored)."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _load_ckpt(path) -> dict[str, ms.Parameter]:
    return dict(ms.load_checkpoint(str(path)))


def _bits(t: torch.Tensor) -> np.ndarray:
    """Bit pattern of a bf16/fp16 torch tensor as uint16."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


# ----------------------------------------------------------------------------------- HF -> MindSpore
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "llama_attention_bias"])
def test_hf_to_ms_exact(hf_model, tmp_path, variant):
    folder, model = hf_model(variant)
    ckpt, out_yaml = tmp_path / "model.ckpt", tmp_path / "model.yaml"
    cfg = convert_hf_to_ms(folder, ckpt, output_yaml=out_yaml)

    params = _load_ckpt(ckpt)
    expected = _hf_weights(model)
    assert set(params) == {hf_to_ms_name(n) for n in expected}
    assert ("lm_head.weight" in params) == (not cfg.tie_word_embeddings)
    for hf_name, tensor in expected.items():
        param = params[hf_to_ms_name(hf_name)]
        assert param.dtype == ms.float32, hf_name
        np.testing.assert_array_equal(param.asnumpy(), tensor.float().numpy(), err_msg=hf_name)
    assert Qwen2Config.from_yaml(out_yaml) == Qwen2Config.from_hf(folder) == cfg


@pytest.mark.parametrize("dtype,ms_dtype,torch_dtype", [("fp16", ms.float16, torch.float16),
                                                        ("bf16", ms.bfloat16, torch.bfloat16)])
def test_hf_to_ms_low_precision_is_correctly_rounded(hf_model, tmp_path, dtype, ms_dtype, torch_dtype):
    folder, model = hf_model("qwen2")
    cfg = convert_hf_to_ms(folder, tmp_path / "m.ckpt", dtype=dtype)
    assert cfg.param_init_type == {"fp16": "float16", "bf16": "bfloat16"}[dtype]
    params = _load_ckpt(tmp_path / "m.ckpt")
    for hf_name, tensor in _hf_weights(model).items():
        param = params[hf_to_ms_name(hf_name)]
        assert param.dtype == ms_dtype
        np.testing.assert_array_equal(param.asnumpy().view(np.uint16), _bits(tensor.to(torch_dtype)),
                                      err_msg=hf_name)


def test_a_flag_prefix_is_refused_in_one_line(capsys):
    """Flags are matched exactly: `--torch_ckpt` is not taken for `--torch_ckpt_dir`."""
    with pytest.raises(SystemExit) as stop:
        convert_weight.build_parser().parse_args(
            ["--torch_ckpt", "hf", "--mindspore_ckpt_path", "x.ckpt"])
    assert stop.value.code == 2
    error, see = capsys.readouterr().err.splitlines()  # prog: error: ..., see prog --help (prog: argv[0])
    assert error.endswith(": error: the following arguments are required: --torch_ckpt_dir") and see.endswith(" --help")


def test_bf16_cast_matches_torch_on_edge_values():
    """Round-to-nearest-even ties, subnormals, overflow to inf, signed zero: same bits as torch."""
    x = np.array([1.00390625, 1.01171875, -1.01171875, 1e-40, -0.0, 3.3e38, 3.4e38, 65504.0, np.inf],
                 dtype=np.float32)
    with pytest.raises(ConversionError, match="overflow bfloat16"):
        cast_array(x, "bf16", "t")
    x = x[np.abs(x) < 3.39e38]
    np.testing.assert_array_equal(cast_array(x, "bf16").view(np.uint16), _bits(torch.from_numpy(x).bfloat16()))
    np.testing.assert_array_equal(cast_array(cast_array(x, "bf16"), "fp32"), torch.from_numpy(x).bfloat16().float())


def test_fp16_overflow_is_an_error():
    with pytest.raises(ConversionError, match=r"model.norm.weight: values overflow float16 \(max \|x\| = 70000\)"):
        cast_array(np.array([1.0, -70000.0], np.float32), "fp16", "model.norm.weight")


def test_read_hf_state_dict_widens_bf16_exactly(hf_model):
    folder, model = hf_model("qwen2_bf16")
    state = read_hf_state_dict(folder)
    assert set(state) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert state[name].dtype == np.float32
        np.testing.assert_array_equal(state[name], tensor.float().numpy())


def test_expected_shapes_follow_names_and_parameter_count():
    for kwargs in (dict(qkv_has_bias=True, tie_word_embeddings=False),
                   dict(qkv_has_bias=False, tie_word_embeddings=True)):
        cfg = Qwen2Config(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2,
                          intermediate_size=128, **kwargs)
        shapes = expected_shapes(cfg)
        assert all(ms_to_hf_name(n) is not None for n in shapes)
        assert sum(int(np.prod(s)) for s in shapes.values()) == cfg.num_parameters()


def test_a_model_of_another_architecture_is_refused_even_with_a_yaml(hf_model, tmp_path):
    """A folder whose config.json names GPT-2 is not converted as Qwen2 because a YAML gives the shapes."""
    folder, _ = hf_model("llama")
    Qwen2Config.from_hf(folder).to_yaml(tmp_path / "model.yaml")
    other = tmp_path / "gpt2"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2",
                                                   "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConversionError, match=r"config.json: model_type='gpt2' \(architectures=\['GPT2LMHeadModel'\]\) "
                                              r"is not supported"):
        convert_hf_to_ms(other, tmp_path / "m.ckpt", config_path=tmp_path / "model.yaml")
    assert not (tmp_path / "m.ckpt").exists()


def test_config_path_checks_shapes_and_sets_dtype(hf_model, tmp_path):
    folder, model = hf_model("llama")
    cfg = dataclasses.replace(Qwen2Config.from_hf(folder), param_init_type="bfloat16")
    cfg.to_yaml(tmp_path / "model.yaml")
    out = convert_hf_to_ms(folder, tmp_path / "m.ckpt", config_path=tmp_path / "model.yaml")
    assert out == cfg
    params = _load_ckpt(tmp_path / "m.ckpt")
    assert {p.dtype for p in params.values()} == {ms.bfloat16}


def test_failed_save_leaves_no_partial_file(hf_model, tmp_path, monkeypatch):
    folder, _ = hf_model("qwen2")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ckpt = out_dir / "model.ckpt"
    convert_hf_to_ms(folder, ckpt)
    before = ckpt.read_bytes()

    import mindrlhf.utils.checkpoint_file as checkpoint_file

    tensor_bytes = checkpoint_file._bytes_and_dtype
    written = []

    def disk_full_after_two_tensors(value):  # the file already holds two tensors' records when it fails
        written.append(value)
        if len(written) > 2:
            raise OSError("disk full")
        return tensor_bytes(value)

    monkeypatch.setattr(checkpoint_file, "_bytes_and_dtype", disk_full_after_two_tensors)
    with pytest.raises(OSError, match="disk full"):
        convert_hf_to_ms(folder, ckpt)
    assert _files(out_dir) == {"model.ckpt"}
    assert ckpt.read_bytes() == before


# ----------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("variant,dtype", [("qwen2", None), ("llama_tied", None), ("qwen2_sharded", None),
                                           ("qwen2_bf16", "bf16")])
def test_round_trip_is_bit_identical(hf_model, tmp_path, variant, dtype):
    folder, model = hf_model(variant)
    ckpt, yaml_path, back = tmp_path / "m.ckpt", tmp_path / "m.yaml", tmp_path / "back"
    convert_hf_to_ms(folder, ckpt, dtype=dtype, output_yaml=yaml_path)
    convert_ms_to_hf(ckpt, yaml_path, back)

    assert _files(back) == {"config.json", "model.safetensors"}
    assert safetensors_bytes(back) == safetensors_bytes(folder)
    assert Qwen2Config.from_hf(back) == Qwen2Config.from_hf(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    assert type(reloaded) is type(model) and reloaded.dtype == model.dtype
    assert torch.equal(hf_logits(reloaded, INPUT_IDS), hf_logits(model, INPUT_IDS))


def test_reverse_casts_dtype(hf_model, tmp_path):
    folder, model = hf_model("qwen2_tied")
    convert_hf_to_ms(folder, tmp_path / "m.ckpt", output_yaml=tmp_path / "m.yaml")
    cfg = convert_ms_to_hf(tmp_path / "m.ckpt", tmp_path / "m.yaml", tmp_path / "back", dtype="bf16")
    assert cfg.param_init_type == "bfloat16"
    back = safetensors_bytes(tmp_path / "back")
    for name, tensor in _hf_weights(model).items():
        assert back[name][2] == _bits(tensor.bfloat16()).tobytes(), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"


# ----------------------------------------------------------------------------------- CLI
@pytest.mark.slow
def test_cli_forward_and_reverse(hf_model, tmp_path):
    folder, model = hf_model("qwen2_tied")
    ckpt, yaml_path, back = tmp_path / "m.ckpt", tmp_path / "m.yaml", tmp_path / "back"
    res = run_convert_weight("--torch_ckpt_dir", folder, "--mindspore_ckpt_path", ckpt, "--dtype", "fp32",
                             "--output_yaml", yaml_path)
    assert res.returncode == 0, res.stderr
    assert f"wrote {ckpt}" in res.stdout
    assert Qwen2Config.from_yaml(yaml_path) == Qwen2Config.from_hf(folder)
    res = run_convert_weight("--reverse", "--mindspore_ckpt_path", ckpt, "--torch_ckpt_dir", back, "--config_path",
                             yaml_path)
    assert res.returncode == 0, res.stderr
    assert safetensors_bytes(back) == safetensors_bytes(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    assert torch.equal(hf_logits(reloaded, INPUT_IDS), hf_logits(model, INPUT_IDS))


def _copy(folder: Path, dst: Path, skip=()) -> Path:
    shutil.copytree(folder, dst, ignore=lambda d, names: [n for n in names if n in skip])
    return dst


def _bad_missing_folder(hf_model, tmp):
    return tmp / "nope", [], ["nope", "folder not found"]


def _bad_missing_config(hf_model, tmp):
    d = _copy(hf_model("qwen2").path, tmp / "hf", skip={"config.json"})
    return d, [], [str(d / "config.json"), "config.json not found"]


def _bad_no_weights(hf_model, tmp):
    d = _copy(hf_model("qwen2").path, tmp / "hf", skip={"model.safetensors"})
    return d, [], [str(d), "no weight files"]


def _bad_gpt2(hf_model, tmp):
    d = _copy(hf_model("qwen2").path, tmp / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    return d, [], [str(d / "config.json"), "model_type='gpt2'", "not supported"]


def _bad_shape_vs_yaml(hf_model, tmp):
    folder = hf_model("qwen2").path
    cfg = dataclasses.replace(Qwen2Config.from_hf(folder), intermediate_size=96)
    cfg.to_yaml(tmp / "model.yaml")
    return folder, ["--config_path", tmp / "model.yaml"], [
        "model.layers.0.mlp.gate_proj.weight", "[128, 64]", "[96, 64]", str(tmp / "model.yaml")]


def _bad_truncated(hf_model, tmp):
    d = _copy(hf_model("qwen2").path, tmp / "hf")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) * 2 // 3])
    return d, [], [str(d / "model.safetensors"), "truncated"]


def _bad_truncated_header(hf_model, tmp):
    d = _copy(hf_model("qwen2").path, tmp / "hf")
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])
    return d, [], [str(d / "model.safetensors"), "truncated"]


def _bad_missing_shard(hf_model, tmp):
    src = hf_model("qwen2_sharded").path
    shard = sorted(set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    d = _copy(src, tmp / "hf", skip={shard})
    return d, [], [str(d / "model.safetensors.index.json"), shard, "do not exist"]


def _bad_unknown_tensor(hf_model, tmp):
    return hf_model("llama_attention_bias").path, [], [
        "unknown tensor", "model.layers.0.self_attn.o_proj.bias", "model.layers.1.self_attn.o_proj.bias"]


def _bad_tied_head_differs(hf_model, tmp):
    folder, model = hf_model("qwen2_tied")
    d = _copy(folder, tmp / "hf")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    torch_save_safetensors(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, [], [str(d / "model.safetensors"), "lm_head.weight differs", "tie_word_embeddings=true"]


BAD_INPUTS = {f.__name__[5:]: f for f in (
    _bad_missing_folder, _bad_missing_config, _bad_no_weights, _bad_gpt2, _bad_shape_vs_yaml, _bad_truncated,
    _bad_truncated_header, _bad_missing_shard, _bad_unknown_tensor, _bad_tied_head_differs)}


def _check_error_output(returncode: int, stderr: str, expected: list[str]) -> None:
    assert returncode == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for text in expected:
        assert text in lines[0], (text, lines[0])


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_cli_bad_input(hf_model, tmp_path, capsys, case):
    """The CLI's main() in-process (a subprocess per case costs ~3 s); see the subprocess tests below."""
    hf_dir, extra_args, expected = BAD_INPUTS[case](hf_model, tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = ["--torch_ckpt_dir", hf_dir, "--mindspore_ckpt_path", out_dir / "m.ckpt",
            "--output_yaml", out_dir / "m.yaml", *extra_args]
    returncode = convert_weight.main([str(a) for a in args])
    _check_error_output(returncode, capsys.readouterr().err, expected)
    assert _files(out_dir) == set()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["truncated", "missing_shard"])
def test_cli_bad_input_subprocess(hf_model, tmp_path, case):
    hf_dir, extra_args, expected = BAD_INPUTS[case](hf_model, tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = run_convert_weight("--torch_ckpt_dir", hf_dir, "--mindspore_ckpt_path", out_dir / "m.ckpt", *extra_args)
    _check_error_output(res.returncode, res.stderr, expected)
    assert _files(out_dir) == set()


def test_cli_reverse_requires_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        convert_weight.main(["--reverse", "--mindspore_ckpt_path", str(tmp_path / "m.ckpt"),
                         "--torch_ckpt_dir", str(tmp_path / "hf")])
    assert exc.value.code == 2
    assert "--reverse needs --config_path" in capsys.readouterr().err


def test_reverse_bad_inputs(hf_model, tmp_path):
    folder, _ = hf_model("qwen2")
    convert_hf_to_ms(folder, tmp_path / "m.ckpt", output_yaml=tmp_path / "m.yaml")
    with pytest.raises(ConversionError, match="MindSpore checkpoint not found"):
        convert_ms_to_hf(tmp_path / "missing.ckpt", tmp_path / "m.yaml", tmp_path / "back")
    other = dataclasses.replace(Qwen2Config.from_yaml(tmp_path / "m.yaml"), tie_word_embeddings=True)
    other.to_yaml(tmp_path / "tied.yaml")
    with pytest.raises(ConversionError, match=r"not expected by .*tied.yaml.*: lm_head.weight"):
        convert_ms_to_hf(tmp_path / "m.ckpt", tmp_path / "tied.yaml", tmp_path / "back")
    (tmp_path / "cut.ckpt").write_bytes((tmp_path / "m.ckpt").read_bytes()[:5000])
    with pytest.raises(ConversionError, match="cut.ckpt: cannot read MindSpore checkpoint"):
        convert_ms_to_hf(tmp_path / "cut.ckpt", tmp_path / "m.yaml", tmp_path / "back")
    assert not (tmp_path / "back").exists()


# ----------------------------------------------------------------------------------- the network
@pytest.mark.parametrize("variant", ["qwen2", "llama_tied"])
def test_ckpt_loads_into_network(hf_model, tmp_path, variant):
    modeling = pytest.importorskip("mindrlhf.models.qwen2.modeling",
                                   reason="mindrlhf/models/qwen2/modeling.py (the lead's network) is not there yet")
    folder, _ = hf_model(variant)
    cfg = convert_hf_to_ms(folder, tmp_path / "m.ckpt")
    net = modeling.Qwen2ForCausalLM(cfg)
    params = ms.load_checkpoint(str(tmp_path / "m.ckpt"))
    not_loaded, unused = ms.load_param_into_net(net, params, strict_load=True)
    assert not_loaded == [] and unused == []
    for name, param in net.parameters_and_names():
        np.testing.assert_array_equal(param.asnumpy(), params[param.name].asnumpy(), err_msg=name)


@pytest.mark.slow
def test_cli_reverse_of_a_trainer_checkpoint_with_tokenizer(hf_model, tmp_path):
    from mindrlhf.checkpoint.weights import read_weights
    from mindrlhf.models.tokenizer import load_tokenizer

    folder, model = hf_model("qwen2")
    convert_hf_to_ms(folder, tmp_path / "m.ckpt", output_yaml=tmp_path / "m.yaml")
    step_dir = tmp_path / "step_000003"
    write_trainer_checkpoint(read_weights(str(tmp_path / "m.ckpt")), step_dir)
    tokenizer_dir = TOKENIZER
    back = tmp_path / "back"
    res = run_convert_weight("--reverse", "--mindspore_ckpt_path", step_dir, "--torch_ckpt_dir", back,
                             "--config_path", tmp_path / "m.yaml", "--tokenizer_dir", tokenizer_dir)
    assert res.returncode == 0, res.stderr
    assert _files(back) == {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json"}
    assert safetensors_bytes(back) == safetensors_bytes(folder)  # shards merged back bit for bit
    umask = os.umask(0)
    os.umask(umask)
    assert {oct(os.stat(back / name).st_mode & 0o777) for name in _files(back)} == {oct(0o666 & ~umask)}
    reloaded = AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    assert torch.equal(hf_logits(reloaded, INPUT_IDS), hf_logits(model, INPUT_IDS))
    text = "<|im_start|>user\nNatalia sold 48 clips in April, and then half as many in May.<|im_end|>"
    assert AutoTokenizer.from_pretrained(back)(text)["input_ids"] == load_tokenizer(tokenizer_dir).encode(text)


def test_cli_reverse_of_a_broken_trainer_checkpoint(hf_model, tmp_path, capsys):
    from mindrlhf.checkpoint.weights import read_weights

    folder, _ = hf_model("qwen2")
    convert_hf_to_ms(folder, tmp_path / "m.ckpt", output_yaml=tmp_path / "m.yaml")
    step_dir = tmp_path / "step_000003"
    write_trainer_checkpoint(read_weights(str(tmp_path / "m.ckpt")), step_dir)
    shutil.rmtree(step_dir / "rank_1")
    args = ["--reverse", "--mindspore_ckpt_path", str(step_dir), "--torch_ckpt_dir", str(tmp_path / "back"),
            "--config_path", str(tmp_path / "m.yaml")]
    _check_error_output(convert_weight.main(args), capsys.readouterr().err,
                        [str(step_dir / "rank_1" / "train.ckpt"), "missing", "describes 2 ranks"])
    assert not (tmp_path / "back").exists()
    args[-1:] = [str(tmp_path / "m.yaml"), "--tokenizer_dir", str(tmp_path)]
    _check_error_output(convert_weight.main(args[:1] + ["--mindspore_ckpt_path", str(tmp_path / "m.ckpt")] + args[3:]),
                        capsys.readouterr().err, [str(tmp_path), "no tokenizer files"])
    assert not (tmp_path / "back").exists()
