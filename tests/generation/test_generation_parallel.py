"""Generation with a tensor-parallel inference net (KV cache split by kv heads, or shared when tp exceeds them)
equals one process, tool turns included (one rank of the tp group calls the tools)."""
import numpy as np
import pytest
from support.msrun import load_ranks, run_worker

pytestmark = pytest.mark.msrun


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("generation_ref")
    run_worker("generation_worker.py", ["--out", str(out / "ref")], 1, out / "ref_log")
    return load_ranks(out / "ref", 1)[0]


@pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4-over-2-kv-heads"])
def test_tensor_parallel_generation_equals_single_process(one_process, tmp_path, tp):
    """tp=4 on the 2-kv-head model: each rank caches only the kv head its query heads use (shared by 2 ranks)."""
    ref = one_process
    run_worker("generation_worker.py", ["--tp", str(tp), "--out", str(tmp_path / "tp")], tp, tmp_path / "tp_log")
    ranks = load_ranks(tmp_path / "tp", tp)
    assert ref["sampled_mask"].sum() > 12  # something was generated
    assert len({tuple(row) for row in ref["sampled"]}) > 3  # and the samples differ from one another
    for rank, got in enumerate(ranks):
        np.testing.assert_array_equal(got["greedy"], ref["greedy"], err_msg=f"rank {rank} greedy")
        np.testing.assert_array_equal(got["sampled"], ref["sampled"], err_msg=f"rank {rank} sampled")
        np.testing.assert_array_equal(got["sampled_mask"], ref["sampled_mask"])
        np.testing.assert_allclose(got["log_probs"], ref["log_probs"], atol=1e-5)
        # each rank's handler answers with its rank in the tokens: every rank appended rank 0's tool turns
        np.testing.assert_array_equal(got["tool_rollout"], ref["tool_rollout"], err_msg=f"rank {rank} tool turns")
        assert got["tool_salts"].tolist() == [0] * len(ref["tool_salts"])
    assert ref["tool_mask"].sum() > 6 and ref["tool_salts"].size > 3  # tool turns were taken
