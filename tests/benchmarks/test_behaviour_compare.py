"""benchmarks/behaviour.py: the comparison that shows a refactor changed no metric (timings and throughput left out,
NaN equal to NaN, a metric present on one side only counted as a difference)."""
import json

from benchmarks import behaviour


def write(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_only_non_timing_metrics_are_compared_and_every_difference_is_named(tmp_path):
    before = [{"step": 0, "eval/accuracy": 0.125, "timing/eval": 1.0},
              {"step": 1, "critic/score/mean": 0.5, "actor/kl_loss": float("nan"), "timing/step": 2.0,
               "e2e_tps": 10.0, "memory/peak_gib_after_train": 1.0}]
    after = [{"step": 0, "eval/accuracy": 0.125, "timing/eval": 9.0},
             {"step": 1, "critic/score/mean": 0.5, "actor/kl_loss": float("nan"), "timing/step": 3.0,
              "e2e_tps": 20.0, "memory/peak_gib_after_train": 2.0}]
    write(tmp_path / "a" / "grpo" / "metrics.jsonl", before)
    write(tmp_path / "b" / "grpo" / "metrics.jsonl", after)
    old, new = (behaviour.read_metrics(tmp_path / side / "grpo" / "metrics.jsonl") for side in "ab")
    assert old == {0: {"eval/accuracy": 0.125},
                   1: {"critic/score/mean": 0.5, "actor/kl_loss": old[1]["actor/kl_loss"]}}
    assert behaviour.differences(old, new) == []
    assert behaviour.compare(tmp_path / "a", tmp_path / "b", tmp_path / "r.json") == 0

    after[1]["critic/score/mean"] = 0.5000001
    after[1]["critic/vf_loss"] = 1.0
    write(tmp_path / "b" / "grpo" / "metrics.jsonl", after)
    new = behaviour.read_metrics(tmp_path / "b" / "grpo" / "metrics.jsonl")
    assert behaviour.differences(old, new) == ["step 1 critic/score/mean: 0.5 -> 0.5000001",
                                               "step 1 critic/vf_loss: only in after"]
    assert behaviour.compare(tmp_path / "a", tmp_path / "b", tmp_path / "r.json") == 1
    differences = json.loads((tmp_path / "r.json").read_text())["jobs"]["grpo"]["differences"]
    assert differences[0].startswith("step 1 critic/score/mean")
