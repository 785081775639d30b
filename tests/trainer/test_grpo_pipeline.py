"""The GRPO trainer with the actor's train net in 2 pipeline stages (msrun, 2 workers, `tiny/train_pp2.yaml`) and
the inference net at dp=2 on the same ranks: online reshard from the stages every step, the swap plan, a checkpoint
MindSpore reads as the whole net, exact resume, and the one-line errors of layouts stages cannot take; a 4-layer
tied model in 4 stages on 4 workers; and the PPO critic in 2 stages. The jobs without stages they learn like are the
session's straight runs (tests/conftest.py: `straight_run`, `tp_critic_ppo_run`), whose first steps they compare."""
import json
import shutil

import numpy as np
import pytest
from support.jobs import (
    grpo_msrun_command,
    job_args,
    memory_features_yaml,
    module_run,
    ppo_args,
    run_job,
    without_timing,
)
from support.msrun import free_port, msrun_env, run_command
from support.paths import TINY, TINY_SFT_CKPT
from support.tolerances import assert_weights_close_after_adam

from mindrlhf.cli import transform_checkpoint

PIPELINE_YAML = TINY / "train_pp2.yaml"


def pipeline_args(data, out_dir, steps, extra=()):
    args = job_args(data, out_dir, steps, extra)
    args[args.index("--sft_path_train") + 1] = str(PIPELINE_YAML)
    return args


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, mindrecord):
    """3 steps in one go: checkpoints at steps 2 and 3, the reference synced from the stages at step 3."""
    return module_run(tmp_path_factory, "pp2", lambda out: pipeline_args(mindrecord, out, 3))


@pytest.mark.msrun
def test_train_stages_reshard_into_the_infer_net_every_step(pipeline_run):
    tmp_path, ranks = pipeline_run
    log = "".join(p.read_text(errors="replace") for p in sorted((tmp_path / "pp2_logs").glob("worker_*.log")))
    assert "train layout dp=1 x tp=1 x pp=2, infer layout dp=2 x tp=1" in log
    for rank, result in enumerate(ranks):
        assert result["exit_code"] == 0
        assert [s["step"] for s in result["steps"]] == [1, 2, 3]
        for step in result["steps"]:
            assert step["mismatched"] == [], f"rank {rank} step {step['step']}: infer != its stage of train"
            assert step["plan_errors"] == [], f"rank {rank} step {step['step']}"
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]) == 3
    for a, b in zip(ranks[0]["steps"], ranks[1]["steps"]):  # the loss statistics reach both stages
        assert without_timing(a["metrics"]) == pytest.approx(without_timing(b["metrics"]), rel=1e-6)
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(line["actor/updates"] == 4 and line["actor/entropy"] > 0 for line in lines)
    assert any(line["actor/grad_norm"] > 0 for line in lines) and lines[-1]["actor/kl_loss"] > 0  # the policy moved


@pytest.mark.msrun
def test_train_stages_learn_like_the_train_net_without_stages(pipeline_run, tmp_path, monkeypatch, mindrecord):
    """The same job with the train net at dp=2 (no stages): same rollouts, same loss statistics and gradient norms
    for the first two steps (later steps sample from weights that differ by float rounding).

    Not the session's straight run (train tp=2): its step 1 has no reward (all advantages 0), so the only
    gradient is that of the KL at the reference, which is 0 where the train net's log-probs equal the inference
    net's bit for bit (dp=2, stages: nothing moves, grad_norm 0) but float noise at tp=2 (grad_norm 8e-8 at the
    first update), which AdamW turns into updates of ~lr per weight: the straight run's step 1 ends with
    actor/grad_norm 53.5 and actor/ratio_mean 1.036 where this job's are 0 and 1."""
    _, ranks = pipeline_run
    args = job_args(mindrecord, tmp_path / "out", 2)
    train_yaml = tmp_path / "train_dp2.yaml"
    train_yaml.write_text(PIPELINE_YAML.read_text().replace("data_parallel: 1", "data_parallel: 2")
                          .replace("pipeline_stage: 2", "pipeline_stage: 1"))
    args[args.index("--sft_path_train") + 1] = str(train_yaml)
    flat = run_job(tmp_path, monkeypatch, "dp2", args)
    assert [s["step"] for s in ranks[0]["steps"][:2]] == [s["step"] for s in flat[0]["steps"]] == [1, 2]
    for staged, plain in zip(ranks[0]["steps"][:2], flat[0]["steps"]):
        assert staged["metrics"]["critic/score/mean"] == plain["metrics"]["critic/score/mean"]
        for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert staged["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-4, abs=1e-6), key
    assert any(step["metrics"]["actor/grad_norm"] > 0 for step in flat[0]["steps"])  # a real update was compared


@pytest.mark.msrun
def test_stage_checkpoint_merges_into_the_whole_net(pipeline_run, tmp_path):
    """Each rank's train.ckpt holds its stage; the step's train strategy is the merged pipeline strategy, which
    our merge and MindSpore's transform_checkpoints (through tools/transform_checkpoint.py) both read as the whole
    net, with the same values."""
    import mindspore as ms

    from mindrlhf.checkpoint.step import is_optimizer_state
    from mindrlhf.checkpoint.weights import read_weights
    from mindrlhf.parallel.strategy import read_staged_strategy_file

    run_dir, _ = pipeline_run
    step = run_dir / "out" / "checkpoints" / "step_000003"
    stage_names = []
    for rank in range(2):
        names = {n for n in ms.load_checkpoint(str(step / f"rank_{rank}" / "train.ckpt")) if not is_optimizer_state(n)}
        stage_names.append(names)
    assert "model.tok_embeddings.embedding_weight" in stage_names[0] and "lm_head.weight" in stage_names[1]
    assert not stage_names[0] & stage_names[1]
    layouts, stages = read_staged_strategy_file(step / "train_strategy.ckpt")
    assert {n for n, s in stages.items() if s == 1} == stage_names[1]
    merged = read_weights(str(step))
    assert set(merged) == stage_names[0] | stage_names[1] == set(layouts)
    ckpt = tmp_path / "ckpt"
    for rank in range(2):
        (ckpt / f"rank_{rank}").mkdir(parents=True)
        shutil.copy(step / f"rank_{rank}" / "train.ckpt", ckpt / f"rank_{rank}" / "train.ckpt")
    tool = transform_checkpoint
    assert tool.main(["--src_checkpoint", str(ckpt), "--src_strategy", str(step / "train_strategy.ckpt"),
                      "--dst_checkpoint", str(tmp_path / "full")]) == 0  # our CLI over MindSpore's transform
    (name,) = [p.name for p in (tmp_path / "full" / "rank_0").iterdir()]
    oracle = {k: v.asnumpy() for k, v in ms.load_checkpoint(str(tmp_path / "full" / "rank_0" / name)).items()}
    for key, value in merged.items():
        np.testing.assert_array_equal(value, oracle[key], err_msg=key)


@pytest.mark.msrun
def test_resume_with_stages_equals_the_straight_run(pipeline_run, tmp_path, monkeypatch, mindrecord):
    import mindspore as ms

    from mindrlhf.checkpoint.step import is_optimizer_state

    straight_dir, straight = pipeline_run
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight_dir / "out" / "checkpoints" / "step_000002", out / "checkpoints" / "step_000002")
    ranks = run_job(tmp_path, monkeypatch, "resumed", pipeline_args(mindrecord, out, 3, ["--resume"]))
    assert [s["step"] for s in ranks[0]["steps"]] == [3]
    assert ranks[0]["steps"][0]["mismatched"] == [] and ranks[1]["steps"][0]["mismatched"] == []
    assert without_timing(ranks[0]["steps"][0]["metrics"]) == pytest.approx(
        without_timing(straight[0]["steps"][2]["metrics"]), rel=1e-6, abs=1e-9)
    for rank in range(2):
        files = [ms.load_checkpoint(str(d / "checkpoints" / "step_000003" / f"rank_{rank}" / "train.ckpt"))
                 for d in (out, straight_dir / "out")]
        resumed, reference = ({k: v.asnumpy() for k, v in f.items()} for f in files)
        assert resumed.keys() == reference.keys()
        weights = [n for n in reference if not is_optimizer_state(n)]
        assert_weights_close_after_adam({n: resumed[n] for n in weights}, {n: reference[n] for n in weights},
                                        lr=1e-3, updates=4, what=f"rank {rank} resumed vs straight")


@pytest.mark.msrun
def test_resume_with_other_stages_is_a_one_line_error(pipeline_run, tmp_path, mindrecord):
    """The pipeline checkpoint resumed by a job whose train net has no stages: refused, naming both layouts, and the
    job ends without MindSpore's scheduler waiting out a rank's heartbeats (each failed rank unregisters before msrun
    kills the others: `launch.PEER_GRACE_S`)."""

    straight_dir, _ = pipeline_run
    out = tmp_path / "out"
    shutil.copytree(straight_dir / "out" / "checkpoints" / "step_000002", out / "checkpoints" / "step_000002")
    done = run_command(grpo_msrun_command(tmp_path / "logs", free_port(), job_args(mindrecord, out, 3, ["--resume"])),
                       msrun_env(), timeout=600)
    assert done.returncode != 0
    log = (tmp_path / "logs" / "worker_0.log").read_text(errors="replace")
    assert "train layout dp=1 x tp=1 x pp=2 differs from this job's dp=1 x tp=2" in log
    assert "Traceback" not in log
    scheduler = (tmp_path / "logs" / "scheduler.log").read_text(errors="replace")
    assert "timed out" not in scheduler and "abnormal" not in scheduler, scheduler[-2000:]


@pytest.mark.msrun
def test_only_save_strategy_writes_each_stage_which_mindspore_merges(tmp_path, mindrecord):
    import mindspore as ms

    from mindrlhf.parallel.strategy import read_staged_strategy_file

    out = tmp_path / "out"
    done = run_command(grpo_msrun_command(tmp_path / "logs", free_port(),
                                     pipeline_args(mindrecord, out, 1, ["--only_save_strategy"])),
                       msrun_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    merged = tmp_path / "merged.ckpt"
    ms.parallel.merge_pipeline_strategys(str(out / "strategy" / "train"), str(merged))
    layouts, stages = read_staged_strategy_file(merged)
    assert stages["model.tok_embeddings.embedding_weight"] == 0 and stages["lm_head.weight"] == 1
    assert stages["model.layers.0.attention.wq.weight"] == 0 and stages["model.layers.1.attention.wq.weight"] == 1
    assert all(lay.world_size == 1 for lay in layouts.values())  # each stage: dp=1 x tp=1


def tied_job(tmp_path, monkeypatch, mindrecord, out_dir, steps, train_yaml):
    """The tiny job with tied embeddings (the head is the embedding: tiny_sft.ckpt without its lm_head) and the
    train net from `train_yaml`. That policy never answers, so the reward is one that varies within a group: the
    number of distinct characters of a completion."""
    import os

    import mindspore as ms

    (tmp_path / "varied_rewards.py").write_text(
        "def distinct_characters(completions, **kwargs):\n    return [len(set(c)) / 10 for c in completions]\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))

    weights = {k: v for k, v in ms.load_checkpoint(str(TINY_SFT_CKPT)).items() if k != "lm_head.weight"}
    ckpt = tmp_path / "tied_sft.ckpt"
    ms.save_checkpoint([{"name": k, "data": v} for k, v in weights.items()], str(ckpt))
    args = job_args(mindrecord, out_dir, steps, ["--reward_funcs", "varied_rewards:distinct_characters",
                                                 "--reward_weights", "1"])
    for flag, yaml in (("--sft_path_train", train_yaml), ("--sft_path_infer", TINY / "infer.yaml")):
        tied = tmp_path / f"tied_{yaml.name}"
        tied.write_text(yaml.read_text().replace("tie_word_embeddings: false", "tie_word_embeddings: true"))
        args[args.index(flag) + 1] = str(tied)
    args[args.index("--load_sft_checkpoint_train") + 1] = str(ckpt)
    return args


@pytest.mark.msrun
def test_four_stages_reshard_every_step_and_merge_into_the_whole_net(tmp_path, monkeypatch, mindrecord):
    """A 4-layer tied model (random weights) trained in 4 stages, a layer each, on 4 workers, inferring at dp=4:
    the middle stages pass activations and gradients both ways, the end stages hold and sum the tied embedding
    (the first stage embeds, the last scores with it: the two copies stay equal, the strategy puts it on the first
    stage and has no head), every step each rank's inference net equals its stage of the train net (the first
    stage's embedding included), the loss statistics reach every stage, and the step checkpoint merges into the
    whole net, the embedding as the stages hold it. (That a tied job in stages learns like it without stages:
    tests/parallel/test_pipeline.py's test_pipeline_train_step_equals_the_whole_model, its tied cases.)"""
    import mindspore as ms

    from mindrlhf.checkpoint.weights import read_weights
    from mindrlhf.parallel.strategy import read_staged_strategy_file

    args = tied_job(tmp_path, monkeypatch, mindrecord, tmp_path / "pp4", 2, PIPELINE_YAML)
    for flag, stages, dp in (("--sft_path_train", 4, 1), ("--sft_path_infer", 1, 4)):
        path = tmp_path / args[args.index(flag) + 1].rsplit("/", 1)[1]
        text = path.read_text().replace("num_layers: 2", "num_layers: 4")
        text = text.replace("pipeline_stage: 2", f"pipeline_stage: {stages}")
        path.write_text(text.replace("data_parallel: 2", f"data_parallel: {dp}"))
    at = args.index("--load_sft_checkpoint_train")
    del args[at:at + 2]  # random weights (the tiny checkpoint has 2 layers)
    ranks = run_job(tmp_path, monkeypatch, "pp4", args, workers=4)
    log = (tmp_path / "pp4_logs" / "worker_0.log").read_text(errors="replace")
    assert "train layout dp=1 x tp=1 x pp=4, infer layout dp=4 x tp=1" in log
    for rank, result in enumerate(ranks):
        assert result["exit_code"] == 0
        assert [s["mismatched"] for s in result["steps"]] == [[], []], f"rank {rank}: infer != its stage"
        assert [s["plan_errors"] for s in result["steps"]] == [[], []], f"rank {rank}"
        assert len(ranks[0]["steps"]) == len(result["steps"]) == 2
        for a, b in zip(ranks[0]["steps"], result["steps"]):  # the last stage's statistics reach every stage
            assert without_timing(a["metrics"]) == pytest.approx(without_timing(b["metrics"]), rel=1e-6)
    assert all(s["metrics"]["actor/grad_norm"] > 0 for s in ranks[0]["steps"])
    step = tmp_path / "pp4" / "checkpoints" / "step_000002"
    held = [{k: v.asnumpy() for k, v in ms.load_checkpoint(str(step / f"rank_{r}" / "train.ckpt")).items()}
            for r in range(4)]
    embedding = "model.tok_embeddings.embedding_weight"
    assert [embedding in h for h in held] == [True, False, False, True]
    np.testing.assert_array_equal(held[0][embedding], held[3][embedding])
    for rank in range(4):
        assert f"model.layers.{rank}.attention.wq.weight" in held[rank]
    layouts, stages = read_staged_strategy_file(step / "train_strategy.ckpt")
    assert [stages[f"model.layers.{i}.attention.wq.weight"] for i in range(4)] == [0, 1, 2, 3]
    assert stages[embedding] == 0 and stages["model.norm_out.weight"] == 3
    assert "lm_head.weight" not in layouts and not any("lm_head.weight" in h for h in held)  # tied: no head
    merged = read_weights(str(step))
    assert set(merged) == set(layouts)
    for name, value in merged.items():
        np.testing.assert_array_equal(value, held[stages[name]][name], err_msg=name)
    np.testing.assert_array_equal(merged[embedding], held[0][embedding])


@pytest.mark.msrun
def test_critic_in_stages_learns_like_the_critic_without_stages(tp_critic_ppo_run, tmp_path, monkeypatch,
                                                                mindrecord):
    """PPO with the critic in 2 stages (`tiny/train_pp2.yaml`: a layer each, 2 micro-batches; the values pass in
    2-row micro-batches through the stages), 2 steps, against the same job with the critic at tp=2 (the session's
    `tp_critic_ppo_run`: the same flags but the critic's YAML and the values pass's micro-batch size, neither of
    which changes a value): the same values, value losses and actor updates over 2 steps (the last stage's values
    reach every rank), the same metrics on both ranks, and the critic's stage checkpoints merge into the whole
    value model with the head on the last stage."""
    import mindspore as ms

    from mindrlhf.checkpoint.step import is_optimizer_state
    from mindrlhf.checkpoint.weights import read_weights
    from mindrlhf.parallel.strategy import read_staged_strategy_file

    _, plain_run = tp_critic_ppo_run
    actor_yaml = memory_features_yaml(tmp_path)  # the tp run's actor (its train net's layout changes no value)
    staged_run = run_job(tmp_path, monkeypatch, "critic_pp2", ppo_args(
        mindrecord, tmp_path / "pp2", 2, actor_yaml=actor_yaml, critic_yaml=PIPELINE_YAML,
        extra=["--log_prob_micro_batch_size_per_device", "2"]))  # the values pass: several micro-batches overlap
    log = (tmp_path / "critic_pp2_logs" / "worker_0.log").read_text(errors="replace")
    assert "critic layout dp=1 x tp=1 x pp=2" in log
    for rank, result in enumerate(staged_run):
        assert result["exit_code"] == 0
        assert [s["step"] for s in result["steps"]] == [1, 2]
        for step in result["steps"]:
            assert step["mismatched"] == [] and step["plan_errors"] == [], (rank, step["step"])
            assert "values" in step["phases"] and "update_critic" in step["phases"]
        assert len(staged_run[0]["steps"]) == len(result["steps"]) == 2
        for a, b in zip(staged_run[0]["steps"], result["steps"]):
            assert without_timing(a["metrics"]) == pytest.approx(without_timing(b["metrics"]), rel=1e-6, nan_ok=True)
    plain = plain_run[0]["steps"][:2]
    assert [s["step"] for s in plain] == [1, 2]
    for staged, plain_step in zip(staged_run[0]["steps"], plain):
        assert staged["metrics"]["critic/score/mean"] == plain_step["metrics"]["critic/score/mean"]
        keys = [k for k in plain_step["metrics"] if k.startswith("critic/")] + ["actor/loss", "actor/pg_loss",
                                                                                 "actor/grad_norm"]
        assert len(keys) > 10
        for key in keys:
            assert staged["metrics"][key] == pytest.approx(plain_step["metrics"][key], rel=1e-4, abs=1e-6,
                                                           nan_ok=True), key
    second = staged_run[0]["steps"][1]["metrics"]
    assert second["critic/values/max"] > second["critic/values/min"] and second["critic/grad_norm"] > 0
    step = tmp_path / "pp2" / "checkpoints" / "step_000002"
    layouts, stages = read_staged_strategy_file(step / "critic_strategy.ckpt")
    assert stages["critic.score.weight"] == 1 and stages["critic.model.layers.0.attention.wq.weight"] == 0
    held = [{k: v.asnumpy() for k, v in ms.load_checkpoint(str(step / f"rank_{r}" / "critic.ckpt")).items()
             if not is_optimizer_state(k)} for r in range(2)]
    assert not held[0].keys() & held[1].keys() and "critic.score.weight" in held[1]
    merged = read_weights(str(step), "critic")
    assert set(merged) == {name[len("critic."):] for name in layouts}
    for name, value in merged.items():
        np.testing.assert_array_equal(value, held[stages["critic." + name]]["critic." + name], err_msg=name)
