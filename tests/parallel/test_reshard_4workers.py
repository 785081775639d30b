"""Online reshard on 4 workers (tp4 <-> dp2 x tp2), bit-equal with `transform_checkpoints`.

tp4 -> dp2 x tp2 crosses the whole world (AllGather path) and lands on half-shards; dp2 x tp2 -> tp4
moves within each tp pair (AllReduce path on sub-groups). The packing threshold is shrunk so that both
paths pack small moves into one collective call and send larger ones alone. Each run also fills a
second destination net: bfloat16 (oracle: the float32 transform result cast to bfloat16 by MindSpore; on
CPU it travels as float32 and is written with set_data, CPU having no bfloat16 collective or Assign kernel)
or float16 (travels as float16).
"""
import os

import numpy as np
import pytest
from support.checkpoints import rename_strategy, transform_oracle
from support.msrun import run_worker

from mindrlhf.parallel.strategy import read_strategy_file

WORKERS = 4


def oracle_tensors(oracle_dir, rank: int) -> dict[str, np.ndarray]:
    import mindspore as ms
    rank_dir = oracle_dir / f"rank_{rank}"
    newest = sorted(os.listdir(rank_dir))[-1]
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(str(rank_dir / newest)).items()}


def as_dtype_like_mindspore(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` cast to `dtype` by MindSpore (float32 -> bfloat16 rounds to nearest even), as float32 for bf16."""
    import mindspore as ms
    if dtype == "bfloat16":
        return ms.Tensor(values, ms.bfloat16).astype(ms.float32).asnumpy()
    return values.astype(getattr(np, dtype))


# elements a rank sends per element of its destination shard of a split parameter: tp4 -> dp2 x tp2
# gathers quarters to rebuild halves; dp2 x tp2 -> tp4 sums a zero-padded half within the tp pair
SENT_PER_DST_ELEMENT = {"gather": 0.5, "reduce": 2}
WIRE_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 4}  # CPU has no bfloat16 collectives


@pytest.mark.msrun
@pytest.mark.parametrize("src,dst,dtypes,path", [("1,4", "2,2", "float32,bfloat16", "gather"),
                                                  ("2,2", "1,4", "float32,float16", "reduce")],
                         ids=["tp4->dp2xtp2(+bf16)", "dp2xtp2->tp4(+fp16)"])
def test_online_reshard_4workers_equals_transform_checkpoints(tmp_path, src, dst, dtypes, path):
    out = tmp_path / "run"
    run_worker("reshard_worker.py", ["--src", src, "--dst", dst, "--dst_dtype", dtypes, "--out", str(out),
                                     "--pack_below_bytes", "256"], WORKERS, tmp_path / "log")
    dst_strategy = rename_strategy(out / "dst_strategy_0.ckpt", "infer.", str(tmp_path / "dst_renamed.ckpt"))
    oracle_dir = transform_oracle(out, str(out / "src_strategy_0.ckpt"), dst_strategy, tmp_path)
    split = {n for n, lay in read_strategy_file(dst_strategy).items() if not lay.is_replicated}
    assert split
    for i, dtype in enumerate(dtypes.split(",")):
        for rank in range(WORKERS):
            got = dict(np.load(out / (f"dst_rank_{rank}.npz" if i == 0 else f"dst_{dtype}_rank_{rank}.npz")))
            expected = oracle_tensors(oracle_dir, rank)
            names = [k for k in got if not k.startswith("__")]
            assert len(names) == len(expected) > 20
            for name in names:
                fp32 = expected[name[len("infer."):]]
                want = as_dtype_like_mindspore(fp32, dtype)
                assert got[name].dtype == want.dtype, name
                np.testing.assert_array_equal(got[name], want, err_msg=f"{dtype} rank {rank} {name}")
                if dtype == "bfloat16" and fp32.size > 1:
                    assert not np.array_equal(got[name], fp32), f"{name} was not rounded to bfloat16"
            want_sent = SENT_PER_DST_ELEMENT[path] * sum(expected[n].size for n in split) * WIRE_ITEMSIZE[dtype]
            assert int(got["__bytes_sent"]) == want_sent, f"rank {rank}"
            assert int(got["__buckets"]) > 1  # the 4 KiB bucket bound splits the move


@pytest.mark.msrun
@pytest.mark.parametrize("src,dst", [("1,4", "2,2"), ("2,2", "1,4")], ids=["tp4-kv2->dp2xtp2", "dp2xtp2->tp4-kv2"])
def test_online_reshard_of_kv_heads_shared_by_tp_peers(tmp_path, src, dst):
    """2 kv heads at tp=4: each rank holds its query heads' kv head, shared with its tp neighbour; resharded to
    and from dp2 x tp2 (one kv head per rank) bit-equal with `transform_checkpoints`."""
    out = tmp_path / "run"
    run_worker("reshard_worker.py", ["--src", src, "--dst", dst, "--n_kv_heads", "2", "--out", str(out)], WORKERS,
               tmp_path / "log")
    dst_strategy = rename_strategy(out / "dst_strategy_0.ckpt", "infer.", str(tmp_path / "dst_renamed.ckpt"))
    tp4_strategy = out / ("src_strategy_0.ckpt" if src == "1,4" else "dst_strategy_0.ckpt")
    shared = {n for n, lay in read_strategy_file(str(tp4_strategy)).items() if len(lay.dev_matrix) == 3}
    assert len(shared) == 8  # wk/wv weight and bias of 2 layers
    oracle_dir = transform_oracle(out, str(out / "src_strategy_0.ckpt"), dst_strategy, tmp_path)
    for rank in range(WORKERS):
        got = dict(np.load(out / f"dst_rank_{rank}.npz"))
        expected = oracle_tensors(oracle_dir, rank)
        names = [k for k in got if not k.startswith("__")]
        assert len(names) == len(expected) > 20
        for name in names:
            np.testing.assert_array_equal(got[name], expected[name[len("infer."):]], err_msg=f"rank {rank} {name}")
