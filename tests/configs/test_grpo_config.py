"""GRPOConfig: YAML sections, generated CLI flags, validation messages naming the field."""
import argparse
import dataclasses
import subprocess
import sys

import pytest
from support.msrun import run_command
from support.paths import GRPO_SCRIPT

from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.cli import add_config_flags, config_overrides, section_field_names
from mindrlhf.configs.grpo_configs import SECTIONS, GRPOConfig
from mindrlhf.trainer.plan import check_registered_names


def parse(argv):
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_overrides(parser.parse_args(argv))


def test_every_field_has_help_text_and_a_flag():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for section, names in section_field_names().items():
        for name in names:
            field = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
            assert len(field.metadata.get("help", "")) > 20, f"{section}.{name} has no real help text"
            assert f"--{section}.{name}" in flags
    assert "--num_generations" in flags and "--learning_rate" in flags
    # a name used by two sections: the plain flag sets both, a dotted one sets its own section and wins
    assert {"--seed", "--generation.seed", "--schedule.seed"} <= flags
    assert config_overrides(parser.parse_args(["--seed", "3"])) == {"generation": {"seed": 3}, "schedule": {"seed": 3}}
    assert config_overrides(parser.parse_args(["--seed", "3", "--schedule.seed", "5"])) == {
        "generation": {"seed": 3}, "schedule": {"seed": 5}}


def test_flags_override_yaml_and_are_typed(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("generation:\n  num_generations: 4\noptimizer:\n  learning_rate: 1e-5\n")
    config = GRPOConfig.from_yaml(str(path))
    assert config.generation.num_generations == 4 and config.optimizer.learning_rate == 1e-5
    overrides = parse(["--num_generations", "6", "--reward_funcs", "accuracy", "--reward_weights", "2",
                       "--dynamic_sampling", "true", "--schedule.seed", "7"])
    config = config.replace(overrides)
    assert config.generation.num_generations == 6
    assert config.reward.reward_funcs == ["accuracy"] and config.reward.reward_weights == [2.0]
    assert config.algorithm.dynamic_sampling is True and config.schedule.seed == 7
    assert config.optimizer.learning_rate == 1e-5  # untouched by the flags


def test_fields_at_their_old_place_are_refused_naming_the_section_that_has_them(tmp_path):
    """loss.advantage_estimator, loss.advantage_eps, schedule.dynamic_sampling and schedule.max_sampling_retries
    are algorithm's: at the old place a field is refused in one line naming where it is."""
    path = tmp_path / "grpo.yaml"
    path.write_text("loss:\n  beta: 0.0\nalgorithm:\n  adv_estimator: dr_grpo\n  advantage_eps: 0.01\n"
                    "  dynamic_sampling: true\n  max_sampling_retries: 5\n")
    config = GRPOConfig.from_yaml(str(path))
    assert config.algorithm.adv_estimator == "dr_grpo" and config.algorithm.advantage_eps == 0.01
    assert config.algorithm.dynamic_sampling is True and config.algorithm.max_sampling_retries == 5
    assert config.loss.beta == 0.0
    config = GRPOConfig().replace(parse(["--adv_estimator", "rloo", "--algorithm.dynamic_sampling", "true"]))
    assert config.algorithm.adv_estimator == "rloo" and config.algorithm.dynamic_sampling is True
    assert GRPOConfig().replace(parse(["--adv_estimator", "dr_grpo"])).algorithm.adv_estimator == "dr_grpo"
    for text, error in [
        ("loss:\n  advantage_estimator: rloo\n",
         "loss: unknown field(s) 'advantage_estimator' (did you mean 'algorithm.adv_estimator'?); known fields: "),
        ("loss:\n  advantage_eps: 0.01\n",
         "loss: unknown field(s) 'advantage_eps' (algorithm has a field 'advantage_eps'); known fields: beta, "),
        ("schedule:\n  dynamic_sampling: true\n",
         "schedule: unknown field(s) 'dynamic_sampling' (algorithm has a field 'dynamic_sampling'); known fields: "),
        ("schedule:\n  max_sampling_retries: 5\n",
         "schedule: unknown field(s) 'max_sampling_retries' (algorithm has a field 'max_sampling_retries'); known "),
        # any field in the wrong section, not only the ones that moved; a typo of the section's own field wins
        ("loss:\n  seed: 1\n", "loss: unknown field(s) 'seed' (generation and schedule have a field 'seed'); "),
        ("schedule:\n  num_generation: 4\n",
         "schedule: unknown field(s) 'num_generation' (did you mean 'generation.num_generations'?); "),
        ("schedule:\n  step: 4\n", "schedule: unknown field(s) 'step' (did you mean 'steps'?); "),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            GRPOConfig.from_yaml(str(path))
        assert str(err.value).startswith(f"{path}: {error}") and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^command line: schedule: unknown field\(s\) 'dynamic_sampling' "
                                          r"\(algorithm has a field 'dynamic_sampling'\)"):
        GRPOConfig().replace({"schedule": {"dynamic_sampling": True}})
    with pytest.raises(ConfigError, match="algorithm.adv_estimator: unknown advantage estimator 'ppo'"):
        check_registered_names(GRPOConfig().replace({"algorithm": {"adv_estimator": "ppo"}}))


def test_defaults_follow_the_seed_tutorial():
    config = GRPOConfig()
    config.validate()
    check_registered_names(config)
    opt = config.optimizer
    assert (opt.beta1, opt.beta2, opt.eps, opt.weight_decay) == (0.9, 0.95, 1e-8, 0.01)
    assert config.loss.kl_estimator == "k3" and config.generation.num_generations >= 2


@pytest.mark.parametrize("yaml_text, message", [
    ("generation:\n  num_generationz: 4\n", r"generation: unknown field\(s\) 'num_generationz' \(did you mean "
                                            r"'num_generations'\?\)"),
    ("lossy:\n  beta: 1\n", r"unknown section\(s\) \['lossy'\]"),
    ("optimizer:\n  learning_rate: fast\n", r"optimizer: field 'learning_rate' must be a number"),
    ("optimizer:\n  beta2: 1.5\n", r"optimizer.beta2 must be in \[0, 1\)"),
    ("schedule:\n  steps: 0\n", r"schedule.steps must be >= 1, got 0"),
    ("schedule:\n  batch_size: 4\n  mini_batch_size: 3\n", r"schedule.mini_batch_size=3 must divide"),
    ("loss:\n  aggregation: mean\n", r"loss: unknown loss aggregation 'mean'"),
    ("loss:\n  kl_estimator: k9\n", r"unknown KL estimator 'k9'"),
    ("eval:\n  eval_batch_size: -1\n", r"eval.eval_batch_size must be >= 0 \(0 = the rollout's rows per rank\)"),
    # verl's names (#67, #68)
    ("generation:\n  max_tool_response_length: 256\n", r"grpo.yaml: generation.max_tool_response_length is verl's "
                                                      r"cut of a tool's text in characters; .* give "
                                                      r"generation.max_tool_response_tokens"),
    ("generation:\n  max_assistant_turns: 3\n  max_tool_calling_iterations: 1\n",
     r"generation.max_assistant_turns=3 \(verl's: 2 tool turns\) and generation.max_tool_calling_iterations=1 "
     r"disagree"),
    ("generation:\n  max_assistant_turns: 0\n", r"generation.max_assistant_turns must be an integer >= 1"),
    ("lora:\n  target_modules: [q_proj]\n  lora_target_modules: [v_proj]\n",
     r"lora.target_modules=\['q_proj'\] and lora.lora_target_modules=\['v_proj'\] disagree"),
])
def test_bad_yaml_names_the_file_and_field(tmp_path, yaml_text, message):
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message) as info:
        config = GRPOConfig.from_yaml(str(path))
        config.validate()
        check_registered_names(config)  # the loss aggregation and KL estimator names
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    ({"generation": {"num_generations": 1}}, r"generation.num_generations must be >= 2"),
    ({"generation": {"temperature": 0.0}}, r"GRPO needs sampling"),
    ({"reward": {"reward_funcs": ["nosuch"], "reward_weights": [1.0]}},
     r"command line: reward.reward_funcs: unknown reward function .nosuch."),
    ({"reward": {"reward_weights": [1.0]}}, r"reward.reward_weights has 1 value\(s\) \[1.0\] but "
                                            r"reward.reward_funcs has 2"),
])
def test_cross_field_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config = GRPOConfig().replace(overrides)
        config.validate()
        check_registered_names(config)  # the reward function names


def test_verls_names_read_as_the_fields(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("generation:\n  max_assistant_turns: 3\ntools:\n  tools: [calculator]\n"
                    "lora:\n  lora_rank: 8\n  target_modules: [q_proj, v_proj]\n")
    config = GRPOConfig.from_yaml(str(path))
    config.validate()
    assert config.generation.max_tool_calling_iterations == 2  # verl counts the model's turns: 2 tool turns
    assert config.lora.lora_target_modules == ["q_proj", "v_proj"] and config.lora.lora_rank == 8


def test_layout_from_config_covers_the_world():
    from mindrlhf.configs.parallel import ParallelConfig
    from mindrlhf.parallel.layout import Layout, LayoutError
    layout = Layout.from_config(ParallelConfig(data_parallel=1, model_parallel=2), world_size=2, rank=1)
    assert (layout.dp, layout.tp, layout.tp_rank) == (1, 2, 1)
    with pytest.raises(LayoutError, match=r"train.yaml: parallel_config: data_parallel=2 x model_parallel=2 = 4 "
                                          r"ranks, but the job has 2"):
        Layout.from_config(ParallelConfig(data_parallel=2, model_parallel=2), 2, 0, "train.yaml: parallel_config")


def test_job_flags_are_generated_from_the_job_options():
    from mindrlhf.configs.job import JobOptions

    parser = argparse.ArgumentParser()
    JobOptions.add_flags(parser)
    with pytest.raises(SystemExit):  # the three inputs are required
        parser.parse_args(["--sft_path_train", "t.yaml"])
    args = parser.parse_args(["--sft_path_train", "t.yaml", "--sft_path_infer", "i.yaml", "--mind_dataset_dir", "d",
                              "--resume", "--only_save_strategy", "--cpu_threads", "3", "--use_parallel", "false"])
    job = JobOptions.from_args(args)
    assert (job.sft_path_train, job.sft_path_infer, job.mind_dataset_dir) == ("t.yaml", "i.yaml", "d")
    assert job.resume == "auto" and job.only_save_strategy and not job.enable_compile_cache  # off by default
    on = JobOptions.from_args(parser.parse_args(["--sft_path_train", "t.yaml", "--sft_path_infer", "i.yaml",
                                                 "--mind_dataset_dir", "d", "--enable_compile_cache", "True",
                                                 "--only_save_strategy", "False"]))
    assert on.enable_compile_cache and not on.only_save_strategy  # MindRLHF's spelling of booleans
    for spelling, value in (("True", "true"), ("FALSE", "false"), ("1", "true"), ("0", "false"), ("Auto", "auto")):
        parsed = parser.parse_args(["--sft_path_train", "t", "--sft_path_infer", "i", "--mind_dataset_dir", "d",
                                    "--use_parallel", spelling, "--cpu_affinity", "OFF"])
        assert (parsed.use_parallel, parsed.cpu_affinity) == (value, "off"), spelling
    with pytest.raises(SystemExit):
        parser.parse_args(["--sft_path_train", "t", "--sft_path_infer", "i", "--mind_dataset_dir", "d",
                           "--use_parallel", "maybe"])
    assert job.cpu_threads == 3 and job.use_parallel == "false" and job.output_dir == "output/grpo"
    assert job.checkpoint_dir == "output/grpo/checkpoints"
    assert {action.dest for action in parser._actions} - {"help"} == {f.name for f in dataclasses.fields(JobOptions)}
    with pytest.raises(SystemExit):
        parser.parse_args(["--sft_path_train", "t", "--sft_path_infer", "i", "--mind_dataset_dir", "d",
                           "--use_parallel", "maybe"])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "lots"])
def test_device_memory_gib_must_be_a_finite_number(value, capsys):
    """argparse's float takes nan and inf; --plan then printed 'fits ... of nan GiB per device'."""
    from mindrlhf.configs.cli import OneLineErrorParser
    from mindrlhf.configs.job import JobOptions

    parser = OneLineErrorParser(prog="grpo_one_stage.py")
    JobOptions.add_flags(parser)
    required = ["--sft_path_train", "t", "--sft_path_infer", "i", "--mind_dataset_dir", "d"]
    assert JobOptions.from_args(parser.parse_args([*required, "--device_memory_gib", "59.6"])).device_memory_gib == 59.6
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*required, f"--device_memory_gib={value}"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == f"grpo_one_stage.py: error: argument --device_memory_gib: " \
                                                      f"expected a finite number, got '{value}'"


def test_a_compile_cache_serves_only_a_rerun_of_the_same_job_from_the_same_start(tmp_path):
    # MindSpore loads cached graphs by compile order: a resumed run or another seed must not get this run's graphs
    from mindrlhf.configs.job import JobOptions
    from mindrlhf.trainer.launch import compile_cache_path

    data = tmp_path / "prompts.mindrecord"
    data.write_bytes(b"x")
    step = tmp_path / "out" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    job = JobOptions(sft_path_train="t.yaml", sft_path_infer="i.yaml", mind_dataset_dir=str(data),
                     output_dir=str(tmp_path / "out"), enable_compile_cache=True)
    config = GRPOConfig()
    path = compile_cache_path(job, config, 2, 1)
    assert path == compile_cache_path(job, config, 2, 1) and path.endswith("rank_1")
    assert path.startswith(str(tmp_path / "out" / "compile_cache"))
    assert compile_cache_path(job, config, 2, 0) == path[:-1] + "0"
    others = [compile_cache_path(dataclasses.replace(job, resume="auto"), config, 2, 1),
              compile_cache_path(job, config.replace({"schedule": {"seed": 1}}), 2, 1),
              compile_cache_path(job, config, 4, 1)]
    data.write_bytes(b"xy")  # the prompts changed
    others.append(compile_cache_path(job, config, 2, 1))
    assert len({path, *others}) == 5


def test_the_eval_dataset_flag_is_eval_dataset_file():
    from mindrlhf.configs.job import JobOptions

    parser = argparse.ArgumentParser()
    JobOptions.add_flags(parser)
    required = ["--sft_path_train", "t", "--sft_path_infer", "i", "--mind_dataset_dir", "d"]
    assert JobOptions.from_args(parser.parse_args(required)).eval_dataset_file == ""
    assert JobOptions.from_args(parser.parse_args(required + ["--eval_dataset_file", "x"])).eval_dataset_file == "x"


@pytest.mark.parametrize("argv, hint", [
    (["--eval_dataset_dir", "held.mindrecord"], " (did you mean --eval_dataset_file?)"),
    (["--eval_dataset_dir=held.mindrecord"], " (did you mean --eval_dataset_file?)"),
    (["--schedule.dynamic_sampling", "true"], " (did you mean --dynamic_sampling?)"),
    (["--schedule.max_sampling_retries", "2"], " (did you mean --max_sampling_retries?)"),
    (["--advantage_estimator", "rloo"], " (did you mean --adv_estimator?)"),
    (["--loss.advantage_eps", "0.1"], " (did you mean --advantage_eps?)"),
    (["--critic.lr", "1e-3"], None),
    (["--lr", "1e-3"], None),  # not read as --lr_warmup_steps: flags are matched exactly
])
def test_an_old_flag_name_is_refused_in_one_line(argv, hint, capsys):
    from mindrlhf.cli.train import build_parser

    parser = build_parser()
    parser.prog = "grpo_one_stage.py"
    required = ["--sft_path_train", "t", "--sft_path_infer", "i", "--mind_dataset_dir", "d"]
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*required, *argv])
    assert exit_.value.code == 2
    error, see_help = capsys.readouterr().err.splitlines()
    assert error.startswith(f"grpo_one_stage.py: error: unrecognized arguments: {' '.join(argv)}")
    if hint is not None:
        assert error.endswith(hint)
    assert see_help == "see grpo_one_stage.py --help"


def test_several_yaml_files_merge_field_by_field(tmp_path):
    base, extra = tmp_path / "base.yaml", tmp_path / "extra.yaml"
    base.write_text("loss:\n  beta: 0.02\n  aggregation: token-mean\nschedule:\n  steps: 7\n")
    extra.write_text("loss:\n  beta: 0.0\nalgorithm:\n  adv_estimator: rloo\n")
    config = GRPOConfig.from_yaml(str(base), str(extra))
    assert (config.loss.beta, config.loss.aggregation, config.schedule.steps) == (0.0, "token-mean", 7)
    assert config.algorithm.adv_estimator == "rloo"
    extra.write_text("loss:\n  betta: 0.0\n")
    with pytest.raises(ConfigError, match=r"extra.yaml: loss: unknown field\(s\) 'betta' \(did you mean 'beta'\?\)"):
        GRPOConfig.from_yaml(str(base), str(extra))
    extra.write_text("losses:\n  beta: 0.0\n")
    with pytest.raises(ConfigError, match=r"extra.yaml: unknown section\(s\) \['losses'\]"):
        GRPOConfig.from_yaml(str(base), str(extra))


def test_the_critics_learning_rate_has_its_own_name(tmp_path):
    """critic.learning_rate (once lr, which `--lr` read as the policy's); the old name is refused in one line."""
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    # --learning_rate stays the policy's alone; the critic's is the dotted flag
    assert config_overrides(parser.parse_args(["--learning_rate", "1e-5"])) == {"optimizer": {"learning_rate": 1e-5}}
    assert config_overrides(parser.parse_args(["--critic.learning_rate", "1e-3"])) == {
        "critic": {"learning_rate": 1e-3}}
    path = tmp_path / "ppo.yaml"
    path.write_text("critic:\n  learning_rate: 1.0e-3\n")
    config = GRPOConfig.from_yaml(str(path))
    assert config.critic.learning_rate == 1e-3 and config.optimizer.learning_rate == 1e-6
    path.write_text("critic:\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError) as err:
        GRPOConfig.from_yaml(str(path))
    assert str(err.value) == f"{path}: critic: unknown field(s) 'lr'; known fields: learning_rate, lr_warmup_steps, " \
                             "grad_clip, cliprange_value, critic_warmup, use_lora"
    with pytest.raises(ConfigError, match=r"critic.learning_rate must be > 0, got 0.0"):
        GRPOConfig().replace({"critic": {"learning_rate": 0.0}})


def run_script(*argv: str) -> subprocess.CompletedProcess:
    return run_command([sys.executable, GRPO_SCRIPT, *argv], timeout=120)


def flag_help(help_text: str, flag: str) -> str:
    """The --help entry of `flag` (its lines up to the next flag's), whitespace collapsed."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {flag} "))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("  -")), len(lines))
    return " ".join(" ".join(lines[start:end]).split())


def test_help_shows_each_flags_type_and_default():
    proc = run_script("--help")
    assert proc.returncode == 0, proc.stderr
    assert "CFG__" not in proc.stdout and "cfg__" not in proc.stdout  # no internal dest names
    epsilon = flag_help(proc.stdout, "--epsilon_low")
    assert epsilon.startswith("--epsilon_low FLOAT, --loss.epsilon_low FLOAT [loss] Lower clip range")
    assert epsilon.endswith("(default: 0.2)")
    assert flag_help(proc.stdout, "--use_parallel").startswith("--use_parallel {auto,true,false} ")
    assert flag_help(proc.stdout, "--use_parallel").endswith("(default: auto)")
    assert flag_help(proc.stdout, "--max_sampling_retries").startswith(
        "--max_sampling_retries INT, --algorithm.max_sampling_retries INT [algorithm] ")
    assert flag_help(proc.stdout, "--max_sampling_retries").endswith("(default: 3)")
    # no old names: fields that moved or were renamed have their new flags only
    for old in ("--schedule.max_sampling_retries", "--critic.lr ", "--eval_dataset_dir", "old name", "deprecated"):
        assert old not in proc.stdout
    assert flag_help(proc.stdout, "--max_new_tokens").endswith("(default: 256)")  # GRPOConfig's, not the class's
    assert flag_help(proc.stdout, "--reward_funcs").endswith("(default: accuracy format)")
    assert flag_help(proc.stdout, "--reward_weights").endswith("(default: 1.0 per function)")
    assert flag_help(proc.stdout, "--eos_token_ids").endswith("(default: the tokenizer's)")
    assert flag_help(proc.stdout, "--sft_path_train").startswith("--sft_path_train STR ")
    assert flag_help(proc.stdout, "--sft_path_train").endswith("(required)")
    assert flag_help(proc.stdout, "--seed").endswith("(default: 0)")
    assert "1e-3" not in flag_help(proc.stdout, "--learning_rate")  # the bundled value is the YAML's to state


@pytest.mark.parametrize("argv, error", [
    (["--lerning_rate", "1e-5"], "grpo_one_stage.py: error: unrecognized arguments: --lerning_rate 1e-5 "
                                 "(did you mean --learning_rate?)"),
    (["--steps", "x"], "grpo_one_stage.py: error: argument --steps/--schedule.steps: invalid int value: 'x'"),
    # flags are matched exactly: argparse's default would read a prefix as the one flag it starts
    (["--num_generation", "4"], "grpo_one_stage.py: error: unrecognized arguments: --num_generation 4 "
                                "(did you mean --num_generations?)"),
])
def test_a_bad_flag_is_one_line_without_the_usage(argv, error):
    required = ["--sft_path_train", "t.yaml", "--sft_path_infer", "i.yaml", "--mind_dataset_dir", "d"]
    proc = run_script(*required, *argv)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [error, "see grpo_one_stage.py --help"]
    assert proc.stdout == ""


def test_empty_reward_funcs_need_no_weights():
    """`reward_funcs: []` (a reward model alone): the weights default to one per function, so none; an explicit
    list of another length stays an error naming both fields."""
    model_alone = GRPOConfig().replace({"reward": {"reward_funcs": [], "reward_model_path": "rm.ckpt"}})
    model_alone.validate()
    assert model_alone.reward.reward_funcs == [] and model_alone.reward.reward_weights is None
    assert GRPOConfig().replace(parse(["--reward_funcs", "accuracy"])).reward.reward_weights is None  # 1.0 each
    with pytest.raises(ConfigError, match=r"reward.reward_weights has 2 value\(s\) \[1.0, 0.5\] but "
                                          r"reward.reward_funcs has 0 \[\]: give one weight per function"):
        GRPOConfig().replace({"reward": {"reward_funcs": [], "reward_weights": [1.0, 0.5],
                                         "reward_model_path": "rm.ckpt"}})
    from mindrlhf.reward import build_reward_fn

    rewards = build_reward_fn(["accuracy", "format"], GRPOConfig().reward.reward_weights)
    assert rewards.weights == (1.0, 1.0)


def test_configs_are_frozen_and_a_replaced_value_is_checked_once_naming_the_field(monkeypatch):
    """A config is changed by making a new one (GRPOConfig.replace, dataclasses.replace), never in place; the new
    value is validated as it is made, in one line naming the field, and only the sections it changes are."""
    config = GRPOConfig()
    for target, name, value in [(config, "generation", None), (config.generation, "max_new_tokens", 4),
                                *((getattr(config, section), dataclasses.fields(cls)[0].name, None)
                                  for section, cls in SECTIONS.items())]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(target, name, value)
    with pytest.raises(ConfigError, match=r"^generation.top_p must be in \(0, 1\] \(1.0 = off\), got 1.5$"):
        dataclasses.replace(config.generation, top_p=1.5)
    with pytest.raises(ConfigError, match=r"^schedule.steps must be >= 1, got 0$"):
        dataclasses.replace(config.schedule, steps=0)
    with pytest.raises(ConfigError, match=r"^command line: generation: generation.temperature must be a finite "
                                          r"number >= 0 \(0 = greedy\), got -1.0$"):
        config.replace({"generation": {"temperature": -1.0}})

    calls = []
    for cls in SECTIONS.values():
        monkeypatch.setattr(cls, "validate", lambda self, name=cls.__name__: calls.append(name))
    changed = config.replace({"schedule": {"steps": 3}})
    assert calls == ["ScheduleConfig"] and changed.schedule.steps == 3 and config.schedule.steps == 100
    assert all(getattr(changed, s) is getattr(config, s) for s in SECTIONS if s != "schedule")  # kept, not rebuilt
    changed.validate()  # the cross-section checks only: no section is checked again
    assert calls == ["ScheduleConfig"]


def test_to_dict_keeps_lists_and_round_trips():
    """Checkpoints store `to_dict()` and a resumed run compares it: the frozen sections still give lists."""
    config = GRPOConfig().replace({"generation": {"prompt_buckets": [32, 64], "stop_strings": ["</answer>"]}})
    data = config.to_dict()
    assert data["generation"]["prompt_buckets"] == [32, 64] and type(data["generation"]["eos_token_ids"]) is list
    assert data["reward"]["reward_funcs"] == ["accuracy", "format"]
    assert GRPOConfig.from_dict(data).to_dict() == data
    assert config.sources == {"generation.prompt_buckets": "command line", "generation.stop_strings": "command line"}
