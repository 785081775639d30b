"""Model YAMLs (MindFormers layout): the shipped configs and the errors bad ones give."""
import dataclasses

import pytest
import yaml
from support.paths import MODEL_CONFIGS, README

from mindrlhf.configs import ConfigError
from mindrlhf.models.qwen2 import Qwen2Config
from mindrlhf.parallel.layout import Layout, LayoutError

# Parameter counts published for the Qwen2.5 Instruct checkpoints.
PUBLISHED_PARAMETERS = {"qwen2_5_0_5b": 494_032_768, "qwen2_5_1_5b": 1_543_714_304, "qwen2_5_7b": 7_615_616_512}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_shipped_qwen25_configs_have_the_published_sizes(name):
    config = Qwen2Config.from_yaml(MODEL_CONFIGS / "qwen2_5" / f"{name}.yaml")
    assert config.num_parameters() == PUBLISHED_PARAMETERS[name]
    assert config.compute_dtype == "bfloat16" and config.qkv_has_bias


def test_tiny_config_fits_the_bundled_tokenizer():
    config = Qwen2Config.from_yaml(MODEL_CONFIGS / "tiny" / "model.yaml")
    vocab = yaml.safe_load((MODEL_CONFIGS / "tiny" / "tokenizer" / "vocab.json").read_text())
    assert config.vocab_size >= len(vocab) + 3 and config.vocab_size % 4 == 0
    assert config.compute_dtype == "float32"


def test_yaml_round_trip(tmp_path):
    config = Qwen2Config.from_yaml(MODEL_CONFIGS / "qwen2_5" / "qwen2_5_7b.yaml")
    config.to_yaml(tmp_path / "out.yaml")
    assert Qwen2Config.from_yaml(tmp_path / "out.yaml") == config


def write_tiny(tmp_path, **changes):
    data = yaml.safe_load((MODEL_CONFIGS / "tiny" / "model.yaml").read_text())
    for key, value in changes.items():
        section, field = key.split(".")
        node = data["parallel_config"] if section == "parallel" else data["model"]["model_config"]
        if value is None:
            node.pop(field)
        else:
            node[field] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("changes,message", [
    ({"model.num_layer": 2}, r"unknown field\(s\) 'num_layer' \(did you mean 'num_layers'\?\)"),
    ({"model.hidden_size": "64"}, r"field 'hidden_size' must be an integer, got str '64'"),
    ({"model.num_heads": 3}, r"num_heads=3 is not a multiple of n_kv_heads=2"),
    ({"model.compute_dtype": "fp32"}, r"compute_dtype='fp32'; expected one of float32, float16, bfloat16"),
    ({"model.vocab_size": None}, r"missing required field\(s\) vocab_size"),
    ({"model.seq_length": 4096}, r"seq_length=4096 exceeds max_position_embedding=512"),
    ({"model.qkv_has_bias": "yes"}, r"field 'qkv_has_bias' must be true/false"),
    ({"parallel.pipeline_stage": 3}, r"model_config.num_layers=2 is not divisible by parallel_config.pipeline_stage=3"),
    ({"parallel.micro_batch_num": 0}, r"parallel_config.micro_batch_num must be >= 1, got 0"),
    ({"parallel.model_paralel": 2}, r"did you mean 'model_parallel'"),
])
def test_bad_fields_are_named(tmp_path, changes, message):
    path = write_tiny(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message) as err:
        Qwen2Config.from_yaml(path)
    assert str(path) in str(err.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        Qwen2Config.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Qwen2Config.from_yaml(bad)
    bad.write_text("model:\n  arch: {}\n")
    with pytest.raises(ConfigError, match="missing section 'model.model_config'"):
        Qwen2Config.from_yaml(bad)


def test_the_architecture_is_read_and_checked(tmp_path):
    assert Qwen2Config.from_yaml(MODEL_CONFIGS / "arith" / "critic.yaml").arch == "Qwen2ForValue"
    assert Qwen2Config.from_yaml(MODEL_CONFIGS / "tiny" / "model.yaml").arch == "Qwen2ForCausalLM"
    data = yaml.safe_load((MODEL_CONFIGS / "tiny" / "model.yaml").read_text())
    path = tmp_path / "arch.yaml"
    for arch, expected in (("LlamaForCausalLM", "Qwen2ForCausalLM"), ("Qwen2ForValue", "Qwen2ForValue")):
        data["model"]["arch"] = {"type": arch}
        path.write_text(yaml.safe_dump(data))
        config = Qwen2Config.from_yaml(path)
        assert config.arch == expected
        config.to_yaml(tmp_path / "out.yaml")
        assert Qwen2Config.from_yaml(tmp_path / "out.yaml") == config
    del data["model"]["arch"]
    path.write_text(yaml.safe_dump(data))
    assert Qwen2Config.from_yaml(path).arch == "Qwen2ForCausalLM"
    data["model"]["arch"] = {"type": "Qwen2ForRewardModel"}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        Qwen2Config.from_yaml(path)
    assert str(err.value) == (f"{path}: model.arch.type='Qwen2ForRewardModel' is not a known architecture; expected "
                              "one of Qwen2ForCausalLM, LlamaForCausalLM, Qwen2ForValue")
    del data["model"]["arch"]
    data["model"]["model_config"]["arch"] = "Qwen2ForValue"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"unknown field 'arch' in model.model_config; the architecture is "
                                          r"model.arch.type"):
        Qwen2Config.from_yaml(path)


def test_mindformers_only_keys_are_accepted(tmp_path):
    path = write_tiny(tmp_path, **{"model.use_past": True, "model.use_flash_attention": False})
    assert Qwen2Config.from_yaml(path).num_layers == 2


def test_layout_arithmetic_and_errors():
    layout = Layout(dp=2, tp=2, rank=3)
    assert layout.coords() == (1, 1)
    assert layout.tp_group_ranks() == [2, 3] and layout.dp_group_ranks() == [1, 3]
    assert layout.dev_matrix == [2, 2]
    assert Layout(dp=2, tp=2, rank=1).tp_group == "mindrlhf_0_1"
    with pytest.raises(LayoutError, match="= 4 ranks, but the job has 2"):
        Layout.for_world(2, 2, 2, 0)
    with pytest.raises(LayoutError, match="rank 4 is outside"):
        Layout(dp=2, tp=2, rank=4)


def test_tensor_parallel_size_must_divide_heads():
    import mindspore as ms  # noqa: F401  (network construction needs MindSpore)

    from mindrlhf.models.qwen2 import Qwen2ForCausalLM
    config = Qwen2Config.from_yaml(MODEL_CONFIGS / "tiny" / "model.yaml")  # 4 heads, 2 kv heads
    with pytest.raises(LayoutError, match="num_heads=4 is not divisible by the tensor-parallel size 8"):
        Qwen2ForCausalLM(config, Layout(dp=1, tp=8, rank=0))
    odd = dataclasses.replace(config, num_heads=6, n_kv_heads=3, hidden_size=96)
    with pytest.raises(LayoutError, match="n_kv_heads=3 and the tensor-parallel size 2: one must divide the other"):
        Qwen2ForCausalLM(odd, Layout(dp=1, tp=2, rank=0))
    # tp above the kv heads: rank 3 holds its 1 query head and the kv head it uses (the second), shared with rank 2
    attention = Qwen2ForCausalLM(config, Layout(dp=1, tp=4, rank=3)).model.layers[0].attention
    head_dim = config.hidden_size // config.num_heads
    assert attention.wq.weight.shape == attention.wk.weight.shape == (head_dim, config.hidden_size)
    assert attention.kv_heads_local == attention.kv_repeat == 1 and attention.wk.split_shards == {"weight": 2,
                                                                                                   "bias": 2}


def qwen2_5_7b_layouts_on_8_devices(train_name: str):
    """(train config, its layout on each of 8 ranks) of `qwen2_5_7b_<train_name>.yaml`, checked against the 7B
    inference YAML (dp 2 x tp 4) it is paired with on the same 8 devices."""
    from mindrlhf.trainer.plan import check_model_configs

    train_path, infer_path = (MODEL_CONFIGS / "qwen2_5" / f"qwen2_5_7b_{n}.yaml" for n in (train_name, "infer_dp2"))
    train, infer = Qwen2Config.from_yaml(train_path), Qwen2Config.from_yaml(infer_path)
    check_model_configs(train, infer, str(train_path), str(infer_path))
    assert str(Layout.from_config(infer.parallel_config, 8, 7)) == "dp=2 x tp=4"
    return train, [Layout.from_config(train.parallel_config, 8, rank) for rank in range(8)]


def test_the_seed_recipes_7b_pipeline_layout_covers_8_devices():
    """Train in 2 stages x tp 4, infer dp 2 x tp 4 on the same 8 devices (model_configs/qwen2_5)."""
    from mindrlhf.models.qwen2.modeling import stage_layers

    train, layouts = qwen2_5_7b_layouts_on_8_devices("train_pp2")
    assert [lay.stage for lay in layouts] == [0, 0, 0, 0, 1, 1, 1, 1] and layouts[5].tp_rank == 1
    assert layouts[5].pp_group_ranks() == [1, 5] and train.parallel_config.micro_batch_num == 2
    assert stage_layers(train.num_layers, 2, 1) == range(14, 28)
    with pytest.raises(LayoutError, match=r"x pipeline_stage=2 = 8 ranks, but the job has 4"):
        Layout.from_config(train.parallel_config, 4, 0)


def test_mindspeed_rls_7b_actor_layout_tp2_pp4_covers_8_devices():
    """Train in 4 stages x tp 2 (7 layers a stage), infer dp 2 x tp 4 on the same 8 devices."""
    from mindrlhf.models.qwen2.modeling import stage_layers

    train, layouts = qwen2_5_7b_layouts_on_8_devices("train_pp4")
    assert [lay.stage for lay in layouts] == [0, 0, 1, 1, 2, 2, 3, 3] and layouts[5].tp_rank == 1
    assert layouts[5].pp_group_ranks() == [1, 3, 5, 7] and layouts[5].end_stage_ranks() == [1, 7]
    assert layouts[4].next_stage_pair(1) == [2, 4] and layouts[4].next_stage_pair(2) == [4, 6]
    assert stage_layers(train.num_layers, 4, 2) == range(14, 21) and train.parallel_config.micro_batch_num == 4


def test_mindrlhfs_qwen_grpo_yamls_load_quietly_with_the_7b_shape_and_tutorial_layouts(caplog):
    """model_configs/qwen_grpo: MindRLHF's file names, layout and key names (max_position_embeddings, rotary_emb_base,
    kv_channels, rotary_pct...), read as the trainer reads them: the same network, train pp2 x tp4 and infer dp2 x tp4
    over the same 8 devices, and not one warning."""
    import logging

    from mindrlhf.configs import foreign_keys
    from mindrlhf.models.qwen2.modeling import stage_layers
    from mindrlhf.trainer.plan import check_model_configs

    foreign_keys.warn_once.cache_clear()
    train_path, infer_path = (MODEL_CONFIGS / "qwen_grpo" / name for name in ("finetune_qwen2_5_7b.yaml",
                                                                         "predict_qwen2_5_7b_instruct.yaml"))
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        train, infer = Qwen2Config.from_yaml(train_path), Qwen2Config.from_yaml(infer_path)
    assert caplog.text == ""
    check_model_configs(train, infer, str(train_path), str(infer_path))
    for cfg in (train, infer):
        assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.n_kv_heads,
                cfg.intermediate_size) == (152064, 3584, 28, 28, 4, 18944)
        assert cfg.theta == 1e6 and cfg.qkv_has_bias and not cfg.tie_word_embeddings and cfg.get_head_dim() == 128
        assert cfg.max_position_embedding == 32768 and cfg.eos_token_id == 151645 and cfg.seq_length == 8192
        assert cfg.compute_dtype == "bfloat16" and not cfg.use_flash_attention
        assert cfg.num_parameters() == PUBLISHED_PARAMETERS["qwen2_5_7b"]
    assert (train.parallel_config.micro_batch_num, train.parallel_config.use_seq_parallel) == (4, True)
    assert train.recompute.recompute is True
    train_layouts = [Layout.from_config(train.parallel_config, 8, rank) for rank in range(8)]
    infer_layouts = [Layout.from_config(infer.parallel_config, 8, rank) for rank in range(8)]
    assert str(train_layouts[0]) == "dp=1 x tp=4 x pp=2" and str(infer_layouts[7]) == "dp=2 x tp=4"
    assert [lay.stage for lay in train_layouts] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [lay.dp_rank for lay in infer_layouts] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert stage_layers(train.num_layers, 2, 1) == range(14, 28)


def test_train_and_infer_yamls_may_differ_in_what_does_not_change_the_network(tmp_path):
    """MindRLHF's finetune YAML says max_position_embeddings 131072 and eos 151643, its predict YAML 32768 and
    151645: the same network. A layer more is another network."""
    from mindrlhf.configs.base import ConfigError
    from mindrlhf.trainer.plan import check_model_configs

    source = (MODEL_CONFIGS / "qwen_grpo" / "finetune_qwen2_5_7b.yaml").read_text()
    assert "max_position_embedding: 32768" in source and "eos_token_id: 151645" in source
    finetune = tmp_path / "finetune.yaml"
    finetune.write_text(source.replace("max_position_embedding: 32768", "max_position_embeddings: 131072")
                        .replace("eos_token_id: 151645", "eos_token_id: 151643"))
    predict = MODEL_CONFIGS / "qwen_grpo" / "predict_qwen2_5_7b_instruct.yaml"
    train, infer = Qwen2Config.from_yaml(finetune), Qwen2Config.from_yaml(predict)
    assert (train.max_position_embedding, train.eos_token_id) == (131072, 151643)
    check_model_configs(train, infer, str(finetune), str(predict))
    deeper = tmp_path / "deeper.yaml"
    deeper.write_text(source.replace("num_layers: 28", "num_layers: 30"))
    with pytest.raises(ConfigError, match=r"describe different models \(num_layers: 30 vs 28\)"):
        check_model_configs(Qwen2Config.from_yaml(deeper), infer, str(deeper), str(predict))


@pytest.mark.parametrize("model, ranks, tp_sizes",
                         [("arith", 2, None), ("smollm2", 1, [1, 3]), ("qwen2_5_0_5b", 2, [1, 2])])
def test_the_run_grpo_models_describe_one_network_and_allow_their_tensor_parallel_sizes(model, ranks, tp_sizes):
    """model_configs/<MODEL> (run_grpo.sh's MODEL): train and infer YAMLs describe the same network on the same
    ranks (run_grpo.sh's default for the model: tests/examples/test_run_grpo_script.py); the tensor-parallel sizes
    each real model allows (what their YAML comments and the README say)."""
    from mindrlhf.configs.grpo_configs import GRPOConfig
    from mindrlhf.parallel.layout import tensor_parallel_sizes
    from mindrlhf.trainer.plan import check_model_configs

    paths = [MODEL_CONFIGS / model / f"{net}.yaml" for net in ("train", "infer")]
    train, infer = (Qwen2Config.from_yaml(path) for path in paths)
    check_model_configs(train, infer, *map(str, paths))
    for cfg in (train, infer):  # each covers the job's ranks (else LayoutError)
        assert [Layout.from_config(cfg.parallel_config, ranks, rank).rank for rank in range(ranks)] == \
            list(range(ranks))
    GRPOConfig.from_yaml(MODEL_CONFIGS / model / "grpo.yaml").validate()
    for stage in ("sft", "reward", "dpo"):  # the stages' YAMLs of this model (ALGORITHM=<stage>), where it has them
        path = MODEL_CONFIGS / model / f"{stage}.yaml"
        if path.exists():
            stage_config = GRPOConfig.from_yaml(path)
            stage_config.validate()
            assert stage_config.sft.max_length <= train.seq_length, path  # a packed row fits the rotary tables
    if tp_sizes is not None:
        assert tensor_parallel_sizes(train.num_heads, train.n_kv_heads, train.vocab_size,
                                     train.intermediate_size, largest=16) == tp_sizes
        assert f"model_parallel: {tp_sizes[-1]}" in paths[0].read_text()  # the YAML comment names it
        readme_row = next(line for line in README.read_text().splitlines()
                          if line.startswith(f"| `{model}`"))
        assert f"| {', '.join(map(str, tp_sizes))} |" in readme_row, readme_row


def test_tensor_parallel_sizes_follow_heads_vocabulary_and_mlp_width():
    from mindrlhf.parallel.layout import tensor_parallel_sizes

    # Qwen2.5-7B: 28 heads, 4 kv heads, vocab 152064, MLP 18944
    assert tensor_parallel_sizes(28, 4, 152064, 18944, largest=32) == [1, 2, 4]  # 7 and 28 split no vocabulary
    assert tensor_parallel_sizes(12, 2, 151936, 8960, largest=16) == [1, 2, 4]  # Qwen2.5-1.5B: tp 4 > 2 kv heads
    assert tensor_parallel_sizes(6, 4, 64, 64, largest=8) == [1, 2]  # 6 heads: 3 is no divisor of the 4 kv heads
