"""MindSpeed-RL's GRPO trainer YAML given to --config as it is (`mindrlhf.configs.mindspeed`): each key mapped onto a
field, accepted, ignored (a short warning line a reason, naming its keys) or refused with the file,
`section.key=value` and what to set instead; a key one edit away from a known one is refused as a typo with a
did-you-mean; docs/yaml_keys.md lists every key."""
import logging
import re

import pytest
import yaml
from support.paths import DOCS, MODEL_CONFIGS

from mindrlhf.configs import foreign_keys
from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.grpo_configs import GRPOConfig
from mindrlhf.configs.mindspeed import UNKNOWN_KEY, VERIFIERS, known_keys

SAMPLE = MODEL_CONFIGS / "mindspeed" / "grpo_trainer_qwen25_7b.yaml"


@pytest.fixture(autouse=True)
def said_again():
    """Each test sees its warning lines (a line is logged once per process)."""
    foreign_keys.warn_once.cache_clear()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mindrlhf.config"]


def _sample() -> dict:
    return yaml.safe_load(SAMPLE.read_text())


def _write(tmp_path, data: dict, name: str = "grpo_trainer.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _edited(tmp_path, section: str, **values) -> str:
    """The sample with `values` set in `section` ('generate_config.sampling_config' for the sampling keys)."""
    data = _sample()
    node = data
    for part in section.split("."):
        node = node[part]
    node.update(values)
    return _write(tmp_path, data)


def test_the_sample_maps_onto_the_fields(caplog):
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        config = GRPOConfig.from_yaml(str(SAMPLE))
    config.validate()
    gen, loss, sched, opt, algo = config.generation, config.loss, config.schedule, config.optimizer, config.algorithm
    assert gen.num_generations == 8 and sched.batch_size == 32
    assert sched.mini_batch_size == 0 and sched.prompts_per_update == 32  # 32 prompts = the whole batch
    assert sched.micro_batch_size_per_device == 4 and sched.log_prob_micro_batch_size_per_device == 4
    assert sched.steps == 500 and sched.num_iterations == 1 and sched.seed == 1 and gen.seed == 1
    assert loss.epsilon_low == loss.epsilon_high == 0.2
    assert loss.beta == 0.001 and loss.kl_estimator == "k3" and loss.aggregation == "token-mean"
    assert algo.adv_estimator == "grpo" and algo.advantage_eps == 1e-6 and algo.lam == 0.95
    assert config.reward.reward_funcs == ["accuracy", "format"] and config.reward.reward_weights == [1.0, 1.0]
    assert gen.max_new_tokens == 2048 and gen.temperature == 1.0 and gen.top_p == 1.0
    assert gen.top_k == 0  # vLLM's -1 (off)
    assert gen.max_num_seqs == 1024  # decode slots of an inference rank
    assert gen.max_num_batched_tokens == 8192 and gen.max_model_len == 4096  # prefill budget, context limit
    assert gen.prompt_buckets == [64, 128, 256, 512, 1024, 2048]  # max_prompt_length 2048
    assert opt.learning_rate == 1e-6 and opt.lr_schedule == "constant" and opt.warmup_steps == 0
    assert opt.weight_decay == 0.01 and opt.max_grad_norm == 1.0 and opt.beta2 == 0.95
    assert config.checkpoint.save_interval == 100
    assert config.source_of("loss", "beta") == str(SAMPLE)
    assert all(line.startswith(f"{SAMPLE}: ") for line in _warnings(caplog))


def test_the_sample_says_what_it_ignores_in_a_short_line_a_reason(caplog):
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        GRPOConfig.from_yaml(str(SAMPLE))
        GRPOConfig.from_yaml(str(SAMPLE))  # read twice, said once
    lines = _warnings(caplog)
    assert len(lines) == len(set(lines)) == 17  # 3 keys read approximately, 14 reasons keys are ignored for
    assert lines[0] == f"{SAMPLE}: rl_config.verifier_function[0]='acc' is read as reward 'accuracy': " \
                       f"{VERIFIERS['acc'][1]}"
    assert all(line.startswith(f"{SAMPLE}: ") and " | " not in line and len(line) < 300 + len(str(SAMPLE))
               for line in lines)
    text = "\n".join(lines)
    for said in ("rl_config.verifier_function[1]='strict_format' is read as reward 'format'",
                 "rl_config.max_prompt_length=2048 is read as generation.prompt_buckets [64, 128, 256, 512, 1024, "
                 "2048]", "mindrlhf-prepare-data --max_prompt_length 2048",
                 "defaults=[{'model': ['qwen25_7b']}], actor_config.model='qwen25_7b' have no effect here: the "
                 "networks are the model YAMLs",
                 "megatron_training.tokenizer_name_or_path='./Qwen2.5-7B' has no effect here: pass the same Hugging "
                 "Face folder as --tokenizer_dir",
                 "megatron_training.data_path='./dataset/deepscaler/data' has no effect here: prompts come from "
                 "--mind_dataset_dir",
                 "actor_config.tensor_model_parallel_size=2 has no effect here: the train layout is the train model "
                 "YAML's (--sft_path_train): set parallel_config.model_parallel there",
                 "actor_config.pipeline_model_parallel_size=2 has no effect here",
                 "actor_config.load='./ckpt' has no effect here: pass the starting policy as "
                 "--load_sft_checkpoint_train",
                 "actor_config.save='./ckpt' has no effect here: checkpoints are written to --save_ckpt_dir",
                 "rl_config.use_tensorboard=True has no effect here: pass --tensorboard_dir",
                 "generate_config.gpu_memory_utilization=0.4 has no effect here: vLLM engine settings: mindrlhf's "
                 "generator decodes at most generation.max_num_seqs rows of an inference rank at once"):
        assert said in text, said
    # values that mean what is done here pass without a word
    for quiet in ("generate_config.max_num_seqs", "max_num_batched_tokens", "max_model_len",
                  "infer_tensor_parallel_size", "offload_train", "use_flash_attn",
                  "min_p", "no_load_optim", "attention_softmax_in_fp32", "ref_forward_micro_batch_size", "kl_ctrl_type",
                  "split"):
        assert quiet not in text, quiet


def test_sampling_configs_min_p_is_the_generations(tmp_path):
    assert GRPOConfig.from_yaml(_edited(tmp_path, "generate_config.sampling_config", min_p=0.1)).generation.min_p == 0.1


def test_mini_batch_size_counts_prompts_and_must_divide_the_batch(tmp_path):
    config = GRPOConfig.from_yaml(_edited(tmp_path, "rl_config", mini_batch_size=8))
    assert config.schedule.mini_batch_size == 8 and config.schedule.batch_size == 32  # 4 updates per step
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path))}/grpo_trainer.yaml: "
                                          r"rl_config.mini_batch_size=12 must be >= 1 and divide "
                                          r"megatron_training.global_batch_size=32: MindSpeed-RL counts it in prompts "
                                          r".*set a divisor of global_batch_size \(32 = the whole batch"):
        GRPOConfig.from_yaml(_edited(tmp_path, "rl_config", mini_batch_size=12))
    # a value in responses, as YAMLs counted before May 2025: the message says what it meant
    with pytest.raises(ConfigError, match=r"rl_config.mini_batch_size=64 must be >= 1 and divide .*64 responses are "
                                          r"mini_batch_size: 8$"):
        GRPOConfig.from_yaml(_edited(tmp_path, "rl_config", mini_batch_size=64))


@pytest.mark.parametrize("section,key,value,advice", [
    ("rl_config", "entropy_coeff", 0.001, "mindrlhf's loss has no entropy term; set entropy_coeff: 0"),
    ("rl_config", "adv_estimator", "gae", "MindSpeed-RL's GAE is its PPO trainer's; here write a mindrlhf config "
                                          "with algorithm.adv_estimator: gae"),
    ("rl_config", "kl_penalty", "abs", "the KL estimators here are k1 (kl), k2 (mse) and k3 (low_var_kl)"),
    ("rl_config", "rule_reward", False, "MindSpeed-RL then scores with its reward model only; here: "
                                        "reward.reward_model_path"),
    ("megatron_training", "stage", "ray_ppo", "this reads MindSpeed-RL's GRPO trainer YAML (stage: ray_grpo)"),
    ("actor_config", "lr_decay_style", "linear", "the learning rate here is constant or cosine "
                                                 "(optimizer.lr_schedule); set lr_decay_style: constant or cosine"),
    ("generate_config", "infer_expert_parallel_size", 2, "no mixture-of-experts model is built here; set 1"),
    ("rl_config", "tool_config_path", "./configs/tools/retool_config.yaml",
     "tools here are Python functions (TRL's form): list them as tools.tools in a mindrlhf YAML given after this one"),
    ("rl_config", "tool_parser_format", "qwen3_coder", "tool calls are read in the Hermes format here"),
])
def test_a_refusal_names_the_file_the_key_and_what_to_set(tmp_path, section, key, value, advice):
    path = _edited(tmp_path, section, **{key: value})
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: {re.escape(section)}.{key}={re.escape(repr(value))} "
                                          rf"is not supported: {re.escape(advice)}"):
        GRPOConfig.from_yaml(path)


def test_the_multi_turn_keys_map_and_the_tools_come_from_a_mindrlhf_yaml(tmp_path):
    """MindSpeed-RL's ReTool keys: the bounds map, the tools are a mindrlhf YAML's (a job with tool turns but no
    tool is refused in one line)."""
    data = _sample()
    data["rl_config"].update(multi_turn_enable=True, max_tool_calls=2, max_tool_response_length=128,
                             max_parallel_calls=1, tool_parser_format="hermes", tool_response_truncate_side="middle")
    data["generate_config"]["max_model_len"] = 4352  # the 2048 + 2048 of the sample, and the two tool turns
    path = _write(tmp_path, data)
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  tools: [python]\n")
    config = GRPOConfig.from_yaml(path, str(tools))
    assert (config.generation.max_tool_calling_iterations, config.generation.max_tool_response_tokens) == (2, 128)
    assert config.tools.tools == ["python"]
    config.validate()
    with pytest.raises(ConfigError, match="max_tool_calling_iterations=2 but tools.tools lists no tool"):
        GRPOConfig.from_yaml(path).validate()


@pytest.mark.parametrize("name", ["math_verify_reward", "step", "retool_reward", "my_acc"])
def test_an_unknown_verifier_is_refused_with_the_known_ones(tmp_path, name):
    """MindSpeed-RL skips a verifier name it does not know (the job trains without that reward); here it is
    refused, the accepted names listed."""
    path = _edited(tmp_path, "rl_config", verifier_function=["base_acc", name], verifier_weight=[1, 1])
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: rl_config.verifier_function\[1\]="
                                          rf"'{name}' is not supported: the MindSpeed-RL verifiers read "
                                          r"here are base_acc, acc, math_17k_acc, acc_for_ppo, acc_for_dapo, format, "
                                          r"strict_format; for another rule give a function 'package.module:function'"):
        GRPOConfig.from_yaml(path)


def test_the_weights_count_the_verifiers(tmp_path):
    with pytest.raises(ConfigError, match=r"rl_config.verifier_weight=\[1.0\] has 1 weight\(s\) for the 2 verifier "
                                          r"function\(s\) \['acc', 'strict_format'\]: give one weight per function"):
        GRPOConfig.from_yaml(_edited(tmp_path, "rl_config", verifier_weight=[1.0]))


def test_verifiers_map_onto_the_rule_rewards(tmp_path, caplog):
    path = _edited(tmp_path, "rl_config", verifier_function=["base_acc", "format", "math_17k_acc", "acc_for_ppo",
                                                             "acc_for_dapo"], verifier_weight=[1.0, 0.5, 2, 1, 1])
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        config = GRPOConfig.from_yaml(path)
    assert config.reward.reward_funcs == ["accuracy", "format", "accuracy", "accuracy", "accuracy"]
    assert config.reward.reward_weights == [1.0, 0.5, 2.0, 1.0, 1.0]
    lines = _warnings(caplog)
    for index, name in ((0, "base_acc"), (2, "math_17k_acc"), (3, "acc_for_ppo"), (4, "acc_for_dapo")):
        assert f"{path}: rl_config.verifier_function[{index}]='{name}' is read as reward 'accuracy': " \
               f"{VERIFIERS[name][1]}" in lines, name
    assert not any("verifier_function[1]" in line for line in lines)  # MindSpeed-RL's format: the same template


def test_a_verifier_name_one_edit_from_a_known_one_is_taken_for_a_typo(tmp_path):
    path = _edited(tmp_path, "rl_config", verifier_function=["acc", "strict_fromat"])
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: rl_config.verifier_function\[1\]: unknown "
                                          r"verifier 'strict_fromat' \(did you mean 'strict_format'\?\)$"):
        GRPOConfig.from_yaml(path)


def test_learning_rate_schedule_and_warmup(tmp_path):
    path = _edited(tmp_path, "actor_config", lr="2e-6", lr_decay_style="cosine", min_lr=2e-7, lr_warmup_fraction=0.1)
    config = GRPOConfig.from_yaml(path)
    assert config.optimizer.learning_rate == 2e-6 and config.optimizer.lr_schedule == "cosine"
    assert config.optimizer.min_lr_ratio == pytest.approx(0.1)
    assert config.optimizer.warmup_steps == 50  # 10% of 500 steps, one update per step
    data = _sample()
    data["actor_config"].update(lr_warmup_fraction=0.1)
    data["rl_config"].update(mini_batch_size=8)  # 4 updates per step: Megatron counts warmup in samples
    assert GRPOConfig.from_yaml(_write(tmp_path, data)).optimizer.warmup_steps == 200
    del data["megatron_training"]["train_iters"]
    with pytest.raises(ConfigError, match=r"actor_config.lr_warmup_fraction=0.1 is a fraction of the run, which needs "
                                          r"megatron_training.train_iters and global_batch_size"):
        GRPOConfig.from_yaml(_write(tmp_path, data))
    data = _sample()
    del data["actor_config"]["lr_decay_style"]  # MindSpeed-RL's default: linear decay
    with pytest.raises(ConfigError, match=r"actor_config.lr is given without lr_decay_style, whose MindSpeed-RL "
                                          r"default is Megatron's linear decay"):
        GRPOConfig.from_yaml(_write(tmp_path, data))


def test_actor_config_wins_over_megatron_training_and_unknown_keys_are_named(tmp_path, caplog):
    data = _sample()
    data["megatron_training"].update({"lr": 5e-6, "recompute-granularity": "full", "my_knob": 3})
    data["rl_config"]["my_rl_knob"] = True
    data["profiler_config"] = {"enable": False}
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        config = GRPOConfig.from_yaml(_write(tmp_path, data))
    assert config.optimizer.learning_rate == 1e-6  # actor_config.lr
    path, lines = _write(tmp_path, data), _warnings(caplog)
    assert f"{path}: megatron_training.lr=5e-06 has no effect here: actor_config gives it too, and wins (as in " \
           "MindSpeed-RL)" in lines
    assert any(line.startswith(f"{path}: megatron_training.recompute-granularity='full' has no effect here: recompute "
                               "is set in the train model YAML") for line in lines)
    # unknown keys far from every known one: a line of their own, not lost among the ignored keys
    assert f"{path}: megatron_training.my_knob=3, rl_config.my_rl_knob=True have no effect here: {UNKNOWN_KEY}" in lines
    assert f"{path}: 'profiler_config' has no effect here: not a section of MindSpeed-RL's GRPO trainer YAML" in lines


def test_a_key_one_edit_from_a_known_one_is_taken_for_a_typo(tmp_path, caplog):
    """The issue's case: `n_samples_per_promt: 4` read as an unknown key would train with the default group size;
    it is refused, with the key it is one edit away from (a letter left out, added, replaced or two swapped)."""
    data = _sample()
    data["rl_config"]["n_samples_per_promt"] = data["rl_config"].pop("n_samples_per_prompt") // 2
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: rl_config.n_samples_per_promt: unknown key \(did you "
                                          r"mean 'n_samples_per_prompt'\?\)$"):
        GRPOConfig.from_yaml(path)
    for section, key, meant in (("megatron_training", "global_bacth_size", "global_batch_size"),
                                ("actor_config", "lr-decay-styles", "lr_decay_style"),
                                ("rl_config", "init_kl_coeff", "init_kl_coef"),
                                ("rl_config", "verifier_weigth", "verifier_weight"),
                                ("generate_config", "max_num_seq", "max_num_seqs"),
                                ("generate_config", "sampling_confg", "sampling_config"),
                                ("generate_config.sampling_config", "temperatur", "temperature"),
                                ("ref_config", "micro_batch_sise", "micro_batch_size")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: {re.escape(section)}.{key}: unknown key "
                                              rf"\(did you mean '{meant}'\?\)$"):
            GRPOConfig.from_yaml(_edited(tmp_path, section, **{key: 1}) if section != "ref_config" else
                                 _write(tmp_path, {**_sample(), "ref_config": {key: 1}}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: generate_confg: unknown key \(did you mean "
                                          r"'generate_config'\?\)$"):
        GRPOConfig.from_yaml(_write(tmp_path, {**_sample(), "generate_confg": {}}))
    # two edits away: an unknown key, warned about in its own line
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        GRPOConfig.from_yaml(_edited(tmp_path, "rl_config", n_samples_per_pmt=4))
    assert f"{path}: rl_config.n_samples_per_pmt=4 has no effect here: {UNKNOWN_KEY}" in _warnings(caplog)


def test_log_prob_micro_batches_and_kl_settings(tmp_path, caplog):
    data = _sample()
    data["rl_config"].update(actor_forward_micro_batch_size=8, ref_forward_micro_batch_size=2, kl_penalty="kl",
                             kl_ctrl_type="adaptive", init_kl_coef=0.05)
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        config = GRPOConfig.from_yaml(_write(tmp_path, data))
    assert config.schedule.log_prob_micro_batch_size_per_device == 2
    assert config.loss.kl_estimator == "k1" and config.loss.beta == 0.05
    assert config.algorithm.use_kl_in_reward is False  # MindSpeed-RL's GRPO trainer keeps the KL in the loss
    text = "\n".join(_warnings(caplog))
    assert "rl_config.actor_forward_micro_batch_size=8, rl_config.ref_forward_micro_batch_size=2 is read as " \
           "schedule.log_prob_micro_batch_size_per_device=2" in text
    assert "rl_config.kl_ctrl_type='adaptive' has no effect here: MindSpeed-RL's GRPO trainer never updates the KL " \
           "controller" in text


def test_ref_config_gives_the_reference_pass_and_its_weights(tmp_path, caplog):
    data = _sample()
    del data["rl_config"]["ref_forward_micro_batch_size"]
    data["ref_config"] = {"model": "qwen25_7b", "micro_batch_size": 2, "tensor_model_parallel_size": 1,
                          "load": "./ckpt", "no_load_optim": True}
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        config = GRPOConfig.from_yaml(_write(tmp_path, data))
    assert config.schedule.log_prob_micro_batch_size_per_device == 2  # the smaller of the actor's 4 and the ref's 2
    assert "ref_config.load" not in "\n".join(_warnings(caplog))  # the actor's checkpoint: the default here
    data["ref_config"]["load"] = "./ref_ckpt"
    foreign_keys.warn_once.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        GRPOConfig.from_yaml(_write(tmp_path, data))
    assert "ref_config.load='./ref_ckpt' has no effect here: pass the reference weights as --load_ref_checkpoint" \
        in "\n".join(_warnings(caplog))


def test_a_mindrlhf_yaml_is_read_as_before(tmp_path, caplog):
    path = tmp_path / "grpo.yaml"
    path.write_text("generation:\n  num_generations: 4\n  top_k: 5\nloss:\n  beta: 0.02\n"
                    "schedule:\n  batch_size: 16\n  mini_batch_size: 4\n")
    with caplog.at_level(logging.WARNING, "mindrlhf.config"):
        config = GRPOConfig.from_yaml(str(path))
    assert _warnings(caplog) == []
    assert config.generation.num_generations == 4 and config.generation.top_k == 5 and config.loss.beta == 0.02
    assert config.schedule.mini_batch_size == 4 and config.loss.aggregation == "seq-mean-token-mean"
    assert config.algorithm.advantage_eps == 1e-4 and config.reward.reward_funcs == ["accuracy", "format"]
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['rl_confg'\]"):
        GRPOConfig.from_yaml(_write(tmp_path, {"rl_confg": {"clip_ratio": 0.2}}, "typo.yaml"))


def test_mindspeed_and_mindrlhf_yamls_merge_later_winning(tmp_path):
    overrides = tmp_path / "overrides.yaml"
    overrides.write_text("generation:\n  num_generations: 4\nloss:\n  epsilon_high: 0.28\n"
                         "schedule:\n  batch_size: 8\n")
    config = GRPOConfig.from_yaml(str(SAMPLE), str(overrides))
    assert config.generation.num_generations == 4 and config.schedule.batch_size == 8  # the later file's
    assert config.loss.epsilon_high == 0.28 and config.loss.epsilon_low == 0.2  # clip_ratio, then the override
    assert config.generation.max_new_tokens == 2048 and config.schedule.mini_batch_size == 0  # the sample's
    assert config.source_of("generation", "num_generations") == str(overrides)
    assert config.source_of("generation", "max_new_tokens") == str(SAMPLE)
    config = GRPOConfig.from_yaml(str(overrides), str(SAMPLE))
    assert config.generation.num_generations == 8 and config.schedule.batch_size == 32  # the sample's now
    assert config.loss.epsilon_high == 0.2


def test_one_file_with_both_layouts_is_refused(tmp_path):
    data = _sample()
    data["loss"] = {"beta": 0.0}
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: MindSpeed-RL sections and mindrlhf sections "
                                          r"\['loss'\] in one file"):
        GRPOConfig.from_yaml(path)


def test_a_bad_value_is_named_by_its_mindspeed_key(tmp_path):
    with pytest.raises(ConfigError, match=r"grpo_trainer.yaml: rl_config.n_samples_per_prompt='eight' must be an "
                                          r"integer$"):
        GRPOConfig.from_yaml(_edited(tmp_path, "rl_config", n_samples_per_prompt="eight"))


def test_the_key_table_lists_every_key():
    text = (DOCS / "yaml_keys.md").read_text()
    section = text[text.index("## MindSpeed-RL's GRPO trainer YAML"):]
    missing = [f"{where}: {key}" for where, keys in known_keys().items() for key in keys
               if f"`{key}`" not in section and not re.search(rf"`[\w.]+\.{key}`", section)]
    assert not missing, missing


def test_mindspeed_llms_lora_keys_map_megatrons_module_names_onto_hugging_faces(tmp_path):
    """lora_r, lora_alpha and lora_target_modules (Megatron's fused linear_qkv / linear_proj / linear_fc1 /
    linear_fc2, or Hugging Face names) in megatron_training give the lora section."""
    from mindrlhf.configs.lora import LoraConfig

    data = _sample()
    data["megatron_training"].update(lora_r=8, lora_alpha=16, lora_target_modules=["linear_qkv", "linear_fc2"])
    config = GRPOConfig.from_yaml(_write(tmp_path, data))
    assert config.lora == LoraConfig(lora_rank=8, lora_alpha=16.0,
                                     lora_target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])
    data["megatron_training"]["lora_target_modules"] = ["linear_fc1", "o_proj"]
    config = GRPOConfig.from_yaml(_write(tmp_path, data, "other.yaml"))
    assert config.lora.modules() == ("o_proj", "gate_proj", "up_proj")
