"""Every key of a MindFormers / MindRLHF model YAML that is not a field here is honoured, warned about in one line
naming it, or refused with what to set instead (`mindrlhf.configs.foreign_keys`); `docs/yaml_keys.md` lists them."""
import logging
import re
from pathlib import Path

import pytest

from mindrlhf.configs import foreign_keys
from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.foreign_keys import MODEL_KEYS, PARALLEL_KEYS, REFUSE, TOP_LEVEL_KEYS, WARN
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
            "only_save_strategy": True}


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


def test_sections_not_read_here_are_named_once(caplog):
    foreign_keys.warn_once.cache_clear()
    data = _yaml("", "runner_config", {"epochs": 2})
    data["my_section"] = {"a": 1}
    data["parallel"] = {"parallel_mode": 1, "full_batch": True}
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        Qwen2Config.from_dict(data, "job.yaml")
        Qwen2Config.from_dict(data, "job.yaml")  # read twice, said once
    assert [r.getMessage() for r in caplog.records] == [
        "job.yaml: 'runner_config' has no effect here: epochs and batch sizes come from the GRPO config",
        "job.yaml: 'my_section' has no effect here: it is not a key this implementation reads",
        "job.yaml: parallel.parallel_mode, parallel.full_batch have no effect here: layouts are explicit per network "
        "(parallel_config), not MindSpore's semi-auto parallel"]


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
    text = (Path(__file__).resolve().parents[1] / "docs" / "yaml_keys.md").read_text()
    for _, key, _ in _cases():
        assert f"`{key}`" in text, key
    for name in ("recompute_config.recompute", "recompute_config.select_recompute",
                 "recompute_config.recompute_granularity", "parallel_config.optimizer_shard",
                 "parallel.enable_parallel_optimizer", *foreign_keys.SECTIONS):
        assert f"`{name}`" in text, name
