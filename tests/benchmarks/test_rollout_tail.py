"""benchmarks/rollout_tail.py on the bundled tiny policy: the rollouts with and without stepping down are the same,
and stepping down computes fewer decode rows, fewer of them for responses that had ended."""
import numpy as np
import pytest
from support import paths

from benchmarks import rollout_tail
from mindrlhf.data.mindrecord import write_mindrecord_atomically


@pytest.mark.slow
def test_stepping_down_computes_fewer_rows_for_the_same_responses(tmp_path, graph_mode):
    rng = np.random.default_rng(0)
    prompts = tmp_path / "prompts.mindrecord"
    records = []
    for _ in range(4):
        ids = rng.integers(3, 700, size=int(rng.integers(4, 9)))
        records.append({"prompt_ids": ids, "prompt_length": len(ids), "solution": "", "prompt": "", "columns": "{}"})
    write_mindrecord_atomically(records, prompts, "test prompts")
    configs = paths.MODEL_CONFIGS / "tiny"
    out = tmp_path / "tail.json"
    result = rollout_tail.main(["--infer_yaml", str(configs / "infer.yaml"), "--checkpoint",
                                str(configs / "tiny_sft.ckpt"), "--prompts", str(prompts), "--new_tokens", "24",
                                "--prompts_per_round", "2", "--num_generations", "4", "--temperature", "1.0",
                                "--bucket", "8", "--eos", *map(str, range(3, 700, 12)), "--ladders", "0", "2", "1:0.75",
                                "--rounds", "2", "--output", str(out)])
    whole, down, fine = result["rows"]
    assert out.exists() and (whole["min_decode_rows"], down["min_decode_rows"]) == (0, 2)
    assert (whole["row_counts"], down["row_counts"], fine["row_counts"]) == ([8], [8, 4, 2], [8, 6, 5, 4, 3, 2, 1])
    # the tiny model, a row: 2 layers x keys and values x 2 kv heads x (8 + 24) slots x 16 dims x 4 bytes
    assert fine["kv_cache_gib"] * 2**30 == pytest.approx(29 * 2 * 2 * 2 * 32 * 16 * 4)
    assert all(r["same_responses"] for r in result["rows"])  # each against the first ladder's
    assert 1 < whole["mean_length"] < 20  # responses end at different steps: the tail can step down
    assert down["computed_rows"] < whole["computed_rows"]
    assert down["idle_row_share"] < whole["idle_row_share"]
    assert fine["computed_rows"] < down["computed_rows"] and fine["idle_row_share"] < down["idle_row_share"]
    assert [r["steps"] for r in down["rounds"]] == [r["steps"] for r in whole["rounds"]]
