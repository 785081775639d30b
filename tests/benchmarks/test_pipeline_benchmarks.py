"""The pipeline benchmarks run (msrun, tiny shape) and measure what they say: the memory benchmark's stages hold
their layers and the tied embedding, the reshard benchmark's pp2 route equals the offline transform."""
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
def test_reshard_benchmark_from_pipeline_stages_equals_the_offline_route(tmp_path):
    code = benchmark("reshard").main(["--src", "pp2", "--models", "tiny", "--dtypes", "float16", "--repeats", "1",
                                      "--workdir", str(tmp_path), "--output", str(tmp_path / "out.json")])
    assert code == 0
    import json
    (case,) = json.loads((tmp_path / "out.json").read_text())["cases"]
    assert case["bit_identical"] and case["all_gather_floor_seconds"] > 0
    assert case["online_stats_rank0"]["bytes_sent"] > 0
