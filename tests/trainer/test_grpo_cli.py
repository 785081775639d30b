"""grpo_one_stage.py as a new user meets it: bad input gives one line `error: <where>: <problem>`, exit code 2,
no traceback, and nothing written; --only_save_strategy writes strategy files MindSpore reads."""
import contextlib
import io
import json
import os
import re
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from support.jobs import base_args, yaml_with
from support.metrics_doc import assert_documented
from support.msrun import run_command
from support.paths import GRPO_SCRIPT, GSM8K_SAMPLE, TINY, TINY_SFT_CKPT, TOKENIZER
from support.tolerances import MAX_FRACTION, TYPICAL_FRACTION, assert_weights_close_after_adam

from mindrlhf.cli import train
from mindrlhf.models.tokenizer import load_tokenizer


def bad_checkpoint(tmp_path):
    import mindspore as ms
    path = tmp_path / "other_shape.ckpt"
    ms.save_checkpoint([{"name": "model.tok_embeddings.embedding_weight",
                         "data": ms.Tensor(__import__("numpy").zeros((704, 32), "float32"))}], str(path))
    return path


CASES = {
    "steps 0": (lambda tmp, rec: ["--steps", "0"], r"error: command line: schedule: schedule.steps must be >= 1"),
    "one generation": (lambda tmp, rec: ["--num_generations", "1"], r"generation.num_generations must be >= 2"),
    "unknown reward": (lambda tmp, rec: ["--reward_funcs", "nosuch", "--reward_weights", "1"],
                       r"reward.reward_funcs: unknown reward function 'nosuch'"),
    "weights count": (lambda tmp, rec: ["--reward_weights", "1.0"],
                      r"reward.reward_weights has 1 value\(s\) \[1.0\] but reward.reward_funcs has 2"),
    "misspelled yaml field": (
        lambda tmp, rec: ["--config", str(_write(tmp / "g.yaml", "schedule:\n  stepz: 3\n"))],
        r"g.yaml: schedule: unknown field\(s\) 'stepz' \(did you mean 'steps'\?\)"),
    "vocab mismatch": (
        lambda tmp, rec: [flag for name in ("--sft_path_train", "--sft_path_infer") for flag in (
            name, str(yaml_with(tmp, "small_vocab.yaml", [("vocab_size: 704", "vocab_size: 512")])))],
        r"tokenizer has 703 ids but .*small_vocab.yaml model_config.vocab_size is 512"),
    "different models": (
        lambda tmp, rec: ["--sft_path_infer", str(yaml_with(tmp, "deeper.yaml", [("num_layers: 2",
                                                                                  "num_layers: 3")]))],
        r"describe different models \(num_layers: 2 vs 3\)"),
    "layout vs world": (lambda tmp, rec: ["--sft_path_train", str(TINY / "train.yaml")],
                        r"train.yaml: parallel_config: data_parallel=1 x model_parallel=2 = 2 ranks, "
                        r"but the job has 1"),
    "missing checkpoint": (lambda tmp, rec: ["--load_sft_checkpoint_train", str(tmp / "nope.ckpt")],
                           r"nope.ckpt: --load_sft_checkpoint_train not found"),
    "checkpoint of another shape": (lambda tmp, rec: ["--load_sft_checkpoint_train", str(bad_checkpoint(tmp))],
                                    r"other_shape.ckpt: .*embedding_weight"),
    "batch larger than the data": (lambda tmp, rec: ["--batch_size", "512"], r"do not fill one global batch"),
    "micro-batch that does not divide": (lambda tmp, rec: ["--micro_batch_size_per_device", "3"],
                                         r"schedule.micro_batch_size_per_device=3 must divide the 8 responses"),
    "log-prob micro-batch that does not divide": (
        lambda tmp, rec: ["--log_prob_micro_batch_size_per_device", "3"],
        r"schedule.log_prob_micro_batch_size_per_device=3 must divide the 16 responses each inference rank"),
    "negative threads": (lambda tmp, rec: ["--cpu_threads", "-1"], r"error: --cpu_threads must be >= 0"),
    "gae without a critic": (lambda tmp, rec: ["--adv_estimator", "gae"],
                             r"error: algorithm.adv_estimator: 'gae' needs a critic"),
    "missing data": (lambda tmp, rec: ["--mind_dataset_dir", str(tmp / "none.mindrecord")],
                     r"none.mindrecord: --mind_dataset_dir file not found"),
    # the tools (#67): each a line before the cluster forms
    "tools without tool turns": (lambda tmp, rec: ["--tools", "calculator"],
                                 r"tools.tools lists tools but generation.max_tool_calling_iterations is 0"),
    "tool turns without tools": (lambda tmp, rec: ["--max_tool_calling_iterations", "2"],
                                 r"max_tool_calling_iterations=2 but tools.tools lists no tool"),
    "a tool that does not import": (lambda tmp, rec: [*TOOL_TURNS, "--tools", "nosuch_module:lookup"],
                                    r"tools: nosuch_module:lookup: module 'nosuch_module' does not import"),
    "a tool without type hints": (lambda tmp, rec: [*TOOL_TURNS, "--tools", "os.path:join"],
                                  r"tools: os.path:join: tool join: parameter 'a' has no type hint"),
    "two tools of one name": (lambda tmp, rec: [*TOOL_TURNS, "--tools", "calculator", "calculator"],
                              r"tools: two tools are named 'calculator'"),
    "an unknown built-in": (lambda tmp, rec: [*TOOL_TURNS, "--tools", "abacus"],
                            r"tools: 'abacus' is no built-in tool \(calculator, python\)"),
    "a template without tools": (lambda tmp, rec: [*TOOL_TURNS, "--tools", "calculator"],
                                 r"the tokenizer .* has no chat template that renders tools"),
}


TOOL_TURNS = ["--max_tool_calling_iterations", "1", "--max_tool_response_tokens", "32"]


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, mindrecord, capsys, graph_mode):
    make_args, message = CASES[case]
    out_dir = tmp_path / "out"
    code = train.main(base_args(mindrecord, out_dir) + make_args(tmp_path, mindrecord))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err and err[-1].startswith("error: "), err
    assert __import__("re").search(message, err[-1]), err[-1]
    assert not out_dir.exists()


def test_a_bad_flag_from_the_shell_has_no_traceback(tmp_path, mindrecord):
    env = dict(os.environ, GLOG_v="3")
    proc = run_command([sys.executable, str(GRPO_SCRIPT), *base_args(mindrecord, tmp_path / "out"), "--steps", "0"],
                       env, timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")


def logged_run(data, out, extra, callbacks=None) -> str:
    """A run of the tiny job on `data` from the bundled checkpoint with `extra` flags; returns its log (stderr)."""
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        code = train.main(base_args(data, out) + ["--load_sft_checkpoint_train", str(TINY_SFT_CKPT)] + extra,
                                  callbacks=callbacks)
    assert code == 0, log.getvalue()[-3000:]
    return log.getvalue()


def metrics_lines(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_only_save_strategy_writes_strategy_files_mindspore_reads(tmp_path, mindrecord, graph_mode):
    import mindspore as ms
    code = train.main(base_args(mindrecord, tmp_path / "out") + ["--only_save_strategy"])
    assert code == 0
    # one model YAML for both nets: the inference net is the train net, its names unprefixed
    for net, prefix in (("train", ""), ("infer", ""), ("ref", "ref.")):
        path = tmp_path / "out" / "strategy" / net / "ckpt_strategy_rank_0.ckpt"
        strategy = ms.build_searched_strategy(str(path))
        assert f"{prefix}model.layers.0.attention.wq.weight" in strategy
    assert not (tmp_path / "out" / "checkpoints").exists()


STOP = " dollars."


@pytest.mark.slow
def test_one_process_run_with_dynamic_sampling_saves_its_experience(tmp_path, mindrecord, graph_mode):
    """With a stop string (the bundled answers write " dollars." in some equations, not in others). (And the trainer
    froze its long-lived objects before its first compile: `freeze_long_lived_objects`.)"""
    import gc

    from mindspore.dataset import MindDataset
    out = tmp_path / "out"
    frozen = gc.get_freeze_count()
    logged_run(mindrecord, out, [
        "--steps", "1", "--max_new_tokens", "24", "--dynamic_sampling", "true", "--max_sampling_retries", "2",
        "--num_iterations", "1", "--save_data_file", str(tmp_path / "exp" / "grpo"), "--stop_strings", STOP,
        "--log_completions", "true"])
    assert gc.get_freeze_count() > frozen
    metrics = metrics_lines(out)[0]
    assert_documented([metrics])
    assert 1 <= metrics["sampling/rounds"] <= 3
    assert 0 <= metrics["sampling/kept_groups"] <= 4
    records = list(MindDataset(str(tmp_path / "exp" / "grpo.step_000001.mindrecord"), shuffle=False)
                   .create_dict_iterator(output_numpy=True))
    assert len(records) == 16 * metrics["sampling/rounds"]  # every generated response, 4 prompts x 4 per round
    first = records[0]
    assert first["response_ids"].shape == (24,) and first["ref_logp"].shape == (24,)
    lengths = [int(r["response_mask"].sum()) for r in records]
    assert np.mean(lengths) == pytest.approx(metrics["response_length/mean"])
    rewards = np.array([float(r["reward"]) for r in records])
    assert rewards.mean() == pytest.approx(metrics["critic/score/mean"], abs=1e-6)
    # token-level advantages: each response's group-normalised reward on its valid tokens, 0 on padding
    from mindrlhf.algorithms import group_advantages
    advantages, masks = np.stack([r["advantages"] for r in records]), np.stack([r["response_mask"] for r in records])
    np.testing.assert_allclose(advantages, group_advantages(rewards, 4)[:, None] * masks, atol=1e-6)
    np.testing.assert_array_equal(np.stack([r["returns"] for r in records]), advantages)
    assert (out / "checkpoints" / "step_000001" / "meta.json").is_file()
    # the stop string ends a response at the token that completes it in the rewards' text (the tokenizer's)
    tokenizer = load_tokenizer(TOKENIZER)
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    stopped = 0
    for length, record in zip(lengths, records):
        response = record["response_ids"][:length].tolist()
        if STOP in text(response):
            assert STOP not in text(response[:-1]), text(response)
            stopped += 1
        else:
            assert length == 24 or response[-1] in tokenizer.stop_token_ids, text(response)
    assert 0 < stopped < len(records)
    # --log_completions: a line per saved row, its texts, reward, terms and advantage
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(logged) == len(records) and {line["step"] for line in logged} == {1}
    for line, record, advantage, length in zip(logged, records, group_advantages(rewards, 4), lengths):
        assert line["completion"] == text(record["response_ids"][:length].tolist())
        assert line["prompt"] == tokenizer.decode(record["prompt_ids"].tolist())  # its real tokens only
        assert line["reward"] == pytest.approx(float(record["reward"]))
        assert line["advantage"] == pytest.approx(float(advantage), abs=1e-6)
        assert line["response_length"] == length
    terms = sorted(key for key in logged[0] if key.startswith("reward/"))
    assert terms and all(np.mean([line[key] for line in logged]) == pytest.approx(metrics[key], abs=1e-6)
                         for key in terms)


@pytest.mark.slow
def test_updates_that_keep_going_non_finite_stop_the_job_with_one_line(tmp_path, mindrecord, graph_mode, capsys):
    """A learning rate of 1e30 blows the weights up after the first update: later updates have a NaN loss, are
    skipped, and two in a row stop the job with a one-line error and no checkpoint of the broken state."""
    out = tmp_path / "out"
    code = train.main(base_args(mindrecord, out) + [
        "--load_sft_checkpoint_train", str(TINY_SFT_CKPT), "--steps", "2", "--learning_rate", "1e30",
        "--warmup_steps", "0", "--max_consecutive_skips", "2", "--save_interval", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("error: step 1: 2 actor updates in a row had a non-finite loss or gradient"), err[-1]
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def user_rewards_run(tmp_path_factory, graph_mode):
    """One step on the tutorial's prompts with a dataset field of their own (each prompt's token count, computed when
    the data is written) and user reward functions: a TRL-form one (`trl_style_rewards:short_answers`, beside the
    built-in accuracy) and one that reads the field (`column_rewards:prompt_tokens`), the only one weighted, so each
    response's reward is what that function gave it; with a held-out evaluation (the sample's last 10 problems)
    before and after the step. 48 new tokens: what the bundled policy's greedy answers need. At loss.beta 0 (TRL's
    default): no reference model. The run of the four tests below (rewards, TRL form, held-out accuracy, no
    reference)."""
    from mindrlhf.data.mindrecord import convert_to_mindrecord
    from mindrlhf.data.templates import build_prompt
    from mindrlhf.models.qwen2 import Qwen2Tokenizer
    from mindrlhf.models.tokenizer import load_tokenizer

    tmp = tmp_path_factory.mktemp("user_rewards")
    tokenizer = Qwen2Tokenizer(TOKENIZER / "vocab.json", TOKENIZER / "merges.txt")
    lines = GSM8K_SAMPLE.read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    for row in rows:
        prompt = build_prompt(row["question"], "r1_think", tokenizer.apply_chat_template)
        row["n_tokens"] = len(tokenizer.encode(prompt))
    (tmp / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = tmp / "data.mindrecord"
    convert_to_mindrecord(tmp / "data.jsonl", data, tokenizer, template="r1_think", max_prompt_length=256)
    (tmp / "heldout.jsonl").write_text("\n".join(lines[-10:]) + "\n")
    eval_path = tmp / "heldout.mindrecord"
    convert_to_mindrecord(tmp / "heldout.jsonl", eval_path, load_tokenizer(TOKENIZER), template="r1_think",
                          max_prompt_length=256)
    (tmp / "trl_style_rewards.py").write_text(
        "CALLS = []\n"
        "def short_answers(prompts, completions, completion_ids, solution, **kwargs):\n"
        "    CALLS.append((prompts, completions, completion_ids, solution))\n"
        "    return [None if i % 2 else float(len(ids) < 10) for i, ids in enumerate(completion_ids)]\n")
    (tmp / "column_rewards.py").write_text(
        "def prompt_tokens(completions, n_tokens, **kwargs):\n    return [float(n) for n in n_tokens]\n")
    out = tmp / "out"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.syspath_prepend(str(tmp))
        log = logged_run(data, out, [
            "--steps", "1", "--max_new_tokens", "48", "--num_iterations", "1", "--beta", "0",
            "--reward_funcs", "accuracy", "trl_style_rewards:short_answers", "column_rewards:prompt_tokens",
            "--reward_weights", "0", "0", "1", "--save_data_file", str(tmp / "exp" / "cols"),
            "--eval_dataset_file", str(eval_path), "--eval_batch_size", "4"])
    return SimpleNamespace(out=out, experience=tmp / "exp" / "cols.step_000001.mindrecord",
                           trl_calls=sys.modules["trl_style_rewards"].CALLS, eval_path=eval_path, max_new_tokens=48,
                           log=log)


@pytest.mark.slow
def test_reward_functions_get_the_other_dataset_fields_of_their_prompt(user_rewards_run):
    """A dataset field (here each prompt's token count, computed when the data is written) reaches a TRL-form
    reward function under its name, one value per completion, aligned with the completion's prompt."""
    from mindspore.dataset import MindDataset

    records = list(MindDataset(str(user_rewards_run.experience), shuffle=False)
                   .create_dict_iterator(output_numpy=True))
    assert len({len(r["prompt_ids"]) for r in records}) > 1  # prompts of different lengths in the batch
    for record in records:
        assert float(record["reward"]) == len(record["prompt_ids"])


@pytest.mark.slow
def test_a_reward_function_written_for_trl_runs_unchanged(user_rewards_run):
    """TRL's signature: keywords prompts / completions / completion_ids / solution; None = no opinion."""
    prompts, completions, ids, solution = user_rewards_run.trl_calls[0]
    assert len(prompts) == len(completions) == len(ids) == len(solution) == 16  # 4 prompts x 4 generations
    assert all("<answer>" in p or "answer" in p for p in prompts) and all(isinstance(i, list) for i in ids)
    metrics = metrics_lines(user_rewards_run.out)[-1]
    expected = np.mean([float(len(i) < 10) for i in ids[::2]])  # the mean over the samples with an opinion
    assert metrics["reward/trl_style_rewards:short_answers"] == pytest.approx(expected)


@pytest.mark.slow
def test_a_job_without_a_kl_term_builds_no_reference_and_runs_no_reference_or_old_policy_pass(user_rewards_run):
    """loss.beta 0 and no KL in the reward: no reference net (no swap group, no checkpoint file, no strategy), no
    `ref` phase, no KL column or metric; with num_iterations 1 the rollout's own log-probs are the old policy's (no
    `old` pass). (Its rewards are a prompt's own token count: equal within each group, so no gradient here.)"""
    from mindspore.dataset import MindDataset

    run = user_rewards_run
    metrics = metrics_lines(run.out)[-1]
    assert metrics["actor/updates"] > 0 and {"actor/pg_loss", "actor/entropy", "actor/grad_norm"} <= set(metrics)
    assert "timing/generate" in metrics and "timing/train" in metrics
    assert not {"timing/ref", "timing/old", "actor/kl_loss"} & set(metrics)
    assert "roles: actor, reward;" in run.log
    record = next(MindDataset(str(run.experience), shuffle=False).create_dict_iterator(output_numpy=True))
    assert "ref_logp" not in record and record["old_logp"].shape == record["response_ids"].shape
    step = run.out / "checkpoints" / "step_000001"
    assert sorted(p.name for p in (step / "rank_0").iterdir()) == ["state.json", "train.ckpt"]
    assert json.loads((step / "rank_0" / "state.json").read_text()).keys() == {"actor", "reward"}


def response_widths(log: str) -> list[tuple[int, int]]:
    """The response widths the passes of a run read, [(W, R)] from its log's "<pass> micro-batches: ... (P + W of R
    tokens"."""
    return [(int(w), int(r)) for w, r in re.findall(r"micro-batches: .*\(\d+ \+ (\d+) of (\d+) tokens", log)]


def default_buckets() -> list[str]:
    """The default's cut of the response widths (tiny/grpo.yaml reads every position)."""
    from mindrlhf.configs.grpo_configs import ScheduleConfig

    return ["--response_buckets", str(ScheduleConfig.response_buckets)]


def one_step_run(mindrecord, out, extra):
    """One step of the tiny job from the bundled checkpoint; returns its metrics, trained weights and the response
    widths its passes read."""
    from mindrlhf.checkpoint.weights import read_weights

    log = logged_run(mindrecord, out, ["--steps", "1", *default_buckets()] + extra)
    return metrics_lines(out)[-1], read_weights(str(out / "checkpoints" / "step_000001")), response_widths(log)


def run_in_train_layout(mindrecord, out, extra=()):
    """Two steps of the tiny job (one model YAML for both nets: the train layout) from the bundled checkpoint with
    the default response widths and a checkpoint after each step; returns what the trainer held (after the last
    step), the metrics lines and the log."""
    seen = {}

    def inspect(trainer, step, metrics):
        from mindrlhf.trainer.roles import TRAIN_WEIGHTS

        actor, swap = trainer.actor, trainer.swap
        seen.update(shares=actor.shares_weights, same_net=actor.infer_net is actor.train_net,
                    groups=swap.groups, bytes=sum(swap.group_bytes(g) for g in swap.groups),
                    train_bytes=swap.group_bytes(TRAIN_WEIGHTS), plan=dict(swap.phase_plan))
    log = logged_run(mindrecord, out, ["--steps", "2", "--num_iterations", "2", "--save_interval", "1",
                                       *default_buckets(), *extra], callbacks=[inspect])
    return seen, metrics_lines(out), log


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory, mindrecord, graph_mode):
    """`run_in_train_layout` with the inference net sharing the train net's weights (the defaults): the job of
    `test_an_infer_net_in_the_train_layout_is_the_train_net`, and its first step the `whole_step` reference."""
    out = tmp_path_factory.mktemp("shared") / "out"
    seen, lines, log = run_in_train_layout(mindrecord, out)
    return SimpleNamespace(out=out, seen=seen, lines=lines, log=log)


@pytest.fixture(scope="module")
def whole_step(shared_run):
    """The reference of the variants below: whole mini-batches that read each prompt once for all of its responses
    and only as many response positions as the longest response needs (the defaults). The first step of
    `shared_run` (the same flags as `one_step_run`'s: the 2 steps, checkpoint after each, change nothing in the
    first; the learning rate is constant): its metrics, its checkpoint's weights and the widths it read."""
    from mindrlhf.checkpoint.weights import read_weights

    first_step_log, separator, _ = shared_run.log.partition("step 1/2 |")
    assert separator, shared_run.log[-3000:]
    assert shared_run.lines[0]["step"] == 1
    return (shared_run.lines[0], read_weights(str(shared_run.out / "checkpoints" / "step_000001")),
            response_widths(first_step_log))


@pytest.mark.slow
@pytest.mark.parametrize("variant,flags", [
    ("micro-batches reading every response position", ["--micro_batch_size_per_device", "2",
                                                       "--log_prob_micro_batch_size_per_device", "2",
                                                       "--response_buckets", "1"]),
    ("each response with its own prompt", ["--share_prompts", "false"]),
])
def test_micro_batches_and_unshared_prompts_train_like_whole_mini_batches(variant, flags, tmp_path, mindrecord,
                                                                           whole_step):
    """--micro_batch_size_per_device (gradient accumulation) and --log_prob_micro_batch_size_per_device (ref
    log-probs a few rows at a time, each prompt read once for the 2 responses of a call) with every one of the
    max_new_tokens positions read (--response_buckets 1), or every response read with its own copy of its prompt
    (--share_prompts false): the same step as `whole_step` (whole mini-batches, each prompt read once for its
    responses, responses cut to their buckets)."""
    whole, whole_weights, whole_widths = whole_step
    other, other_weights, widths = one_step_run(mindrecord, tmp_path / "out", flags)
    assert whole_widths and any(w < r for w, r in whole_widths)  # the default cut the responses' padding
    if "--response_buckets" in flags:
        assert widths and all(w == r for w, r in widths)
    assert other["critic/score/mean"] == whole["critic/score/mean"] and whole["actor/updates"] == 4
    assert whole["reward/frac_zero_std"] < 1 and whole["actor/grad_norm"] > 0  # there was something to learn
    # lr 1e-3 takes the tiny policy far from the reference within the step's 4 updates (kl_loss ~1.6e4): the k3 KL,
    # exp(ref - logp) - (ref - logp) - 1 at log-ratios ~10, turns the float noise of another kernel shape (each
    # response with its own prompt) into ~0.3% of the KL-dominated loss and gradient on CPUs whose kernels round
    # otherwise (AVX2 here); on the machine this was written on the shapes rounded alike and agreed to 1e-4
    for key in ("actor/loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert other[key] == pytest.approx(whole[key], rel=5e-3 if whole["actor/kl_loss"] > 100 else 1e-4,
                                           abs=1e-7), key
    from mindrlhf.checkpoint.weights import read_weights
    start = read_weights(str(TINY_SFT_CKPT))
    assert any(not np.array_equal(whole_weights[n], start[n]) for n in start)
    # 4 AdamW updates at lr 1e-3 (tiny/grpo.yaml, constant): a near-zero gradient's float noise moves its weight
    # by a fraction of lr, so the weights are compared in units of lr * updates (tests/support/tolerances.py)
    # in that KL-dominated regime the noise reaches the weights too (up to ~0.7 of lr * updates for single
    # near-zero-gradient ones, 99.9th percentile 1.6e-3 seen here): every element within what the updates could
    # move it, the bulk within 1% of it (a wrong sum moves most weights by ~lr: 100x that)
    kl_dominated = whole["actor/kl_loss"] > 100
    assert_weights_close_after_adam(other_weights, whole_weights, lr=1e-3, updates=whole["actor/updates"],
                                    what=f"{variant} vs whole", max_fraction=1.0 if kl_dominated else MAX_FRACTION,
                                    typical_fraction=1e-2 if kl_dominated else TYPICAL_FRACTION)


@pytest.mark.slow
def test_held_out_accuracy_before_and_after(user_rewards_run):
    """--eval_dataset_file: greedy accuracy on every held-out prompt before the first step (equal to an
    independent greedy evaluation of the starting policy) and after the last, and the final summary line."""
    import dataclasses

    import mindspore as ms

    from mindrlhf.configs.grpo_configs import GRPOConfig
    from mindrlhf.data.reader import read_prompt_records
    from mindrlhf.generation import Generator
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.models.tokenizer import load_tokenizer
    from mindrlhf.reward.rules import accuracy_reward

    tokenizer = load_tokenizer(TOKENIZER)
    run = user_rewards_run
    out, eval_path, max_new_tokens = run.out, run.eval_path, run.max_new_tokens
    recorded, metrics = metrics_lines(out)
    assert_documented([recorded, metrics])
    before = json.loads((out / "checkpoints" / "step_000001" / "meta.json").read_text())["eval_before"]
    assert recorded["step"] == 0 and recorded["eval/accuracy"] == before and metrics["step"] == 1
    assert (out / "progress.png").read_bytes()[:4] == b"\x89PNG"

    gen = GRPOConfig.from_yaml(TINY / "grpo.yaml").generation
    model = Qwen2ForCausalLM(Qwen2Config.from_yaml(TINY / "model.yaml"))
    ms.load_param_into_net(model, ms.load_checkpoint(str(TINY_SFT_CKPT)), strict_load=True)
    greedy = Generator(model, dataclasses.replace(gen, do_sample=False, num_generations=1,
                                                  max_new_tokens=max_new_tokens,
                                                  eos_token_ids=tokenizer.stop_token_ids,
                                                  pad_token_id=tokenizer.pad_token_id))
    prompts, solutions = read_prompt_records(eval_path)
    out_ids = greedy.generate([p.tolist() for p in prompts])
    completions = tokenizer.batch_decode([ids[mask.astype(bool)].tolist() for ids, mask in
                                          zip(out_ids.response_ids, out_ids.response_mask)], skip_special_tokens=True)
    expected = float(np.mean(accuracy_reward(completions, solutions)))
    assert expected > 0  # the bundled policy solves some of them: the equality below is not 0 == 0
    assert before == pytest.approx(expected), (before, expected)
    assert 0.0 <= metrics["eval/accuracy"] <= 1.0 and "timing/eval" in metrics
    assert f"held-out accuracy: before={100 * before:.1f}% after={100 * metrics['eval/accuracy']:.1f}%" in run.log


@pytest.mark.slow
def test_an_infer_net_in_the_train_layout_is_the_train_net(tmp_path, mindrecord, shared_run):
    """Same model and layout for both nets (one process here): the inference net uses the train net's weights (no
    second copy, no reshard; generation keeps the train weights resident, the moments offloaded), and trains
    exactly like a job whose inference net has weights of its own (an inference checkpoint of its own)."""
    from mindrlhf.trainer.roles import INFER_WEIGHTS, KV_CACHES, OPTIMIZER_MOMENTS, TRAIN_WEIGHTS

    own_infer = tmp_path / "infer_copy.ckpt"
    shutil.copy(TINY_SFT_CKPT, own_infer)
    own, own_lines, _ = run_in_train_layout(mindrecord, tmp_path / "own",
                                            ["--load_sft_checkpoint_infer", str(own_infer)])
    shared, shared_lines = shared_run.seen, shared_run.lines
    assert shared["shares"] and shared["same_net"] and not own["shares"] and not own["same_net"]
    assert INFER_WEIGHTS not in shared["groups"] and INFER_WEIGHTS in own["groups"]
    assert shared["plan"]["generate"] == (TRAIN_WEIGHTS, KV_CACHES) and shared["plan"]["old"] == (TRAIN_WEIGHTS,)
    assert OPTIMIZER_MOMENTS not in shared["plan"]["generate"]
    assert own["bytes"] - shared["bytes"] == own["train_bytes"] > 0  # one copy of the weights less
    assert [a["step"] for a in shared_lines] == [b["step"] for b in own_lines] == [1, 2]
    for a, b in zip(shared_lines, own_lines):
        assert a["actor/updates"] == 4 and a["actor/grad_norm"] > 0
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
                    "actor/grad_norm", "actor/pg_clipfrac"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
