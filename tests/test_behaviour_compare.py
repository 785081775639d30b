"""benchmarks/behaviour.py: the comparison that shows a refactor changed no metric (timings left out, NaN equal to
NaN, a metric present on one side only counted as a difference)."""
import json

from benchmarks import behaviour


def write(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_only_non_timing_metrics_are_compared_and_every_difference_is_named(tmp_path):
    before = [{"step": 0, "eval/accuracy": 0.125, "timing_s/eval": 1.0},
              {"step": 1, "reward/mean": 0.5, "actor/kl": float("nan"), "timing_s/step": 2.0,
               "perf/tokens_per_s_per_device": 10.0, "memory/peak_gib_after_train": 1.0}]
    after = [{"step": 0, "eval/accuracy": 0.125, "timing_s/eval": 9.0},
             {"step": 1, "reward/mean": 0.5, "actor/kl": float("nan"), "timing_s/step": 3.0,
              "perf/tokens_per_s_per_device": 20.0, "memory/peak_gib_after_train": 2.0}]
    write(tmp_path / "a" / "grpo" / "metrics.jsonl", before)
    write(tmp_path / "b" / "grpo" / "metrics.jsonl", after)
    old, new = (behaviour.read_metrics(tmp_path / side / "grpo" / "metrics.jsonl") for side in "ab")
    assert old == {0: {"eval/accuracy": 0.125}, 1: {"reward/mean": 0.5, "actor/kl": old[1]["actor/kl"]}}
    assert behaviour.differences(old, new) == []
    assert behaviour.compare(tmp_path / "a", tmp_path / "b", tmp_path / "r.json") == 0

    after[1]["reward/mean"] = 0.5000001
    after[1]["critic/vf_loss"] = 1.0
    write(tmp_path / "b" / "grpo" / "metrics.jsonl", after)
    new = behaviour.read_metrics(tmp_path / "b" / "grpo" / "metrics.jsonl")
    assert behaviour.differences(old, new) == ["step 1 critic/vf_loss: only in after",
                                               "step 1 reward/mean: 0.5 -> 0.5000001"]
    assert behaviour.compare(tmp_path / "a", tmp_path / "b", tmp_path / "r.json") == 1
    assert json.loads((tmp_path / "r.json").read_text())["jobs"]["grpo"]["differences"][1].startswith("step 1 reward")
