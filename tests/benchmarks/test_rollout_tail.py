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
                                "--bucket", "8", "--eos", *map(str, range(3, 700, 12)), "--min_decode_rows", "0", "2",
                                "--rounds", "2", "--output", str(out)])
    whole, down = result["rows"]
    assert out.exists() and (whole["min_decode_rows"], down["min_decode_rows"]) == (0, 2)
    assert whole["same_responses"] and down["same_responses"]  # the second against the first value's
    assert 1 < whole["mean_length"] < 20  # responses end at different steps: the tail can step down
    assert down["computed_rows"] < whole["computed_rows"]
    assert down["idle_row_share"] < whole["idle_row_share"]
    assert [r["steps"] for r in down["rounds"]] == [r["steps"] for r in whole["rounds"]]
