"""`MODEL=arith_tools bash run_grpo.sh`, the README's tool job, shortened: the bundled tool-using policy on products of
3-digit numbers through msrun (train dp=2; here the inference net in tp=2, resharded each step, its tp group's first
rank calling the tools for both), each response free to call the built-in calculator once, with DAPO's dynamic
sampling (a second round of prompts when the first leaves too few groups whose rewards differ) and each step's
experience saved. The calls run, their answers come back as the chat template's tool turn (the completions'
segments), the step's turns and calls are logged over every round's responses, the saved experience holds every
round's responses and the groups kept are those whose rewards differ, and a resumed job calls the tools again with
the same inputs and samples the same rounds: its steps equal the straight run's."""
import json
import re
import shutil

import numpy as np
import pytest
import yaml
from support.jobs import without_timing
from support.msrun import free_port, run_command
from support.paths import ROOT, RUN_GRPO

from mindrlhf.tool_use import calculator, parse_tool_calls
from mindrlhf.tool_use.turns import CUT

pytestmark = pytest.mark.msrun

STEPS, SAVED = 2, 1
PROMPTS = 4  # a step's prompts: the shipped job's 8 halved (half the rollout and the update), each sampled as shipped
GENERATIONS = yaml.safe_load((ROOT / "model_configs" / "arith_tools" / "grpo.yaml").read_text())["generation"][
    "num_generations"]
RESPONSES = PROMPTS * GENERATIONS  # a sampling round's
TRAIN_DP = 2  # the shipped train.yaml's data parallel
FLAGS = ["--steps", str(STEPS), "--eval_interval", "0", "--log_completions", "true", "--batch_size", str(PROMPTS),
         "--dynamic_sampling", "true", "--max_sampling_retries", "1"]
HELDOUT_PROMPTS = 8  # of the shipped held-out set's 200: the tests read the accuracy line, not its value


def job_env(out, infer_yaml, **extra) -> dict:
    import os

    return dict(os.environ, MODEL="arith_tools", OUTPUT=str(out), MASTER_PORT=str(free_port()), GLOG_v="3",
                INFER_YAML=str(infer_yaml), **extra)


def records(path, steps=None) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if steps is None or r["step"] in steps]


def experience(saved, step) -> list[dict]:
    """The rows of a step's saved experience (`--save_data_file saved`)."""
    from mindspore.dataset import MindDataset

    return list(MindDataset(f"{saved}.step_{step:06d}.mindrecord", shuffle=False)
                .create_dict_iterator(output_numpy=True))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arith_tools")
    shipped = (ROOT / "model_configs" / "arith_tools" / "infer.yaml").read_text()
    assert "  data_parallel: 2\n  model_parallel: 1\n" in shipped
    infer_yaml = folder / "infer_tp2.yaml"
    infer_yaml.write_text(shipped.replace("  data_parallel: 2\n  model_parallel: 1\n",
                                          "  data_parallel: 1\n  model_parallel: 2\n"))
    heldout = folder / "heldout.jsonl"
    shipped_heldout = ROOT / "examples" / "qwen_grpo_tutorial" / "data" / "tool_arithmetic_heldout.jsonl"
    heldout.write_text("".join(shipped_heldout.read_text().splitlines(keepends=True)[:HELDOUT_PROMPTS]))
    out, saved = folder / "out", folder / "exp" / "tools"
    proc = run_command(["bash", str(RUN_GRPO), *FLAGS, "--save_interval", str(SAVED), "--save_data_file", str(saved)],
                       job_env(out, infer_yaml, EVAL_DATA=str(heldout)), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout, infer_yaml, saved


def step_records(out) -> list[dict]:
    return [r for r in records(out / "metrics.jsonl") if r["step"] >= 1 and "tool/calls" in r]


def test_the_tool_job_calls_the_calculator_and_reads_its_answers(run):
    """The tool turns hold the calculator's answers to the calls the model wrote; the step's turns, calls and
    completions are every sampling round's responses."""
    out, stdout, _, _ = run
    assert "infer layout dp=1 x tp=2" in stdout, stdout[-2000:]
    assert re.search(r"held-out accuracy: before=\d+\.\d% after=\d+\.\d%", stdout), stdout[-2000:]
    assert "held-out accuracy before training: " in stdout and f"% ({HELDOUT_PROMPTS} prompts)" in stdout
    steps = step_records(out)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        responses = RESPONSES * r["sampling/rounds"]  # the metrics read every round's responses, kept or not
        assert len(records(out / "completions.jsonl", {r["step"]})) == responses
        assert r["tool/calls"] > 0 and r["num_turns/max"] == 2 and r["num_turns/min"] == 1
        assert r["tool/call_share"] == pytest.approx(r["tool/calls"] / responses)  # one call at most a response
        assert r["num_turns/mean"] == pytest.approx(1 + r["tool/call_share"])
        assert r["timing/tools"] < r["timing/generate"]
    called = [r for r in records(out / "completions.jsonl") if len(r["segments"]) == 3]
    assert len(called) == sum(r["tool/calls"] for r in steps)
    for r in called:
        first, tool, last = r["segments"]
        assert (first["role"], tool["role"], last["role"]) == ("assistant", "tool", "assistant")
        (call,) = parse_tool_calls(first["text"])
        # the tool turn holds the calculator's answer to the call the model wrote (an error text for a malformed
        # one), and rewards read the whole text
        answer = calculator(**call.arguments) if call.error is None else f"error: {call.error}"
        framed = re.fullmatch(r"\nuser\n<tool_response>\n(.*)\n</tool_response>\nassistant\n", tool["text"], re.S)
        shown = framed.group(1)
        assert shown == answer or (shown.endswith(CUT) and answer.startswith(shown[:-len(CUT)])), (shown, answer)
        assert r["completion"].startswith(first["text"]) and r["completion"].endswith(last["text"])
        # the model's own tokens: the length and the advantage leave the tool turn out
        assert r["response_length"] < len(r["completion"])


def test_a_resumed_tool_job_gives_the_straight_runs_steps(run, tmp_path):
    """Resumed from the straight run's first checkpoint with the same flags, the job's later steps give the same
    metrics (the sampling rounds and the kept groups included), completions and saved experience."""
    straight, _, infer_yaml, straight_saved = run
    out, saved = tmp_path / "out", tmp_path / "exp" / "tools"
    step_dir = f"step_{SAVED:06d}"
    shutil.copytree(straight / "checkpoints" / step_dir, out / "checkpoints" / step_dir)
    proc = run_command(["bash", str(RUN_GRPO), *FLAGS, "--save_data_file", str(saved), "--resume"],
                       job_env(out, infer_yaml, EVAL_DATA=""), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    later = set(range(SAVED + 1, STEPS + 1))

    def step_metrics(path):  # the straight run also evaluates after its last step
        return [{k: v for k, v in without_timing(r).items() if not k.startswith("eval/")}
                for r in records(path, later)]

    assert len(step_metrics(out / "metrics.jsonl")) == STEPS - SAVED
    assert step_metrics(out / "metrics.jsonl") == step_metrics(straight / "metrics.jsonl")
    assert records(out / "completions.jsonl", later) == records(straight / "completions.jsonl", later)
    for step in sorted(later):
        resumed, straight_rows = experience(saved, step), experience(straight_saved, step)
        assert len(resumed) == len(straight_rows)
        for a, b in zip(resumed, straight_rows):
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), step


def test_dynamic_sampling_keeps_the_tool_turns_of_every_round(run):
    """DAPO's dynamic sampling on the tool job (the whole rollout gathered, its rounds concatenated): the saved
    experience of each step holds every round's responses with their model-token mask (`loss_mask`), which gives the
    step's logged lengths and calls; the kept groups are those whose rewards differ. The job retries (a second round)
    on some step."""
    from mindrlhf.algorithms import dynamic_sampling_mask
    from mindrlhf.engine.batches import group_unit

    out, _, _, saved = run
    steps = step_records(out)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    rounds = [r["sampling/rounds"] for r in steps]
    assert set(rounds) <= {1, 2} and 2 in rounds  # one retry at most (--max_sampling_retries 1), and one was made
    for metrics in steps:
        rows = experience(saved, metrics["step"])
        assert len(rows) == RESPONSES * metrics["sampling/rounds"]
        model, whole = (np.stack([r[name] for r in rows]) for name in ("loss_mask", "response_mask"))
        assert ((model == 0) | (whole == 1)).all()
        assert model.sum(1).mean() == pytest.approx(metrics["response_length/mean"])
        called = model.sum(1) < whole.sum(1)  # a tool turn's tokens are in the response, not the model's
        assert called.sum() == metrics["tool/calls"] > 0
        rewards = np.array([float(r["reward"]) for r in rows])
        differing = int(sum(dynamic_sampling_mask(part, GENERATIONS).sum()
                            for part in np.split(rewards, metrics["sampling/rounds"])))
        kept = min(differing, PROMPTS)
        assert metrics["sampling/kept_groups"] == kept - kept % group_unit(GENERATIONS, TRAIN_DP)
