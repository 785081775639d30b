"""Generation with a tensor-parallel inference net (KV cache split by kv heads) equals one process."""
import numpy as np
import pytest
from msrun_utils import load_ranks, run_worker

pytestmark = pytest.mark.msrun


def test_tp2_generation_equals_single_process(tmp_path):
    run_worker("generation_worker.py", ["--out", str(tmp_path / "ref")], 1, tmp_path / "ref_log")
    run_worker("generation_worker.py", ["--tp", "2", "--out", str(tmp_path / "tp2")], 2, tmp_path / "tp2_log")
    (ref,) = load_ranks(tmp_path / "ref", 1)
    ranks = load_ranks(tmp_path / "tp2", 2)
    assert ref["sampled_mask"].sum() > 12  # something was generated
    assert len({tuple(row) for row in ref["sampled"]}) > 3  # and the samples differ from one another
    for rank, got in enumerate(ranks):
        np.testing.assert_array_equal(got["greedy"], ref["greedy"], err_msg=f"rank {rank} greedy")
        np.testing.assert_array_equal(got["sampled"], ref["sampled"], err_msg=f"rank {rank} sampled")
        np.testing.assert_array_equal(got["sampled_mask"], ref["sampled_mask"])
        np.testing.assert_allclose(got["log_probs"], ref["log_probs"], atol=1e-5)
