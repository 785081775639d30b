"""The pipeline benchmarks run (msrun, tiny shape) and measure what they say: the memory benchmark's stages hold
their layers and the tied embedding, the reshard benchmark reports both routes from a pp2 source."""
import importlib.util
import os

import pytest
from support.paths import BENCHMARKS

from mindrlhf.parallel.host_setup import threads_per_rank


def benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.msrun
def test_pipeline_memory_benchmark_splits_the_weights_by_stage_on_either_schedule(tmp_path):
    result = benchmark("pipeline_memory").main(["--model", "tiny", "--steps", "2", "--workdir", str(tmp_path),
                                                "--output", str(tmp_path / "out.json")])
    (whole,), stages, no_overlap = result["layouts"].values()
    # the same updates on either schedule, on both stages
    for ranks in (stages, no_overlap):
        norms = [r["grad_norms"] for r in ranks]
        assert norms[0] == norms[1] and len(norms[0]) == 2 and norms[0][0] > 0
    assert [r["grad_norms"] for r in stages] == [r["grad_norms"] for r in no_overlap]
    cores = len(os.sched_getaffinity(0))  # the two ranks share this host's cores, as the trainer's would
    assert [r["kernel_threads"] for r in stages] == [threads_per_rank(cores, 2)] * 2
    if cores >= 2:  # and each keeps to its own cores
        assert not set(stages[0]["cores"]) & set(stages[1]["cores"]) and whole["cores"] is None
    assert whole["layers"] == [0, 1, 2, 3] and [r["layers"] for r in stages] == [[0, 1], [2, 3]]
    assert all(r["holds_embedding"] for r in stages)  # tied: the last stage scores with its copy
    embedding = 96 * 32 * 4
    weights = [r["held_bytes"]["weights"] for r in stages]
    assert sum(weights) == whole["held_bytes"]["weights"] + embedding
    for r in (whole, *stages):  # two moments per weight, and the step counter
        assert r["held_bytes"]["adam_moments"] == 2 * r["held_bytes"]["weights"] + 8
    assert 0.5 < result["ratios"]["largest stage's weights + moments / the whole net's"] < 0.6
    assert (tmp_path / "out.json").exists()


@pytest.mark.msrun
def test_reshard_benchmark_from_pipeline_stages_reports_both_routes(tmp_path, capsys):
    """The reshard benchmark with a pp2 source (one launch, its smallest case) runs both routes and reports them:
    the JSON and the table, with numbers that can be true. That the online reshard from pipeline stages equals
    MindSpore's `transform_checkpoints` bit for bit is proven on the tensors themselves, independently of this
    benchmark, by tests/parallel/test_reshard.py::test_online_reshard_from_pipeline_stages_equals_transform_checkpoints
    (pp2->dp2 and pp2->dp2-tied-fp16 among its cases); `bit_identical` here is only the benchmark's own comparison of
    its two routes, which its table reports."""
    code = benchmark("reshard").main(["--src", "pp2", "--models", "tiny", "--dtypes", "float16", "--repeats", "1",
                                      "--workdir", str(tmp_path), "--output", str(tmp_path / "out.json")])
    assert code == 0
    import json
    import math
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["layout"]["src"].startswith("pp2") and result["workers"] == 2 and result["repeats"] == 1
    (case,) = result["cases"]
    assert case["model"] == "tiny" and case["dst_dtype"] == "float16" and case["parameters"] > 0
    assert case["bit_identical"] and case["all_gather_floor_seconds"] > 0
    assert case["online_stats_rank0"]["bytes_sent"] > 0
    for route in ("online", "offline"):
        assert 0 < case[route]["seconds_median"] < 600, route
        assert [len(seconds) for seconds in case[route]["seconds_per_rank"]] == [1, 1], route
        assert all(moved > 0 for moved in case[route]["bytes_moved_per_rank"]), route
        assert all(peak > 0 for peak in case[route]["peak_rss_mib_per_rank"]), route
    assert math.isclose(case["speedup"], case["offline"]["seconds_median"] / case["online"]["seconds_median"])
    assert case["plan_seconds"] >= 0 and case["first_run_seconds"] > 0
    table = capsys.readouterr().out
    assert "online reshard vs offline transform, pp2" in table and "online == offline bit for bit: True" in table
    rows = [line.split() for line in table.splitlines() if line.startswith("tiny ") and "float16" in line.split()]
    assert [row[3] for row in rows] == ["online", "offline"], table  # a row per route
