"""Tensor and data parallel runs of a tiny Qwen2 equal the one-process run (msrun, CPU)."""
import numpy as np
import pytest

from msrun_utils import load_ranks, run_worker

pytestmark = pytest.mark.msrun
TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    run_worker("spmd_equivalence.py", ["--out", str(out)], 1, out / "log")
    return load_ranks(out, 1)[0]


def assemble(ranks, dp, tp, key):
    """Full tensor of `key` from per-rank shards (tp-split along the recorded axis, dp replicas equal)."""
    name = key.split("/", 1)[1]
    axis = int(ranks[0][f"axis/{name}"])
    replicas = []
    for d in range(dp):
        shards = [ranks[d * tp + t][key] for t in range(tp)]
        replicas.append(np.concatenate(shards, axis=axis) if axis >= 0 else shards[0])
        if axis < 0:
            for s in shards[1:]:
                np.testing.assert_allclose(s, shards[0], atol=TOL, err_msg=f"{key}: tp replicas differ")
    for r in replicas[1:]:
        np.testing.assert_allclose(r, replicas[0], atol=TOL, err_msg=f"{key}: dp replicas differ")
    return replicas[0]


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 1), (2, 2)], ids=["tp2", "dp2", "dp2xtp2"])
def test_parallel_run_matches_single_process(reference, tmp_path, dp, tp):
    world = dp * tp
    run_worker("spmd_equivalence.py", ["--dp", str(dp), "--tp", str(tp), "--out", str(tmp_path)], world,
               tmp_path / "log")
    ranks = load_ranks(tmp_path, world)
    logits = np.concatenate([ranks[d * tp]["logits"] for d in range(dp)], axis=0)
    np.testing.assert_allclose(logits, reference["logits"], atol=TOL)
    losses = np.mean([ranks[d * tp]["losses"] for d in range(dp)], axis=0)
    np.testing.assert_allclose(losses, reference["losses"], atol=TOL)
    grad_keys = [k for k in reference if k.startswith("grad/")]
    assert len(grad_keys) > 20
    for key in grad_keys:
        np.testing.assert_allclose(assemble(ranks, dp, tp, key), reference[key], atol=TOL, err_msg=key)
    for key in (k for k in reference if k.startswith("weight/")):
        np.testing.assert_allclose(assemble(ranks, dp, tp, key), reference[key], atol=TOL, err_msg=key)
