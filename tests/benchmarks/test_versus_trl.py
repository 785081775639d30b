"""benchmarks/versus_trl.py's pure parts: the prompts TRL gets, the TRL config mapping, the table arithmetic.

No TRL needed: the TRL side itself (benchmarks/trl_side.py) runs only in the benchmark's own virtualenv.
"""
from __future__ import annotations

import json
import os
import pathlib
import stat

import pytest
import yaml
from support.paths import ARITH

from benchmarks import versus_trl as vt

ARITH_POLICY = str(ARITH / "policy")
GRPO_YAML = str(ARITH / "grpo.yaml")


def first_problems(path, count: int) -> str:
    with open(vt.DATA) as src, open(path, "w") as dst:
        for _ in range(count):
            dst.write(src.readline())
    return str(path)


def test_job_rows_are_rlhf_data_prompts_in_trainer_order(tmp_path):
    from mindspore.mindrecord import FileReader

    from examples.qwen_grpo_tutorial import rlhf_data
    from mindrlhf.data.reader import PromptDataset
    from mindrlhf.data.templates import build_prompt
    from mindrlhf.models.tokenizer import load_tokenizer

    data = first_problems(tmp_path / "problems.jsonl", 12)
    theirs = str(tmp_path / "rlhf_data.mindrecord")  # what run_grpo.sh feeds our trainer
    assert rlhf_data.main(["--tokenizer_dir", ARITH_POLICY, "--file_path", data, "--output_path", theirs,
                           "--template", "r1_think", "--max_prompt_length", "256"]) == 0
    reader = FileReader(theirs, num_consumer=1)
    records = [{k: r[k] for k in ("prompt", "prompt_ids", "solution")} for r in reader.get_next()]
    reader.close()

    rows, special = vt.job_rows(data, ARITH_POLICY, str(tmp_path / "work"), steps=2, batch_size=4, seed=3)
    assert len(rows) == 8
    assert special == {"stop_token_ids": [602, 600], "pad_token_id": 600}
    # the order of the trainer's reader, here split over 2 inference ranks whose halves are gathered in rank order
    ranks = [PromptDataset(theirs, 2, 600, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    order = [int(i) for _ in range(2) for ds in ranks for i in ds.next_batch()["sample_index"]]
    assert [row["sample_index"] for row in rows] == order
    tokenizer = load_tokenizer(ARITH_POLICY)
    with open(data) as f:
        questions = [json.loads(line)["question"] for line in f]
    text = lambda value: value.decode() if isinstance(value, bytes) else value
    for row in rows:
        record = records[row["sample_index"]]
        assert row["prompt"] == text(record["prompt"]) and row["solution"] == text(record["solution"])
        assert row["prompt_ids"] == [int(t) for t in record["prompt_ids"]]
        assert row["prompt"] == build_prompt(questions[row["sample_index"]], "r1_think", tokenizer.apply_chat_template)


def test_trl_config_matches_the_job():
    assert vt.job_overrides(vt.parse_args([])) == {}  # the bundled job as grpo.yaml has it
    settings = vt.job_settings(GRPO_YAML, {})
    config = vt.trl_config(settings, steps=6)
    gen, sched, opt, loss = settings["generation"], settings["schedule"], settings["optimizer"], settings["loss"]
    assert (sched["batch_size"], gen["num_generations"], sched["mini_batch_size"]) == (8, 8, 2)
    # one TRL generation batch = one step of ours; an optimizer update = mini_batch_size prompt groups
    assert config["per_device_train_batch_size"] * config["steps_per_generation"] == 8 * 8
    assert config["per_device_train_batch_size"] * config["gradient_accumulation_steps"] == 2 * 8
    assert vt.updates_per_step(config) == 4 and config["max_steps"] == 24
    assert config["num_generations"] == 8 and config["num_iterations"] == 1 and config["shuffle_dataset"] is False
    assert (config["max_completion_length"], config["temperature"], config["top_k"], config["top_p"]) == \
        (48, 1.0, 0, 1.0)
    assert (config["beta"], config["epsilon"], config["epsilon_high"]) == (0.01, 0.2, 0.28)
    assert (config["loss_type"], config["scale_rewards"]) == ("grpo", "group")
    assert config["reward_weights"] == [1.0, 0.5] and settings["reward"]["reward_funcs"] == ["accuracy", "format"]
    assert (config["learning_rate"], config["warmup_steps"], config["max_grad_norm"], config["weight_decay"]) == \
        (1e-4, 5, 1.0, 0.0)
    assert (config["adam_beta1"], config["adam_beta2"], config["adam_epsilon"]) == \
        (opt["beta1"], opt["beta2"], opt["eps"]) == (0.9, 0.95, 1e-8)
    # TRL as its users run it on this CPU (bf16 autocast, gradient checkpointing), and in fp32 without recompute
    assert config["use_cpu"] and not config["use_vllm"] and config["bf16"] and config["gradient_checkpointing"]
    fp32 = vt.trl_config(settings, steps=6, side="trl_fp32")
    assert not fp32["bf16"] and not fp32["gradient_checkpointing"] and not fp32["fp16"]
    assert {k: v for k, v in fp32.items() if k not in vt.TRL_SIDES["trl"]} == \
        {k: v for k, v in config.items() if k not in vt.TRL_SIDES["trl"]}
    assert vt.parse_args([]).sides == ["ours", "trl", "trl_fp32"]
    with pytest.raises(SystemExit):
        vt.parse_args(["--sides", "ours,theirs"])
    assert loss["kl_estimator"] == "k3"

    # micro-batches: the same update, accumulated
    micro = vt.trl_config(vt.job_settings(GRPO_YAML, {"micro_batch_size_per_device": 4}), steps=2)
    assert (micro["per_device_train_batch_size"], micro["gradient_accumulation_steps"],
            micro["steps_per_generation"], vt.updates_per_step(micro)) == (4, 4, 16, 4)
    # the 0.5b case: 2 prompts x 4 generations, one update of all 8 responses, 1-row micro-batches
    args = vt.parse_args(["--case", "0.5b"])
    small = vt.trl_config(vt.job_settings(GRPO_YAML, vt.job_overrides(args)), steps=args.steps)
    assert (small["per_device_train_batch_size"], small["gradient_accumulation_steps"],
            small["steps_per_generation"], vt.updates_per_step(small), small["max_steps"]) == (1, 8, 8, 1, 2)
    assert (small["num_generations"], small["max_completion_length"], small["learning_rate"]) == (4, 64, 1e-6)


def test_smollm2_case_is_run_grpo_sh_smollm2_job(tmp_path):
    args = vt.parse_args(["--case", "smollm2"])
    assert (args.steps, args.workers, vt.job_overrides(args)) == (4, 1, {})
    settings = vt.job_settings(os.path.join(vt.CASES["smollm2"]["configs"], "grpo.yaml"), {})
    config = vt.trl_config(settings, steps=args.steps)
    # 4 prompts x 8 samples, one update of all 32 responses per step, at the model's own chat template
    assert (config["num_generations"], config["per_device_train_batch_size"], vt.updates_per_step(config)) == (8, 32, 1)
    assert (config["max_completion_length"], config["temperature"], config["beta"], config["learning_rate"]) == \
        (96, 0.7, 0.04, 5e-6)
    assert settings["reward"]["reward_funcs"] == ["accuracy", "hash_format"] and config["reward_weights"] == [1, 0.5]
    assert vt.CASES["smollm2"]["template"] == "chat"
    env, flags = vt.ours_launch(args, {}, str(tmp_path), {"policy_dir": "/m", "tokenizer_dir": "/m"})
    assert (env["MODEL"], env["MODEL_DIR"], env["EVAL_DATA"], env["WORKER_NUM"]) == ("smollm2", "/m", "", "1")
    # run_grpo.sh's own smollm2 YAMLs; a rerun into the same --workdir replaces the run there
    assert flags == ["--steps", "4", "--overwrite_output"] and "TRAIN_YAML" not in env
    # --workers 2: the shipped model laid out over 2 data-parallel ranks (its 9 heads allow no tp 2)
    model = {"policy_dir": "/m", "yaml": os.path.join(vt.SMOLLM2, "train.yaml"), "seq_length": 1024}
    env, _ = vt.ours_launch(vt.parse_args(["--case", "smollm2", "--workers", "2"]), {}, str(tmp_path), model)
    assert env["WORKER_NUM"] == "2"
    for name in ("TRAIN_YAML", "INFER_YAML"):
        doc = yaml.safe_load(pathlib.Path(env[name]).read_text())
        assert doc["parallel_config"] == {"data_parallel": 2, "model_parallel": 1, "pipeline_stage": 1}, name
        assert doc["model"]["model_config"]["num_layers"] == 30 and doc["model"]["model_config"]["seq_length"] == 1024

    # long responses: both sides' length, our passes at one width
    args = vt.parse_args(["--case", "smollm2", "--max_new_tokens", "512", "--response_buckets", "1"])
    overrides = vt.job_overrides(args)
    assert overrides == {"max_new_tokens": 512, "response_buckets": 1}
    long = vt.job_settings(os.path.join(vt.CASES["smollm2"]["configs"], "grpo.yaml"), overrides)
    assert vt.trl_config(long, steps=2)["max_completion_length"] == 512 and long["schedule"]["response_buckets"] == 1
    assert vt.ours_launch(args, overrides, str(tmp_path), {"policy_dir": "/m"})[1] == \
        ["--steps", "4", "--overwrite_output", "--max_new_tokens", "512", "--response_buckets", "1"]
    ladder = vt.job_overrides(vt.parse_args(["--case", "smollm2", "--min_decode_rows", "1",
                                             "--step_down_ratio", "0.67"]))
    assert ladder == {"min_decode_rows": 1, "step_down_ratio": 0.67}
    assert vt.job_settings(os.path.join(vt.CASES["smollm2"]["configs"], "grpo.yaml"), ladder)["generation"][
        "step_down_ratio"] == 0.67

    with pytest.raises(ValueError, match="lr_schedule"):
        vt.trl_config(vt.job_settings(GRPO_YAML, {"lr_schedule": "cosine"}), steps=1)
    odd = {**settings, "schedule": {**settings["schedule"], "micro_batch_size_per_device": 3}}
    with pytest.raises(ValueError, match="does not divide"):
        vt.trl_config(odd, steps=1)


def ours_line(step_s, generate, ref, train, reward, length, reward_mean):
    return {"timing/step": step_s, "timing/generate": generate, "timing/ref": ref, "timing/train": train,
            "timing/reward": reward, "timing/reshard": 0.1, "response_length/mean": length,
            "critic/score/mean": reward_mean, "perf/max_rss_gib": 2.0, "perf/sum_rss_gib": 4.0,
            "perf/idle_decode_rows": length / 100}


def test_summary_and_table_arithmetic():
    # ours: 3 steps, the first compiles; TRL: counted tokens, old-policy log-probs go with ref
    ours = {"wall_s": 100.0, "peak_rss_gib": 2.0, "steps": [
        ours_line(50.0, 20, 5, 20, 0.1, 20.0, 0.5), ours_line(10.0, 2, 1, 6, 0.1, 20.0, 0.75),
        ours_line(12.0, 3, 1, 7, 0.1, 30.0, 1.0)]}
    trl_line = lambda s, tokens: {"timing/step": s, "timing/generate": 5.0, "timing/ref": 1.0,
                                  "timing/old": 1.0, "timing/train": s - 8.0, "timing/reward": 0.5,
                                  "perf/tokens": tokens, "critic/score/mean": 0.5}
    theirs = {"wall_s": 80.0, "peak_rss_gib": 1.0, "steps": [trl_line(30.0, 1000), trl_line(20.0, 1000),
                                                              trl_line(22.0, 1100)]}
    phases = vt.phase_seconds(theirs["steps"][1])
    assert phases == pytest.approx({"generate": 5.0, "ref": 2.0, "updates": 12.0, "reward": 0.5, "step": 20.0,
                                    "other": 0.5})
    assert vt.step_prompt_tokens([{"prompt_ids": [1] * n} for n in (3, 4, 5, 6)], 2, 8) == [56, 88]
    prompt_tokens = [100, 100, 100]
    ours_summary = vt.run_summary(ours, prompt_tokens, responses=10)
    assert ours_summary["step"] == 11.0 and ours_summary["generate"] == 2.5 and ours_summary["updates"] == 6.5
    assert ours_summary["other"] == pytest.approx((10 - 9.1 + 12 - 11.1) / 2)
    assert ours_summary["tokens_per_s"] == pytest.approx(((100 + 200) / 10 + (100 + 300) / 12) / 2)
    assert ours_summary["mean_reward"] == pytest.approx(0.75) and ours_summary["first_step_s"] == 50.0
    theirs_summary = vt.run_summary(theirs, prompt_tokens, responses=10)
    assert theirs_summary["step"] == 21.0 and theirs_summary["ref"] == 2.0
    assert theirs_summary["tokens_per_s"] == pytest.approx((1000 / 20 + 1100 / 22) / 2)
    # the idle decode rows: ours' mean over every step (the first's rows are real work too); TRL does not report them
    assert ours_summary["idle_decode_rows"] == pytest.approx(0.7 / 3) and theirs_summary["idle_decode_rows"] is None

    slower = dict(theirs_summary, step=42.0)
    rows = {row["key"]: row for row in vt.compare({"ours": [ours_summary, ours_summary],
                                                   "trl": [theirs_summary, theirs_summary],
                                                   "trl_fp32": [slower, slower]})}
    assert rows["step"]["ours"] == [11.0, 11.0] and rows["step"]["ratio_trl"] == pytest.approx(11.0 / 21.0)
    assert rows["step"]["ratio_trl_fp32"] == pytest.approx(11.0 / 42.0)
    assert rows["tokens_per_s"]["ratio_trl"] == pytest.approx(ours_summary["tokens_per_s"] / 50.0)
    assert rows["wall_s"]["ratio_trl"] == pytest.approx(100 / 80)
    assert rows["idle_decode_rows"]["ours_mean"] == pytest.approx(0.7 / 3)
    assert rows["idle_decode_rows"]["trl_mean"] is None and rows["idle_decode_rows"]["ratio_trl"] is None
    table = vt.format_table(list(rows.values()), rounds=2)
    assert "whole step s" in table and f"{11 / 21:.2f}x" in table and f"{11 / 42:.2f}x" in table
    assert "ours r2" in table and "trl r1" in table and "trl_fp32 r2" in table and "ours/trl_fp32" in table
    # one side only: no ratio
    single = vt.compare({"ours": [ours_summary]})
    assert all("ratio_trl" not in row for row in single)
    assert "ours/" not in vt.format_table(single, rounds=1)


def test_trl_venv_is_reused_when_its_stamp_matches(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    calls = []
    monkeypatch.setattr(vt.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    assert vt.ensure_trl_venv(str(venv)) == str(python)  # no stamp: installs the pins, writes the stamp
    assert len(calls) == 1 and list(vt.TRL_REQUIREMENTS) == calls[0][-len(vt.TRL_REQUIREMENTS):]
    assert vt.ensure_trl_venv(str(venv)) == str(python) and len(calls) == 1  # stamp matches: nothing to do
    (venv / ".versus-trl-installed").write_text("stale\n")
    vt.ensure_trl_venv(str(venv))
    assert len(calls) == 2


def test_lora_sides_train_the_same_adapters_and_ours_full_the_whole_policy(tmp_path):
    args = vt.parse_args(["--case", "smollm2", "--lora_rank", "16"])
    assert args.sides == ["ours", "ours_full", "trl", "trl_fp32"] and args.lora_alpha == 32.0
    overrides = vt.job_overrides(args)
    assert overrides == {"lora_rank": 16, "lora_alpha": 32.0, "lora_target_modules": ["all-linear"]}
    settings = vt.job_settings(os.path.join(vt.CASES["smollm2"]["configs"], "grpo.yaml"), overrides)
    assert vt.peft_lora(settings) == {"r": 16, "lora_alpha": 32.0, "lora_dropout": 0.0, "target_modules": "all-linear"}
    two = vt.job_settings(GRPO_YAML, {"lora_rank": 4, "lora_target_modules": ["q_proj", "v_proj"]})
    assert vt.peft_lora(two)["target_modules"] == ["q_proj", "v_proj"] and vt.peft_lora(two)["lora_alpha"] == 16.0
    assert vt.peft_lora(vt.job_settings(GRPO_YAML, {})) is None
    flags = vt.ours_launch(args, overrides, str(tmp_path), {"policy_dir": "/m"})[1]
    assert flags[3:] == ["--lora_rank", "16", "--lora_alpha", "32.0", "--lora_target_modules", "all-linear"]
    # without LoRA there is no ours_full, and asking for it is refused
    assert vt.parse_args(["--case", "smollm2"]).sides == ["ours", "trl", "trl_fp32"]
    with pytest.raises(SystemExit):
        vt.parse_args(["--sides", "ours,ours_full"])
    # the table divides ours (LoRA) by ours_full as by each TRL side
    base = dict.fromkeys((*(phase for phase, _ in vt.TABLE_PHASES), "tokens_per_s", "idle_decode_rows", "mean_reward",
                          "first_step_s", "wall_s", "peak_rss_gib"), 1.0)
    lora, full = dict(base, step=30.0, tokens_per_s=120.0), dict(base, step=45.0, tokens_per_s=80.0)
    rows = {row["key"]: row for row in vt.compare({"ours": [lora], "ours_full": [full], "trl": [full]})}
    assert rows["step"]["ratio_ours_full"] == pytest.approx(30 / 45)
    assert rows["tokens_per_s"]["ratio_ours_full"] == pytest.approx(1.5) and "ratio_trl_fp32" not in rows["step"]
