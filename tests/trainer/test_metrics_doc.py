"""docs/metrics.md is one table of every metric the trainer writes, one row per name (as
tests/configs/test_yaml_keys.py checks docs/yaml_keys.md): the metrics.jsonl of a step written by the trainer's own
metric code on stand-in roles has a row for each of its keys and no row names a metric nothing writes; the
one-process runs of test_grpo_cli.py and test_ppo.py (and the msrun job of test_grpo_trainer.py) check their
metrics.jsonl with `assert_documented` too (tests/support/metrics_doc.py)."""
import re

import numpy as np
import pytest
from support.metrics_doc import DOC, assert_documented, metric_rows, name_pattern
from support.paths import DOCS

# written only where a stand-in cannot reach (the rounds of `ExperienceMaker.make`); test_grpo_cli's dynamic-sampling
# run writes both and checks them with `assert_documented`
WRITTEN_BY_RUNS_ONLY = {"sampling/rounds", "sampling/kept_groups"}
# the stages' before RL, which tests/trainer/test_stages.py's runs check with `assert_documented`
WRITTEN_BY_RUNS_ONLY |= {f"{stage}/{name}" for stage in ("sft", "reward_model", "dpo")
                         for name in ("loss", "grad_norm", "lr", "updates", "skipped_updates", "trained_tokens")}
WRITTEN_BY_RUNS_ONLY |= {"reward_model/accuracy", "reward_model/margin", "reward_model/rewards/chosen",
                         "reward_model/rewards/rejected", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                         "rewards/margins", "logps/chosen", "logps/rejected"}


def stand_in_trainer():
    """An `RLTrainer` whose metric code runs on stand-ins: a PPO job with the KL in the reward, a held-out
    evaluation and every phase of a step timed (no net is built)."""
    import time
    from types import SimpleNamespace

    import numpy as np

    from mindrlhf.algorithms import build_kl_controller
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.parallel.swap import SwapManager
    from mindrlhf.trainer.phases import PHASES, Phases
    from mindrlhf.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer.__new__(RLTrainer)
    trainer.num_generations, trainer.world_size, trainer.critic = 2, 2, True
    trainer.generation = SimpleNamespace(eos_token_ids=[1])
    trainer.infer_layout = Layout(dp=2, rank=0)
    trainer.kl_ctrl = build_kl_controller("adaptive", 0.001, 0.1, 10000)
    trainer.comm = SimpleNamespace(all_gather=lambda array: np.concatenate([array, 2 * array]))
    trainer.evaluate = lambda: {"accuracy": 0.5, "hash_format": 0.25}
    trainer.phases = Phases(SwapManager(), {name: () for name in PHASES})
    trainer.phases.start_step()
    for name in PHASES:
        if name != "eval":  # the evaluation runs between steps
            with trainer.phases(name):
                time.sleep(0.001)  # phase times are kept to 0.1 ms
    return trainer


def tool_columns(exp) -> dict:
    """A multi-turn rollout's columns for `exp`'s rows: the second response token of each row was a tool's."""
    tool_mask = np.zeros_like(exp.response_mask)
    tool_mask[:, 1] = exp.response_mask[:, 1]
    columns = {"loss_mask": exp.response_mask * (1 - tool_mask), "num_turns": 1 + tool_mask.sum(1)}
    columns.update({f"tool/{name}": tool_mask.sum(1) for name in ("calls", "errors", "timeouts", "truncated")})
    return columns


def written_records(folder) -> list[dict]:
    """metrics.jsonl of the evaluation before training and of one step of the stand-in trainer, whose actor and
    critic are training engines on stand-in train steps (tests/support/fake_engines.py)."""
    from support.experience import make_experience, with_critic_columns
    from support.fake_engines import ACTOR_INPUTS, CRITIC_INPUTS, role_with_engine

    from mindrlhf.algorithms.policy_cells import GRPOLossNet, ValueLossNet
    from mindrlhf.engine.batches import RankRows
    from mindrlhf.trainer.experience_maker import StepBatch
    from mindrlhf.trainer.metrics import MetricsWriter, row_statistics
    from mindrlhf.trainer.plot import read_metrics
    from mindrlhf.trainer.roles import Actor, Critic

    exp = with_critic_columns(make_experience(8, 3, 4))
    exp = exp.with_columns(**{"reward/format": exp.rewards}, **tool_columns(exp))
    trainer = stand_in_trainer()
    share = RankRows.of_batch(exp, 1, 0, exp.num_rows)
    updates = role_with_engine(Actor, "actor", [1.0] * 4, 2, ACTOR_INPUTS, GRPOLossNet.OUTPUTS).train(share)
    updates.update(role_with_engine(Critic, "critic", [1.0] * 4, 2, CRITIC_INPUTS, ValueLossNet.OUTPUTS).train(share))
    updates.update(trainer._update_kl_controller(exp))
    # decode rows computed, idle; 3 answer checks past their limit on this rank (6 on the other)
    # and 0.5 s in tool calls (1 s on the other)
    batch = StepBatch(row_statistics(exp, [1]), exp, True, {}, 100, {}, (40, 15), 3, 0.5)
    metrics = trainer._step_metrics(batch, updates, elapsed=2.0, updated_tokens=100)
    metrics.update(trainer._eval_metrics())
    writer = MetricsWriter(str(folder))
    writer.record(0, trainer._eval_metrics())
    writer.write(1, 1, metrics)
    return read_metrics(str(folder / "metrics.jsonl"))


def test_every_metric_written_has_one_row_and_every_row_is_written(tmp_path):
    records = written_records(tmp_path)
    assert_documented(records)
    written = {key for record in records for key in record} | WRITTEN_BY_RUNS_ONLY
    for key in ("critic/score/max", "actor/ppo_kl", "actor/reward_kl_penalty", "critic/vf_clipfrac", "e2e_tps",
                "update_tps", "vllm_tps", "prompt_length/min", "timing/values", "eval/hash_format", "step"):
        assert key in written, key  # the stand-ins reach every kind of metric
    step = next(record for record in records if record.get("step") == 1 and "timing/step" in record)
    # this rank's rows and a second rank's twice as many (the stand-in all_gather): (15 + 30) / (40 + 80)
    assert step["perf/idle_decode_rows"] == 0.375
    assert step["reward/answer_check_timeouts"] == 3 + 6  # both ranks own rows (infer dp=2)
    assert 0.0005 < step["timing/generate_spread"] < 1  # the second rank's generate phase took twice as long
    # a tool turn of one token in every response: its turns and calls, lengths of the model's own tokens only
    from support.experience import make_experience

    mask = make_experience(8, 3, 4).response_mask
    called = mask[:, 1]  # the responses of 2 tokens or more
    assert 0 < called.sum() < len(mask)  # the case needs responses with and without a call
    assert step["tool/calls"] == step["tool/errors"] == called.sum() and step["tool/call_share"] == called.mean()
    assert step["num_turns/max"] == 2 and step["num_turns/mean"] == 1 + called.mean() and step["timing/tools"] == 1.0
    assert step["response_length/mean"] == pytest.approx((mask.sum(1) - called).mean())
    never = [name for name in metric_rows() if not any(name_pattern(name).match(key) for key in written)]
    assert not never, f"rows of docs/metrics.md for metrics nothing writes: {never}"


def test_every_phase_has_its_timing_row():
    from mindrlhf.trainer.phases import PHASES

    rows = metric_rows()
    assert [name for name in PHASES if f"timing/{name}" not in rows] == []


def test_the_rows_marked_log_line_are_what_the_log_line_shows():
    from mindrlhf.trainer.metrics import LINE_METRICS

    on_the_line = {name for name, (where, *_) in metric_rows().items() if "log line" in where}
    assert on_the_line == {"step", *LINE_METRICS, "reward/<fn>", "eval/<score>"}


def test_the_documented_log_line_is_what_the_trainer_prints():
    from mindrlhf.trainer.metrics import LINE_UNITS, step_line

    example = re.search(r"```\n(step .*)\n```", DOC.read_text(encoding="utf-8")).group(1)
    parts = example.split(" | ")
    metrics = {}
    for part in parts[1:]:
        name, value = part.split(" ")[:2]
        metrics[name] = float(value)
    step, total = map(int, parts[0].split(" ")[1].split("/"))
    assert step_line(step, total, metrics) == example
    assert all(f"{name} {metrics[name]:.4g} {unit}" in example for name, unit in LINE_UNITS.items())


def test_a_value_that_is_not_a_finite_number_is_null_in_the_jsonl(tmp_path, caplog):
    """Strict JSON readers refuse a bare NaN: metrics.jsonl says null; the log line still says nan."""
    import json
    import logging

    from mindrlhf.trainer.metrics import MetricsWriter

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    writer = MetricsWriter(str(tmp_path))
    with caplog.at_level(logging.INFO, "mindrlhf.trainer"):
        writer.write(1, 2, {"critic/score/mean": 0.5, "reward/format": float("nan"), "actor/grad_norm": float("inf"),
                            "reward/accuracy": np.float32(0.25), "actor/updates": 2})
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line, parse_constant=refuse) == {"step": 1, "critic/score/mean": 0.5, "reward/format": None,
                                                       "actor/grad_norm": None, "reward/accuracy": 0.25,
                                                       "actor/updates": 2}
    assert "actor/grad_norm inf | " in caplog.text and "reward/format nan" in caplog.text


def test_the_metrics_a_resumed_run_need_not_give_again_are_listed_in_the_docs():
    from support.jobs import without_timing

    from mindrlhf.trainer.metrics import MACHINE_METRICS, NOT_REPRODUCED_ON_RESUME

    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## What a resumed run gives again"):]
    listed = re.findall(r"`([\w/]+)(?:\*)?`", "\n".join(line for line in section.splitlines() if line.startswith("- ")))
    assert sorted(listed) == sorted(name for name in NOT_REPRODUCED_ON_RESUME)
    assert "swap/bytes_moved" in NOT_REPRODUCED_ON_RESUME and set(MACHINE_METRICS) < set(NOT_REPRODUCED_ON_RESUME)
    step = {"critic/score/mean": 0.5, "swap/bytes_moved": 10, "timing/step": 1.0, "e2e_tps": 3.0, "perf/x": 1}
    assert without_timing(step) == {"critic/score/mean": 0.5}


@pytest.mark.parametrize("old", ["timing_s/", "reward/mean", "reward/std", "actor/kl`", "actor/clipfrac",
                                 "perf/tokens_per_s", "tokens_per_s_per_device"])
def test_no_old_name_is_left_in_the_docs(old):
    """The names before MindSpeed-RL's (verl's own names, in the table's last column, may look alike)."""
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        if path == DOC:
            text = "\n".join(line.rsplit("|", 2)[0] if line.startswith("| `") else line for line in text.splitlines())
        assert old not in text, f"{path.name} still names {old}"
