"""`JobPlan.build`: every cross-check of a job before any net is built, on the tiny model YAMLs (nothing compiled).

Each error names the file and the field it is about."""
import dataclasses
import re
from types import SimpleNamespace

import pytest
import yaml
from support.paths import TINY

from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.grpo_configs import GRPOConfig
from mindrlhf.configs.job import JobOptions
from mindrlhf.models.tokenizer import load_tokenizer
from mindrlhf.parallel.layout import LayoutError
from mindrlhf.trainer.phases import PHASES
from mindrlhf.trainer.plan import (
    JobPlan,
    check_job_inputs,
    check_registered_names,
    check_write_targets,
    resolve_token_ids,
)
from mindrlhf.trainer.specs import (
    CRITIC_MOMENTS,
    CRITIC_WEIGHTS,
    INFER_WEIGHTS,
    KV_CACHES,
    OPTIMIZER_MOMENTS,
    REF_WEIGHTS,
    ROLLOUT_WEIGHTS,
    TRAIN_WEIGHTS,
    phase_plan,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY / "tokenizer")


@pytest.fixture
def files(tmp_path):
    """A job's input files: the tiny train (dp 1 x tp 2) and infer (dp 2) YAMLs and a prompt file."""
    dataset = tmp_path / "prompts.mindrecord"
    dataset.write_bytes(b"")
    return SimpleNamespace(tmp=tmp_path, train=str(TINY / "train.yaml"), infer=str(TINY / "infer.yaml"),
                           dataset=str(dataset))


def model_yaml(tmp_path, name: str, base: str = "train.yaml", **changes) -> str:
    """A copy of a tiny model YAML with `model.<field>` / `parallel.<field>` changed."""
    data = yaml.safe_load((TINY / base).read_text())
    for key, value in changes.items():
        section, field = key.split(".")
        (data["parallel_config"] if section == "parallel" else data["model"]["model_config"])[field] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def job_of(files, **changes) -> JobOptions:
    return JobOptions(**{"sft_path_train": files.train, "sft_path_infer": files.infer,
                         "mind_dataset_dir": files.dataset, **changes})


def config_of(**overrides) -> GRPOConfig:
    """The tests' tiny GRPO config (batch 4, mini-batch 2, 4 generations) with `{section: {field: value}}`."""
    config = GRPOConfig.from_yaml(str(TINY / "grpo.yaml"))
    return config.replace(overrides) if overrides else config


def build(files, tokenizer, config=None, world_size=2, rank=0, **job_changes) -> JobPlan:
    return JobPlan.build(config or config_of(), job_of(files, **job_changes), tokenizer, world_size, rank)


def test_the_plan_of_the_tiny_job(files, tokenizer):
    plan = build(files, tokenizer, rank=1)
    assert (plan.world_size, plan.rank) == (2, 1)
    train, infer = plan.actor.train, plan.actor.infer
    assert (train.layout.dp, train.layout.tp, train.layout.tp_rank) == (1, 2, 1)
    assert (infer.layout.dp, infer.layout.tp, infer.layout.dp_rank) == (2, 1, 1)
    assert train.model.parallel_config.model_parallel == 2 and infer.model.parallel_config.data_parallel == 2
    assert (train.yaml, infer.yaml, train.checkpoint, infer.checkpoint) == (files.train, files.infer, "", "")
    assert plan.critic is None and plan.reward.model is None and not plan.actor.shares_train_weights
    # the tiny config's beta > 0: a reference in the inference layout, resharded from the actor (no checkpoint)
    assert plan.reference.net == infer and plan.reference.temperature == plan.generation.temperature
    assert [spec.name for spec in plan.roles()] == ["actor", "reference", "reward"]
    assert plan.actor.resident_in["generate"] == ("infer_weights", "kv_caches") and plan.reward.resident_in == {}
    assert plan.actor.eval_max_new_tokens == plan.generation.max_new_tokens and plan.actor.group_size == 4
    # eos / pad come from the tokenizer; everything else is the config's
    assert plan.generation.eos_token_ids == [702, 700] and plan.generation.pad_token_id == 700
    assert plan.generation.max_new_tokens == 96 and plan.generation.prompt_buckets == [256]
    assert plan.eval_batch_size == 4 // 2 * 4  # the rollout's rows per inference rank
    assert build(files, tokenizer, config_of(eval={"eval_batch_size": 3})).eval_batch_size == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.eval_batch_size = 1


def test_the_plan_built_before_the_cluster_forms_places_each_rank_without_checking_again(files, tokenizer,
                                                                                       monkeypatch):
    """The launch builds one plan (rank 0) from msrun's worker count, then asks for its own rank: the layouts are
    those a plan built at that rank has, and no YAML or file is read again."""
    from mindrlhf.configs.job import JobOptions
    from mindrlhf.models.qwen2.config import Qwen2Config
    from mindrlhf.trainer.launch import planned_world_size

    first = build(files, tokenizer, rank=0)
    expected = build(files, tokenizer, rank=1)
    monkeypatch.setattr(Qwen2Config, "from_yaml", lambda *a, **k: pytest.fail("a YAML was read again"))
    placed = first.for_rank(1)
    assert placed.rank == 1 and placed.world_size == 2
    assert placed.actor == expected.actor and placed.reference == expected.reference and placed.critic is None
    assert placed.reward == expected.reward
    assert placed.actor.train.layout != first.actor.train.layout  # tp rank 1, not 0
    assert placed.config is first.config and placed.job is first.job and placed.generation == first.generation
    monkeypatch.setenv("MS_WORKER_NUM", "4")
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    assert planned_world_size(JobOptions()) == 4
    assert planned_world_size(JobOptions(use_parallel="false")) == 1
    monkeypatch.delenv("MS_WORKER_NUM")
    monkeypatch.delenv("MS_ROLE")
    assert planned_world_size(JobOptions()) == 1  # a single process
    assert planned_world_size(JobOptions(use_parallel="true")) is None  # only MindSpore's cluster can tell


def test_stop_and_pad_ids_set_by_the_user_win_over_the_tokenizers(caplog):
    from mindrlhf.configs.generation import GenerationConfig

    gen = GenerationConfig(eos_token_ids=[5, 6], pad_token_id=7)
    unset = resolve_token_ids(gen, [702, 700], 700, {})
    assert (unset.eos_token_ids, unset.pad_token_id) == ([702, 700], 700)  # not set: the tokenizer's
    with caplog.at_level("INFO", logger="mindrlhf.trainer"):
        mine = resolve_token_ids(gen, [702, 700], 700, {"eos_token_ids": "grpo.yaml", "pad_token_id": "command line"})
    assert (mine.eos_token_ids, mine.pad_token_id) == ([5, 6], 7)
    assert "generation.eos_token_ids=[5, 6] (from grpo.yaml) is used instead of the tokenizer's [702, 700]" \
        in caplog.text
    assert "generation.pad_token_id=7 (from command line) is used instead of the tokenizer's 700" in caplog.text
    only_pad = resolve_token_ids(gen, [702, 700], 700, {"pad_token_id": "grpo.yaml"})
    assert (only_pad.eos_token_ids, only_pad.pad_token_id) == ([702, 700], 7)
    assert resolve_token_ids(gen, [702], 700, {"eos_token_ids": "g.yaml"}).eos_token_ids == [5, 6]
    no_stop = GenerationConfig(eos_token_ids=[])  # set to [] on purpose: always generate max_new_tokens
    assert resolve_token_ids(no_stop, [702], 700, {"eos_token_ids": "g.yaml"}).eos_token_ids == []


def test_the_plan_takes_the_stop_and_pad_ids_the_config_sets(files, tokenizer, tmp_path):
    path = tmp_path / "ids.yaml"
    path.write_text("generation:\n  eos_token_ids: [702]\n")
    config = GRPOConfig.from_yaml(str(TINY / "grpo.yaml"), str(path))
    plan = build(files, tokenizer, config)
    assert plan.generation.eos_token_ids == [702] and plan.generation.pad_token_id == 700  # the pad: the tokenizer's
    plan = build(files, tokenizer, config.replace({"generation": {"pad_token_id": 702}}))
    assert plan.generation.eos_token_ids == [702] and plan.generation.pad_token_id == 702


def test_registered_names_are_checked_by_the_plan_not_the_config(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("algorithm:\n  adv_estimator: ppo\n")
    config = GRPOConfig.from_yaml(str(path))  # loads: the registries are the plan's business
    config.validate()
    with pytest.raises(ConfigError, match=re.escape(f"{path}: algorithm.adv_estimator: unknown advantage "
                                                    "estimator 'ppo'")):
        check_registered_names(config)
    config = GRPOConfig.from_yaml(str(path)).replace({"algorithm": {"adv_estimator": "rloo"}})
    check_registered_names(config)  # a later source that fixes the value wins
    with pytest.raises(ConfigError, match=r"^command line: loss: unknown loss aggregation 'mean'"):
        check_registered_names(GRPOConfig().replace({"loss": {"aggregation": "mean"}}))
    with pytest.raises(ConfigError, match=r"^algorithm.adv_estimator: unknown advantage estimator 'ppo'"):
        check_registered_names(dataclasses.replace(GRPOConfig(), algorithm=dataclasses.replace(
            GRPOConfig().algorithm, adv_estimator="ppo")))  # built in code: no file to name


def test_the_plan_runs_the_config_checks_first(files, tokenizer):
    with pytest.raises(ConfigError, match=r"generation.num_generations must be >= 2"):
        build(files, tokenizer, config_of(generation={"num_generations": 1}))
    with pytest.raises(ConfigError, match=r"command line: reward.reward_funcs: unknown reward function "
                                          r"'nosuch'"):
        build(files, tokenizer, config_of(reward={"reward_funcs": ["nosuch"], "reward_weights": [1.0]}))


@pytest.mark.parametrize("changes, message", [
    ({"cpu_threads": -1}, r"^--cpu_threads must be >= 0 \(0 = cores / ranks on this host\), got -1"),
    ({"sft_path_train": "nowhere.yaml"}, r"^nowhere.yaml: --sft_path_train file not found"),
    ({"mind_dataset_dir": "nowhere.mindrecord"}, r"^nowhere.mindrecord: --mind_dataset_dir file not found"),
    ({"eval_dataset_file": "eval.mindrecord"}, r"^eval.mindrecord: --eval_dataset_file file not found"),
    ({"load_ref_checkpoint": "ref.ckpt"}, r"^ref.ckpt: --load_ref_checkpoint not found"),
])
def test_flags_and_input_files(files, tokenizer, changes, message):
    with pytest.raises(ConfigError, match=message):
        check_job_inputs(job_of(files, **changes))
    with pytest.raises(ConfigError, match=message):
        build(files, tokenizer, **changes)


def test_every_write_target_is_written_once_at_start_up(files):
    """A folder the job would write only at its first checkpoint (or event file, or experience file) is tried at
    start-up: a path that cannot be a folder stops the job there, naming the flag; good targets leave nothing
    behind (a job refused later writes nothing)."""
    blocker = files.tmp / "a_file"
    blocker.write_text("")
    out = files.tmp / "out"
    check_write_targets(job_of(files, output_dir=str(out), tensorboard_dir=str(out / "tb"),
                               save_data_file=str(out / "exp" / "grpo")))
    assert not out.exists()
    out.mkdir()
    check_write_targets(job_of(files, output_dir=str(out)))
    assert list(out.iterdir()) == []  # an existing folder stays, without the checkpoint folder or the probe
    for flag in ("output_dir", "save_ckpt_dir", "tensorboard_dir"):
        with pytest.raises(ConfigError, match=rf"^{blocker}/sub: --{flag} cannot be written \(Not a directory\)$"):
            check_write_targets(job_of(files, **{"output_dir": str(out), flag: str(blocker / "sub")}))
    with pytest.raises(ConfigError, match=rf"^{blocker}: --save_data_file cannot be written"):
        check_write_targets(job_of(files, output_dir=str(out), save_data_file=str(blocker / "grpo")))


def test_the_policy_yamls_and_layouts(files, tokenizer):
    other = model_yaml(files.tmp, "infer3.yaml", "infer.yaml", **{"model.num_layers": 3})
    with pytest.raises(ConfigError, match=rf"{files.train} and {other} describe different models \(num_layers: 2 vs "
                                          r"3\); only dtypes and parallel_config may differ"):
        build(files, tokenizer, sft_path_infer=other)
    with pytest.raises(LayoutError, match=rf"{files.train}: parallel_config: data_parallel=1 x model_parallel=2 = 2 "
                                          r"ranks, but the job has 4"):
        build(files, tokenizer, world_size=4)
    staged = model_yaml(files.tmp, "infer_pp.yaml", "infer.yaml", **{"parallel.data_parallel": 1,
                                                                     "parallel.pipeline_stage": 2})
    with pytest.raises(ConfigError, match=rf"{staged}: parallel_config.pipeline_stage=2, but the inference net "
                                          r"\(and the reference and the reward model in its layout\) runs without "
                                          r"pipeline stages"):
        build(files, tokenizer, sft_path_infer=staged)
    wide = model_yaml(files.tmp, "train_tp8.yaml", **{"parallel.model_parallel": 8})
    infer8 = model_yaml(files.tmp, "infer8.yaml", "infer.yaml", **{"parallel.data_parallel": 8})
    with pytest.raises(ConfigError, match=rf"{wide}: model_config.num_heads=4 is not divisible by "
                                          r"parallel_config.model_parallel=8; this model allows model_parallel "
                                          r"1, 2, 4$"):
        build(files, tokenizer, world_size=8, sft_path_train=wide, sft_path_infer=infer8)


def test_kv_heads_must_divide_or_be_divided_by_tp(files, tokenizer):
    odd = {"model.num_heads": 6, "model.n_kv_heads": 3, "model.hidden_size": 96}
    train, infer = model_yaml(files.tmp, "t.yaml", **odd), model_yaml(files.tmp, "i.yaml", "infer.yaml", **odd)
    with pytest.raises(ConfigError, match=rf"{train}: model_config.n_kv_heads=3 and the tensor-parallel size 2: one "
                                          r"must divide the other \(parallel_config.model_parallel; .*\); this model "
                                          r"allows "
                                          r"model_parallel 1$"):
        build(files, tokenizer, sft_path_train=train, sft_path_infer=infer)


def test_a_pipeline_train_layout(files, tokenizer):
    staged = str(TINY / "train_pp2.yaml")  # 2 stages x 2 micro-batches
    infer1 = str(TINY / "model.yaml")
    with pytest.raises(LayoutError, match=rf"{infer1}: parallel_config: data_parallel=1 x model_parallel=1 = 1 "
                                          r"ranks, but the job has 2"):
        build(files, tokenizer, sft_path_train=staged, sft_path_infer=infer1)
    plan = build(files, tokenizer, sft_path_train=staged)  # 8 responses a rank per update: 2 micro-batches of 4
    assert (plan.actor.train.layout.pp, plan.actor.train.layout.stage) == (2, 0)
    with pytest.raises(ConfigError, match=rf"{staged}: parallel_config.micro_batch_num=2 must divide the 3 "
                                          r"responses each train rank gets per update"):
        build(files, tokenizer, config_of(generation={"num_generations": 3}, schedule={"mini_batch_size": 1}),
              sft_path_train=staged)
    with pytest.raises(ConfigError, match=rf"schedule.micro_batch_size_per_device=4: with pipeline stages the train "
                                          rf"micro-batches are {staged}'s parallel_config.micro_batch_num; leave it 0"):
        build(files, tokenizer, config_of(schedule={"micro_batch_size_per_device": 4}), sft_path_train=staged)


@pytest.mark.parametrize("overrides, message", [
    ({"schedule": {"batch_size": 3, "mini_batch_size": 0}},
     r"schedule.batch_size=3 is not divisible by the inference data_parallel=2 \(.*infer.yaml\)"),
    ({"schedule": {"micro_batch_size_per_device": 3}},
     r"schedule.micro_batch_size_per_device=3 must divide the 8 responses each train rank gets per update \(2 "
     r"prompts x 4 generations / train data_parallel=1\)"),
    ({"schedule": {"log_prob_micro_batch_size_per_device": 3}},
     r"schedule.log_prob_micro_batch_size_per_device=3 must divide the 8 responses each inference rank generates "
     r"per round \(4 prompts / inference data_parallel=2 x 4 generations\)"),
])
def test_batches_split_over_the_data_parallel_ranks(files, tokenizer, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build(files, tokenizer, config_of(**overrides))


def test_a_mini_batch_splits_its_groups_over_the_train_ranks(files, tokenizer):
    train = model_yaml(files.tmp, "train_dp2.yaml", **{"parallel.data_parallel": 2, "parallel.model_parallel": 1})
    config = config_of(generation={"num_generations": 3}, schedule={"mini_batch_size": 1})
    with pytest.raises(ConfigError, match=rf"schedule.mini_batch_size: 1 prompts x 3 generations per update do not "
                                          rf"split evenly over the train data_parallel=2 \({train}\)"):
        build(files, tokenizer, config, sft_path_train=train)
    assert build(files, tokenizer, config_of(schedule={"mini_batch_size": 1}), sft_path_train=train)


def test_tokenizer_and_generation_lengths_fit_the_model(files, tokenizer):
    big = type("BigTokenizer", (), {"source": "big/vocab.json", "stop_token_ids": [1], "pad_token_id": 0,
                                    "__len__": lambda self: 1000})()
    with pytest.raises(ConfigError, match=rf"big/vocab.json: the tokenizer has 1000 ids but {files.train} "
                                          r"model_config.vocab_size is 704: tokenizer and model do not belong "
                                          r"together"):
        build(files, tokenizer=big)
    with pytest.raises(ConfigError, match=rf"^command line: generation.max_new_tokens=400 \+ largest of "
                                          r"generation.prompt_buckets=256 = 656 exceeds model_config.seq_length=512 "
                                          rf"of {files.infer} \(the KV cache"):
        build(files, tokenizer, config_of(generation={"max_new_tokens": 400}))


def test_a_generation_length_error_names_where_the_lengths_were_given(files, tokenizer, tmp_path):
    """`--max_new_tokens` given by flag is the command line's, not the inference YAML's (which gives seq_length);
    a YAML that gives it is named; a default is not attributed to any file."""
    longer = tmp_path / "longer.yaml"
    longer.write_text("generation:\n  prompt_buckets: [128, 480]\n")
    config = GRPOConfig.from_yaml(str(TINY / "grpo.yaml"), str(longer))
    with pytest.raises(ConfigError, match=rf"^{longer}: generation.max_new_tokens=96 \+ largest of generation."
                                          rf"prompt_buckets=480 = 576 exceeds model_config.seq_length=512 of "
                                          rf"{files.infer} "):
        build(files, tokenizer, config)
    with pytest.raises(ConfigError, match=r"^generation.max_new_tokens=256 \+ largest of generation.prompt_buckets="
                                          r"512 = 768 exceeds"):
        build(files, tokenizer, GRPOConfig(schedule=config.schedule))  # the defaults: no file to name
    with pytest.raises(ConfigError, match=r"^command line: generation.pad_token_id: token id\(s\) \[900\] outside the "
                                          rf"model vocabulary \(vocab_size=704 of {files.infer}\)$"):
        build(files, tokenizer, config_of(generation={"pad_token_id": 900}))


def test_a_min_decode_rows_that_cannot_step_down_is_refused(files, tokenizer, mindrecord):
    """The tiny job decodes 4 prompts / 2 inference ranks x 4 generations = 8 rows a rank: stepping down to 8 or
    more rows does nothing (a silent no-op before), 7 is the largest that does something."""
    build(files, tokenizer, config_of(generation={"min_decode_rows": 7}))
    with pytest.raises(ConfigError, match=r"^command line: generation.min_decode_rows=1000 has no effect: an "
                                          r"inference rank decodes at most 8 rows \(4 prompts / inference "
                                          r"data_parallel=2 x 4 generations\); the largest useful value is 7 "
                                          r"\(0 = off\)$"):
        build(files, tokenizer, config_of(generation={"min_decode_rows": 1000}))
    with pytest.raises(ConfigError, match=r"min_decode_rows=8 has no effect"):
        build(files, tokenizer, config_of(generation={"min_decode_rows": 8}))
    slots = {"max_num_seqs": 3, "min_decode_rows": 3}
    with pytest.raises(ConfigError, match=r"min_decode_rows=3 has no effect: an inference rank decodes at most 3 "
                                          r"rows \(generation.max_num_seqs=3 slots\); the largest useful value is 2"):
        build(files, tokenizer, config_of(generation=slots))
    # a held-out call of 16 prompts decodes more rows than the rollout: 8 steps those down
    wide_eval = config_of(generation={"min_decode_rows": 8}, eval={"eval_batch_size": 16})
    with pytest.raises(ConfigError, match=r"min_decode_rows=8 has no effect"):
        build(files, tokenizer, wide_eval)  # without --eval_dataset_file there is no evaluation
    build(files, tokenizer, wide_eval, eval_dataset_file=str(mindrecord))
    with pytest.raises(ConfigError, match=r"min_decode_rows=16 has no effect: an inference rank decodes at most 16 "
                                          r"rows \(eval.eval_batch_size=16 held-out prompts\); the largest useful "
                                          r"value is 15"):
        build(files, tokenizer, config_of(generation={"min_decode_rows": 16}, eval={"eval_batch_size": 16}),
              eval_dataset_file=str(mindrecord))


def test_prompts_longer_than_the_largest_bucket_are_found_before_the_cluster_forms(files, tokenizer, mindrecord,
                                                                                   tmp_path):
    """The plan reads the prompts' lengths once (the data reader of every rank found them after the cluster
    formed); a bucket from a MindSpeed-RL YAML is named by its max_prompt_length."""
    from mindrlhf.data.reader import read_prompt_records

    lengths = sorted(len(row) for row in read_prompt_records(str(mindrecord))[0])
    build(files, tokenizer, mind_dataset_dir=str(mindrecord))
    bucket = lengths[-1] - 1  # the longest prompts do not fit
    longer = sum(length > bucket for length in lengths)
    too_short = config_of(generation={"prompt_buckets": [bucket]})
    with pytest.raises(ConfigError, match=rf"^{mindrecord}: {longer} of {len(lengths)} prompts are longer than the "
                                          rf"largest prompt bucket {bucket} \(generation.prompt_buckets, from command "
                                          rf"line\), the longest {lengths[-1]} tokens: convert them again with "
                                          rf"mindrlhf-prepare-data --max_prompt_length {bucket} \(it drops longer "
                                          r"ones\) or add a larger bucket$"):
        build(files, tokenizer, too_short, mind_dataset_dir=str(mindrecord))
    mindspeed = tmp_path / "grpo_trainer.yaml"
    mindspeed.write_text(f"rl_config:\n  max_prompt_length: {bucket}\n")
    config = GRPOConfig.from_yaml(str(TINY / "grpo.yaml"), str(mindspeed))
    with pytest.raises(ConfigError, match=rf"prompt bucket {bucket} \(rl_config.max_prompt_length of {mindspeed}\), "
                                          r".* or raise max_prompt_length$"):
        build(files, tokenizer, config, mind_dataset_dir=str(mindrecord))
    build(files, tokenizer, too_short, mind_dataset_dir=str(mindrecord), plan=True)  # --plan reads no prompt
    build(files, tokenizer, too_short, mind_dataset_dir=str(tmp_path / "later.mindrecord"), check_flags=True)
    build(files, tokenizer, too_short)  # not a MindRecord: the data reader's error, as before


def test_rollout_rows_stay_on_their_rank_only_where_no_rank_needs_anothers(files, tokenizer):
    """The tiny job trains in tp=2 and generates in dp=2: its rollout is gathered. In one layout (dp=2 for both
    nets) with one update a step each rank keeps its rows, unless something reads the whole batch: a critic (GAE
    whitens over the batch), the KL in the reward, dynamic sampling or an experience file. With 2 updates a step
    (the tiny config's mini-batch of 2 of 4 prompts) each update takes both ranks' shares of its prompts: gathered;
    on one rank they are its own."""
    one_update = {"schedule": {"mini_batch_size": 0}}
    assert not build(files, tokenizer, config_of(**one_update)).rollout_rows_stay
    files.train = files.infer
    assert build(files, tokenizer, config_of(**one_update)).rollout_rows_stay
    assert not build(files, tokenizer).rollout_rows_stay  # 2 updates a step on 2 ranks
    assert build(files, tokenizer, world_size=1, rank=0, sft_path_infer=model_yaml(
        files.tmp, "one.yaml", "infer.yaml", **{"parallel.data_parallel": 1}), sft_path_train=model_yaml(
        files.tmp, "one_train.yaml", "infer.yaml", **{"parallel.data_parallel": 1})).rollout_rows_stay
    for algorithm, job in (({"dynamic_sampling": True}, {}), ({"use_kl_in_reward": True}, {}),
                           ({"adv_estimator": "gae"}, {"sft_path_critic": files.infer}),
                           ({}, {"save_data_file": str(files.tmp / "exp" / "grpo")})):
        config = config_of(algorithm=algorithm, **one_update)
        assert not build(files, tokenizer, config, **job).rollout_rows_stay, (algorithm, job)
    for estimator in ("dr_grpo", "rloo"):
        config = config_of(algorithm={"adv_estimator": estimator}, **one_update)
        assert build(files, tokenizer, config).rollout_rows_stay


def test_the_phase_plan_follows_from_the_roles_specs(files, tokenizer):
    """What is on device in each phase is the union of the specs' `resident_in`; the inference phases keep the
    train weights when the inference net is the train net; the reference syncs from the inference weights alone (a
    local copy: the train weights may stay on host); no reference net, no ref phase group at beta 0."""
    grpo = {"generate": (INFER_WEIGHTS, KV_CACHES), "reward": (), "ref": (REF_WEIGHTS,), "old": (INFER_WEIGHTS,),
            "gather": (), "values": (), "update_critic": (), "train": (TRAIN_WEIGHTS, OPTIMIZER_MOMENTS),
            "reshard": (TRAIN_WEIGHTS, INFER_WEIGHTS), "sync_ref": (INFER_WEIGHTS, REF_WEIGHTS),
            "eval": (INFER_WEIGHTS, KV_CACHES)}
    assert phase_plan(build(files, tokenizer).roles(), PHASES) == grpo
    gae = config_of(algorithm={"adv_estimator": "gae"})
    ppo = phase_plan(build(files, tokenizer, gae, sft_path_critic=files.train).roles(), PHASES)
    assert ppo == {**grpo, "values": (CRITIC_WEIGHTS,), "update_critic": (CRITIC_WEIGHTS, CRITIC_MOMENTS)}
    shared = build(files, tokenizer, config_of(loss={"beta": 0.0}), sft_path_infer=files.train)
    assert shared.actor.shares_train_weights and shared.reference is None
    assert phase_plan(shared.roles(), PHASES) == {
        **grpo, "generate": (TRAIN_WEIGHTS, KV_CACHES), "ref": (), "old": (TRAIN_WEIGHTS,), "reshard": (TRAIN_WEIGHTS,),
        "sync_ref": (TRAIN_WEIGHTS,), "eval": (TRAIN_WEIGHTS, KV_CACHES)}


def test_with_lora_the_reference_is_the_base_of_the_inference_nets_weights(files, tokenizer):
    """With LoRA the reference holds no weights: its ref phase needs the inference net's group; with a reference
    checkpoint of its own it keeps its own; ref_model_sync_steps is refused (the base never changes)."""
    lora = config_of(lora={"lora_rank": 2, "lora_alpha": 4})
    plan = build(files, tokenizer, lora)
    assert plan.reference.shares_policy_base and plan.reference.weights_group == INFER_WEIGHTS
    assert not plan.reference.net.model.lora.enabled and plan.actor.infer.model.lora.enabled
    resident = phase_plan(plan.roles(), PHASES)
    assert resident["ref"] == (INFER_WEIGHTS,) and REF_WEIGHTS not in sum(resident.values(), ())
    # the rollout's merged copy of the adapted weights: made in reshard, read in the rollout's phases
    assert plan.actor.merges_adapters and {phase for phase, groups in resident.items() if ROLLOUT_WEIGHTS in groups} \
        == {"generate", "eval", "old", "reshard"}
    unmerged = build(files, tokenizer, config_of(lora={"lora_rank": 2, "lora_alpha": 4, "lora_merged_rollout": False}))
    assert not unmerged.actor.merges_adapters
    assert ROLLOUT_WEIGHTS not in sum(phase_plan(unmerged.roles(), PHASES).values(), ())
    assert not build(files, tokenizer).actor.merges_adapters
    shared = build(files, tokenizer, lora, sft_path_infer=files.train)
    assert shared.reference.weights_group == TRAIN_WEIGHTS
    (files.tmp / "ref.ckpt").write_bytes(b"")  # the plan checks it exists; the role reads it
    own = build(files, tokenizer, lora, load_ref_checkpoint=str(files.tmp / "ref.ckpt"))
    assert not own.reference.shares_policy_base and phase_plan(own.roles(), PHASES)["ref"] == (REF_WEIGHTS,)
    with pytest.raises(ConfigError, match=r"^schedule.ref_model_sync_steps=3: with LoRA the reference is the base "
                                          r"model the adapters sit on, which never changes; set it to 0"):
        build(files, tokenizer, config_of(lora={"lora_rank": 2}, schedule={"ref_model_sync_steps": 3}))


def test_a_critic_exactly_with_gae(files, tokenizer):
    gae = config_of(algorithm={"adv_estimator": "gae"})
    with pytest.raises(ConfigError, match=r"^algorithm.adv_estimator: 'gae' needs a critic \(--sft_path_critic\)"):
        build(files, tokenizer, gae)
    with pytest.raises(ConfigError, match=r"^--sft_path_critic: a critic is only used by algorithm.adv_estimator "
                                          r"gae, not 'grpo'"):
        build(files, tokenizer, sft_path_critic=files.train)
    plan = build(files, tokenizer, gae, sft_path_critic=files.train)
    critic = plan.critic
    assert critic.net.model == plan.actor.train.model and (critic.net.layout.dp, critic.net.layout.tp) == (1, 2)
    # no critic checkpoint: it starts from the policy's weights (here random, of the job's seed)
    assert (critic.net.checkpoint, critic.policy, critic.init_seed) == ("", plan.actor.train, plan.job.init_seed)
    assert [spec.name for spec in plan.roles()][-1] == "critic" and critic.aggregation == plan.config.loss.aggregation
    at_rank_1 = build(files, tokenizer, gae, sft_path_critic=files.train, rank=1)
    assert plan.for_rank(1).critic == at_rank_1.critic and at_rank_1.critic.policy == at_rank_1.actor.train


def test_critic_yaml_errors(files, tokenizer):
    gae = config_of(algorithm={"adv_estimator": "gae"})
    wider = model_yaml(files.tmp, "critic_vocab.yaml", **{"model.vocab_size": 768})
    with pytest.raises(ConfigError, match=rf"{files.train} and {wider} describe different models \(vocab_size: 704 "
                                          r"vs 768\)"):
        build(files, tokenizer, gae, sft_path_critic=wider)
    ckpt = files.tmp / "critic.ckpt"
    ckpt.write_bytes(b"")
    with pytest.raises(ConfigError, match=rf"{wider}: model_config.vocab_size=768, but the policy's is 704: the "
                                          r"critic must read the same tokens"):
        build(files, tokenizer, gae, sft_path_critic=wider, load_critic_checkpoint=str(ckpt))
    deeper = model_yaml(files.tmp, "critic_deep.yaml", **{"model.num_layers": 4})  # another net from a checkpoint
    plan = build(files, tokenizer, gae, sft_path_critic=deeper, load_critic_checkpoint=str(ckpt))
    assert plan.critic.net.model.num_layers == 4 and plan.critic.net.checkpoint == str(ckpt)
    dp2 = model_yaml(files.tmp, "critic_dp2.yaml", **{"parallel.data_parallel": 2, "parallel.model_parallel": 1})
    odd = config_of(algorithm={"adv_estimator": "gae"}, generation={"num_generations": 3},
                    schedule={"batch_size": 2, "mini_batch_size": 1})
    with pytest.raises(ConfigError, match=rf"schedule.mini_batch_size: 1 prompts x 3 generations per update do not "
                                          rf"split evenly over the critic data_parallel=2 \({dp2}\)"):
        build(files, tokenizer, odd, sft_path_critic=dp2)


def test_the_reward_model_reads_the_policys_tokens_in_the_inference_layout(files, tokenizer):
    scored = config_of(reward={"reward_model_path": "rm.ckpt"})
    plan = build(files, tokenizer, scored)
    assert plan.reward.model == dataclasses.replace(plan.actor.infer, checkpoint="rm.ckpt")
    assert plan.reward.resident_in == {"reward": ("reward_model_weights",)}
    rm = model_yaml(files.tmp, "rm.yaml", "infer.yaml", **{"model.num_layers": 4})
    scored_rm = build(files, tokenizer, scored, sft_path_reward=rm).reward.model
    assert (scored_rm.model.num_layers, scored_rm.yaml) == (4, rm)
    vocab = model_yaml(files.tmp, "rm_vocab.yaml", "infer.yaml", **{"model.vocab_size": 768})
    with pytest.raises(ConfigError, match=rf"{vocab}: model_config.vocab_size=768, but the policy's is 704: the "
                                          r"reward model must read the same tokens"):
        build(files, tokenizer, scored, sft_path_reward=vocab)
    with pytest.raises(ConfigError, match=rf"{files.train}: parallel_config data_parallel x model_parallel = 1 x 2, "
                                          rf"but the reward model runs in the inference layout \(2 x 1, "
                                          rf"{files.infer}\)"):
        build(files, tokenizer, scored, sft_path_reward=files.train)


def test_bfloat16_is_refused_on_cpu_only(files, tokenizer):
    bf16 = model_yaml(files.tmp, "bf16_infer.yaml", "infer.yaml", **{"model.compute_dtype": "bfloat16"})
    train_bf16 = model_yaml(files.tmp, "bf16_train.yaml", **{"model.compute_dtype": "bfloat16"})
    job = job_of(files, sft_path_infer=bf16, sft_path_train=train_bf16)
    JobPlan.build(config_of(), job, tokenizer, 2, 0)  # --plan reads an Ascend recipe on CPU: no device, no error
    JobPlan.build(config_of(), job, tokenizer, 2, 0, device="Ascend")
    with pytest.raises(ConfigError, match=re.escape(f"{train_bf16}: model_config.compute_dtype: bfloat16 has no "
                                                    "CPU kernels; set float32 (or float16) to run on CPU")):
        JobPlan.build(config_of(), job, tokenizer, 2, 0, device="CPU")
    JobPlan.build(config_of(), job_of(files), tokenizer, 2, 0, device="CPU")  # the tiny fp32 YAMLs


def test_the_held_out_set_is_read_and_checked_by_the_plan(files, tokenizer, mindrecord, tmp_path):
    from mindrlhf.data.reader import read_prompt_records

    plan = build(files, tokenizer, eval_dataset_file=str(mindrecord))
    ids, solutions = read_prompt_records(str(mindrecord))
    assert plan.eval_set == ([row.tolist() for row in ids], solutions) and len(solutions) > 1
    assert build(files, tokenizer).eval_set is None
    # --check_flags runs before run_grpo.sh writes the held-out MindRecord
    assert build(files, tokenizer, eval_dataset_file=str(mindrecord), check_flags=True).eval_set is None
    longest = max(len(row) for row in ids)
    with pytest.raises(ConfigError, match=re.escape(f"{mindrecord}: an eval prompt has {longest} tokens, more than "
                                                    f"the largest prompt bucket {longest - 1}")):
        build(files, tokenizer, config_of(generation={"prompt_buckets": [longest - 1]}),
              eval_dataset_file=str(mindrecord))
    damaged = tmp_path / "damaged.mindrecord"
    damaged.write_bytes(b"not a MindRecord")
    with pytest.raises(ConfigError, match=re.escape(f"{damaged}: cannot read the eval MindRecord")):
        build(files, tokenizer, eval_dataset_file=str(damaged))
