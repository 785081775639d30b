"""Every key of a MindFormers / MindRLHF model YAML that is not a field here is honoured, mapped onto a field,
ignored with its reason (a short warning line a reason, naming its keys), or refused with what to set instead
(`mindrlhf.configs.foreign_keys`); an unknown key one edit away from a known one is refused as a typo with a
did-you-mean; `docs/yaml_keys.md` lists them."""
import logging
import re
from pathlib import Path

import pytest
import yaml
from support.paths import DOCS, TINY

from mindrlhf.configs import foreign_keys
from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.foreign_keys import (
    EOS_LIST_REASON,
    MODEL_ALIASES,
    MODEL_KEYS,
    PARALLEL_KEYS,
    REFUSE,
    SECTIONS,
    TOP_LEVEL_KEYS,
    WARN,
)
from mindrlhf.models.qwen2 import Qwen2Config

MODEL = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=4, intermediate_size=64)

# a value each key's rule does not take as meaning what this implementation does
NOT_FINE = {"use_past": False, "use_flash_attention": True, "checkpoint_name_or_path": "/ckpt/qwen.ckpt",
            "offset": [1, 0], "repetition_penalty": 1.1, "use_past_shard": True, "qkv_concat": True,
            "extend_method": "PI", "layernorm_compute_type": "bfloat16", "softmax_compute_type": "float16",
            "rotary_dtype": "bfloat16", "emb_dropout_prob": 0.1, "fine_grain_interleave": 2, "hidden_act": "gelu",
            "parallel_optimizer": True, "vocab_emb_dp": True,
            "micro_batch_interleave_num": 2, "expert_parallel": 2, "context_parallel": 2,
            "load_checkpoint": "/ckpt", "src_strategy_path_or_dir": "/strategy", "resume_training": True,
            "only_save_strategy": True,
            # MindFormers' generation defaults and MindRLHF's Qwen-derived keys
            "temperature": 1.2, "top_k": 50, "top_p": 0.8, "do_sample": True, "max_decode_length": 2048,
            "min_decode_length": 2, "compute_in_2d": True, "rotary_pct": 0.5,
            # MindFormers' trainer settings
            "load_ckpt_format": "safetensors", "do_eval": True, "profile": True, "auto_tune": True,
            "layer_scale": True}


def _yaml(section: str, key: str, value) -> dict:
    data = {"model": {"model_config": dict(MODEL)}}
    if section == "model.model_config":
        data["model"]["model_config"][key] = value
    elif section == "parallel_config":
        data["parallel_config"] = {key: value}
    else:
        data[key] = value
    return data


def _cases():
    for section, rules in (("model.model_config", MODEL_KEYS), ("parallel_config", PARALLEL_KEYS),
                           ("", TOP_LEVEL_KEYS)):
        for key, rule in rules.items():
            yield section, key, rule


@pytest.mark.parametrize("section,key,rule", list(_cases()), ids=[k for _, k, _ in _cases()])
def test_each_foreign_key_is_honoured_warned_about_or_refused_by_name(section, key, rule, caplog):
    foreign_keys.warn_once.cache_clear()
    where = f"{section}.{key}" if section else key
    if key not in NOT_FINE:  # every value means what this implementation does: accepted without a word
        assert rule.fine("anything") and rule.fine(None)
        with caplog.at_level(logging.WARNING, "mindrlhf.config"):
            Qwen2Config.from_dict(_yaml(section, key, "anything"), "job.yaml")
        assert key not in caplog.text
        return
    value = NOT_FINE[key]
    assert not rule.fine(value)
    if rule.action == REFUSE:
        with pytest.raises(ConfigError, match=rf"^job.yaml: {re.escape(where)}={re.escape(repr(value))} is not "
                                              rf"supported: {re.escape(rule.advice)}$"):
            Qwen2Config.from_dict(_yaml(section, key, value), "job.yaml")
        return
    assert rule.action == WARN
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        Qwen2Config.from_dict(_yaml(section, key, value), "job.yaml")
    lines = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert lines == [f"job.yaml: {where}={value!r} has no effect here: {rule.advice}"]


def test_values_that_mean_what_is_done_here_pass_silently(caplog):
    foreign_keys.warn_once.cache_clear()
    data = _yaml("model.model_config", "use_past", True)
    data["model"]["model_config"].update(use_flash_attention=False, checkpoint_name_or_path="", offset=0,
                                         qkv_concat=False, extend_method="None", hidden_act="silu",
                                         softmax_compute_type="float32", emb_dropout_prob=0.0)
    data["parallel_config"] = {"vocab_emb_dp": False, "micro_batch_interleave_num": 1,
                               "expert_parallel": 1, "context_parallel": 1, "gradient_aggregation_group": 4}
    data.update(seed=0, load_checkpoint="", auto_trans_ckpt=False)
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        Qwen2Config.from_dict(data, "job.yaml")
    assert caplog.text == ""


def test_sections_not_read_here_are_named_a_line_a_reason_once(caplog):
    foreign_keys.warn_once.cache_clear()
    data = _yaml("", "runner_config", {"epochs": 2})
    data["my_section"] = {"a": 1}  # an unknown top-level key: in the same line, with its reason
    data["parallel"] = {"parallel_mode": 1, "full_batch": True}
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        Qwen2Config.from_dict(data, "job.yaml")
        Qwen2Config.from_dict(data, "job.yaml")  # read twice, said once
    assert [r.getMessage() for r in caplog.records] == [
        "job.yaml: 'runner_config' has no effect here: epochs and batch sizes come from the GRPO config",
        "job.yaml: 'my_section' has no effect here: it is not a key this implementation reads",
        "job.yaml: parallel.parallel_mode, parallel.full_batch have no effect here: layouts are explicit per network "
        "(parallel_config), not MindSpore's semi-auto parallel"]


@pytest.mark.parametrize("where,meant", [
    ("paralel_config", "parallel_config"), ("recompute_confg", "recompute_config"), ("sed", "seed"),
    ("runer_config", "runner_config"), ("load_checkpiont", "load_checkpoint"), ("model.arc", "arch"),
    ("model.model_configs", "model_config"), ("parallel.enable_parallel_optimiser", "enable_parallel_optimizer"),
])
def test_a_key_one_edit_from_a_known_one_is_refused_as_a_typo(where, meant, caplog):
    """A misspelt section read here would be dropped (`paralel_config`: the default layout, `recompute_confg`: no
    recompute): a key one edit away from a known one is refused by name; a farther one is warned about as before."""
    data = _yaml("model.model_config", "type", "Qwen2Config")
    section, _, key = where.rpartition(".")
    (data.setdefault(section, {}) if section else data)[key] = {"data_parallel": 1} if "config" in key else True
    with pytest.raises(ConfigError, match=rf"^job.yaml: {re.escape(where)}: unknown key \(did you mean "
                                          rf"'{meant}'\?\)$"):
        Qwen2Config.from_dict(data, "job.yaml")
    foreign_keys.warn_once.cache_clear()
    far = _yaml("model.model_config", "type", "Qwen2Config")
    far["model"]["my_key"] = 1
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        Qwen2Config.from_dict(far, "job.yaml")
    assert [r.getMessage() for r in caplog.records] == [
        "job.yaml: model.my_key has no effect here: it is not a key this implementation reads"]


def test_an_unknown_key_is_still_an_error_with_a_hint():
    with pytest.raises(ConfigError, match=r"job.yaml: parallel_config: unknown field\(s\) 'use_seq_paralel' \(did "
                                          r"you mean 'use_seq_parallel'"):
        Qwen2Config.from_dict(_yaml("parallel_config", "use_seq_paralel", True), "job.yaml")


def test_flash_attention_is_refused_off_cpu(monkeypatch):
    import mindspore as ms

    from mindrlhf.trainer.plan import check_tensor_parallel

    cfg = Qwen2Config(**MODEL, use_flash_attention=True)
    check_tensor_parallel(cfg, 1, "train.yaml")  # CPU: the reader's warning only
    monkeypatch.setattr(ms, "get_context", lambda key: "Ascend")
    with pytest.raises(ConfigError, match=r"train.yaml: model.model_config.use_flash_attention=true is not supported "
                                          r"on Ascend: flash attention is not built here"):
        check_tensor_parallel(cfg, 1, "train.yaml")


def test_the_key_table_lists_every_key():
    text = (DOCS / "yaml_keys.md").read_text()
    for _, key, _ in _cases():
        assert f"`{key}`" in text, key
    for name in ("recompute_config.recompute", "recompute_config.select_recompute",
                 "recompute_config.recompute_granularity", "parallel_config.optimizer_shard",
                 "parallel.enable_parallel_optimizer", *foreign_keys.SECTIONS, *MODEL_ALIASES, "kv_channels",
                 "eos_token_id"):
        assert f"`{name}`" in text, name


# ---------------------------------------------------------------- MindRLHF's Qwen2.5 GRPO keys on the tiny model
# model_config keys of MindRLHF's model_configs/qwen_grpo/{finetune_qwen2_5_7b,predict_qwen2_5_7b_instruct}.yaml that
# are not fields here, with values at the tiny model's shape (hidden 64 / 4 heads = 16-wide heads)
MINDRLHF_KEYS = {"compute_in_2d": True, "rotary_pct": 1.0, "rotary_emb_base": 500000, "kv_channels": 16,
                 "max_position_embeddings": 1024, "eos_token_id": [702, 700], "repetition_penalty": 1.0,
                 "max_decode_length": 2048, "min_decode_length": 2, "temperature": 1.2, "top_k": 50, "top_p": 1.0,
                 "do_sample": True}


def _tiny_yaml(tmp_path, drop=("theta", "max_position_embedding"), **keys) -> Path:
    """model_configs/tiny/model.yaml with `keys` added to model_config (and the fields `drop` removed)."""
    data = yaml.safe_load((TINY / "model.yaml").read_text())
    model_cfg = data["model"]["model_config"]
    for name in drop:
        model_cfg.pop(name)
    model_cfg.update(keys)
    path = tmp_path / "mindrlhf_tiny.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_mindrlhfs_qwen_keys_load_with_one_warning_and_mapped_values(tmp_path, caplog):
    foreign_keys.warn_once.cache_clear()
    path = _tiny_yaml(tmp_path, **MINDRLHF_KEYS)
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        cfg = Qwen2Config.from_yaml(path)
    assert cfg.theta == 500000.0  # rotary_emb_base
    assert cfg.max_position_embedding == 1024  # max_position_embeddings
    assert cfg.eos_token_id == 702  # the list's first id
    assert cfg.get_head_dim() == 16 and cfg.head_dim == 0  # kv_channels checked against hidden_size / num_heads
    sampling = ", ".join(f"model.model_config.{k}={MINDRLHF_KEYS[k]!r}" for k in
                         ("max_decode_length", "min_decode_length", "temperature", "top_k", "top_p", "do_sample"))
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: model.model_config.eos_token_id[1:]=[700] has no effect here: {EOS_LIST_REASON}",
        f"{path}: model.model_config.compute_in_2d=True has no effect here: {MODEL_KEYS['compute_in_2d'].advice}",
        f"{path}: {sampling} have no effect here: {MODEL_KEYS['temperature'].advice}"]
    assert "grpo.yaml" in MODEL_KEYS["temperature"].advice and "generation.temperature" in caplog.text
    assert "tokenizer's stop ids" in caplog.text


def test_theta_and_rotary_emb_base_agree_or_are_refused_by_name(tmp_path):
    assert Qwen2Config.from_yaml(_tiny_yaml(tmp_path, drop=(), rotary_emb_base=10000)).theta == 10000.0
    with pytest.raises(ConfigError, match=r"mindrlhf_tiny.yaml: model.model_config.rotary_emb_base=1000000 and "
                                          r"model.model_config.theta=10000.0 disagree: rotary_emb_base is another "
                                          r"name of theta"):
        Qwen2Config.from_yaml(_tiny_yaml(tmp_path, drop=(), rotary_emb_base=1000000))
    with pytest.raises(ConfigError, match=r"model.model_config.max_position_embeddings=32768 and "
                                          r"model.model_config.max_position_embedding=512 disagree"):
        Qwen2Config.from_yaml(_tiny_yaml(tmp_path, drop=(), max_position_embeddings=32768))


def test_kv_channels_must_be_the_head_width(tmp_path):
    with pytest.raises(ConfigError, match=r"model.model_config.kv_channels=32 does not match the head width "
                                          r"hidden_size / num_heads = 64 / 4 = 16; set kv_channels: 16 or remove it"):
        Qwen2Config.from_yaml(_tiny_yaml(tmp_path, drop=(), kv_channels=32))
    assert Qwen2Config.from_yaml(_tiny_yaml(tmp_path, drop=(), kv_channels=32, head_dim=32)).get_head_dim() == 32
    with pytest.raises(ConfigError, match=r"kv_channels=16 does not match the head width head_dim=32"):
        Qwen2Config.from_yaml(_tiny_yaml(tmp_path, drop=(), kv_channels=16, head_dim=32))


def test_eos_token_id_list_of_one_id_passes_silently_and_an_empty_one_is_refused(tmp_path, caplog):
    foreign_keys.warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        assert Qwen2Config.from_yaml(_tiny_yaml(tmp_path, drop=(), eos_token_id=[701])).eos_token_id == 701
    assert caplog.text == ""
    with pytest.raises(ConfigError, match=r"model.model_config.eos_token_id=\[\] names no token"):
        Qwen2Config.from_yaml(_tiny_yaml(tmp_path, drop=(), eos_token_id=[]))


def test_a_misspelt_mindrlhf_key_is_still_an_error_with_a_hint(tmp_path):
    with pytest.raises(ConfigError, match=r"mindrlhf_tiny.yaml: model.model_config: unknown field\(s\) "
                                          r"'rotary_emb_bse' \(did you mean 'rotary_emb_base'\?\)"):
        Qwen2Config.from_yaml(_tiny_yaml(tmp_path, drop=(), rotary_emb_bse=10000))


def test_mindrlhfs_trainer_sections_are_named_with_their_reason(caplog):
    foreign_keys.warn_once.cache_clear()
    data = _yaml("", "micro_batch_interleave_num", 2)
    data.update(callbacks=[{"type": "MFLossMonitor"}], train_dataset={"batch_size": 4}, eval_step_interval=-1,
                profile=False)
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        Qwen2Config.from_dict(data, "job.yaml")
    assert [r.getMessage() for r in caplog.records] == [
        "job.yaml: micro_batch_interleave_num=2 has no effect here: "
        f"{TOP_LEVEL_KEYS['micro_batch_interleave_num'].advice}",
        f"job.yaml: 'callbacks' has no effect here: {SECTIONS['callbacks']}",
        f"job.yaml: 'train_dataset' has no effect here: {SECTIONS['train_dataset']}"]


@pytest.mark.parametrize("key,known,near", [
    ("n_samples_per_promt", "n_samples_per_prompt", True),  # a character left out
    ("n_samples_per_prompts", "n_samples_per_prompt", True),  # one added
    ("n_sample_per_promt", "n_samples_per_prompt", False),  # two left out
    ("seqd", "seed", True),  # replaced
    ("sede", "seed", True), ("esed", "seed", True),  # two neighbours swapped
    ("edes", "seed", False), ("seed", "seed", False), ("parallel", "parallel_config", False),
])
def test_one_edit_apart(key, known, near):
    from mindrlhf.configs.base import closest_key, one_edit_apart

    assert one_edit_apart(key, known) is near and one_edit_apart(known, key) is near
    assert closest_key(key, [known, "other"], one_edit=True) == (known if near else None)
