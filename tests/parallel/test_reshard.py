"""Online reshard: layout planning (pure) and, under msrun, bit-equality with transform_checkpoints: on 2 workers
(tp2 <-> dp2, pp2 -> dp2) and on 4 (tp4 <-> dp2 x tp2, pipeline stages -> dp2 x tp2).

tp4 -> dp2 x tp2 crosses the whole world (AllGather path) and lands on half-shards; dp2 x tp2 -> tp4
moves within each tp pair (AllReduce path on sub-groups); both with 2 kv heads, each shared by two tp4 ranks.
The packing threshold is shrunk so that both paths pack small moves into one collective call and send larger
ones alone. Each of those runs also fills a second destination net: bfloat16 (oracle: the float32 transform
result cast to bfloat16 by MindSpore; on CPU it travels as float32 and is written with set_data, CPU having no
bfloat16 collective or Assign kernel) or float16 (travels as float16).

The msrun runs (tests/workers/reshard_worker.py) go in one launch per world size, each run in its own folder; every
test compares its run with its own `transform_checkpoints` oracle.
"""
import os

import numpy as np
import pytest
from support.cases import Run, Runs, selected, waits_for
from support.checkpoints import rename_strategy, transform_oracle
from support.configs import tiny_qwen2_config

from mindrlhf.parallel.reshard import make_buckets, plan_reshard, source_group
from mindrlhf.parallel.strategy import ParamLayout, StrategyError, read_strategy_file


def lay(name, dev_matrix, tensor_map, shape):
    return ParamLayout(name, dev_matrix, tensor_map, shape)


# ------------------------------------------------------------------------------------------ planning
def test_source_group_is_the_ranks_holding_distinct_shards():
    tp2 = lay("w", (1, 2), (0, -1), (4, 4))
    assert source_group(tp2, 0) == (0, 1)
    dp2 = lay("w", (2, 1), (-1, -1), (4, 4))
    assert source_group(dp2, 1) == (1,)
    dp2tp2 = lay("w", (2, 2), (-1, 0), (4, 4))  # columns split over tp
    assert source_group(dp2tp2, 2) == (2, 3)
    assert source_group(dp2tp2, 1) == (0, 1)


def test_tp2_to_replicated_gathers_the_whole_tensor():
    src = {"w": lay("w", (1, 2), (0, -1), (4, 6))}
    dst = {"w": lay("w", (2, 1), (-1, -1), (4, 6))}
    for rank in (0, 1):
        (move,) = plan_reshard(src, dst, {"w": "w"}, rank)
        assert move.group == (0, 1)
        assert move.buffer_region == (slice(0, 4), slice(0, 6))
        assert move.contribution == (slice(2 * rank, 2 * rank + 2), slice(0, 6))


def test_replicated_to_tp2_and_same_layout_are_local():
    src = {"w": lay("w", (2, 1), (-1, -1), (4, 6))}
    dst = {"w": lay("w", (1, 2), (-1, 0), (4, 6))}
    (move,) = plan_reshard(src, dst, {"w": "w"}, 1)
    assert move.group == () and move.dst_region == (slice(0, 4), slice(3, 6))
    same = {"w": lay("w", (1, 2), (0, -1), (4, 6))}
    (move,) = plan_reshard(same, same, {"w": "w"}, 1)
    assert move.group == ()


def test_dp2tp2_to_tp4_moves_within_the_tp_pair_only_what_it_needs():
    src = {"w": lay("w", (2, 2), (0, -1), (8, 2))}
    dst = {"w": lay("w", (1, 4), (0, -1), (8, 2))}
    moves = {r: plan_reshard(src, dst, {"w": "w"}, r)[0] for r in range(4)}
    assert moves[0].group == moves[1].group == (0, 1)
    assert moves[2].group == moves[3].group == (2, 3)
    # ranks 0 and 1 need quarters 0 and 1, both inside rank 0's half: the buffer is that half only
    assert moves[0].buffer_region == (slice(0, 4), slice(0, 2))
    assert moves[1].contribution is None  # rank 1's half (rows 4..8) is not needed by its pair
    assert moves[3].buffer_region == (slice(4, 8), slice(0, 2))


def test_buckets_respect_the_size_bound_and_a_global_order():
    src = {n: lay(n, (1, 2), (0, -1), (4, 4)) for n in "abc"}
    dst = {n: lay(n, (2, 1), (-1, -1), (4, 4)) for n in "abc"}
    moves = plan_reshard(src, dst, {n: n for n in "abc"}, 0)
    buckets = make_buckets(moves, bucket_elements=32)
    assert [len(b.moves) for b in buckets] == [2, 1]
    assert all(b.elements <= 32 for b in buckets)
    assert [m.dst_name for b in buckets for m in b.moves] == ["a", "b", "c"]


# ------------------------------------------------------------------------------- errors before moving
def test_errors_name_parameters_and_layouts(tmp_path):
    import mindspore as ms

    from mindrlhf.models.qwen2 import Qwen2ForCausalLM
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.parallel.reshard import Resharder
    from mindrlhf.parallel.strategy import net_layouts

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    src = Qwen2ForCausalLM(tiny_qwen2_config())
    dst = Qwen2ForCausalLM(tiny_qwen2_config())
    dst.update_parameters_name("infer.")
    before = {p.name: p.asnumpy().copy() for p in dst.get_parameters()}
    src_layouts, dst_layouts = net_layouts(src, Layout()), net_layouts(dst, Layout())
    partial_map = {p.name: "infer." + p.name for p in src.get_parameters() if "norm_out" not in p.name}
    with pytest.raises(StrategyError, match="norm_out"):
        Resharder(src, dst, src_layouts, dst_layouts, partial_map)
    # a strategy of another world size
    other_world = {n: ParamLayout(n, (2, 1), lay_.tensor_map, lay_.full_shape) for n, lay_ in dst_layouts.items()}
    full_map = {p.name: "infer." + p.name for p in src.get_parameters()}
    with pytest.raises(StrategyError, match="world size"):
        Resharder(src, dst, src_layouts, other_world, full_map)
    # a net whose shapes disagree with its strategy
    wrong = Qwen2ForCausalLM(tiny_qwen2_config(intermediate_size=128))
    with pytest.raises(StrategyError, match="w1.weight"):
        Resharder(src, wrong, src_layouts, net_layouts(src, Layout()), None)
    for p in dst.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), before[p.name])


# ---------------------------------------------------------------------------------- oracle (msrun)
STAGED = ["--num_layers", "4", "--n_kv_heads", "2"]  # the tiny Qwen2 with 4 layers to split into stages
# the runs of reshard_worker.py the tests read, by name; one launch per world size runs all of its runs
RUNS = {
    # 2 workers
    "tp2->dp2-fp16": Run(2, ["--src", "1,2", "--dst", "2,1", "--dst_dtype", "float16"]),
    "dp2->tp2": Run(2, ["--src", "2,1", "--dst", "1,2", "--dst_dtype", "float32"]),
    "tp2->tp2-renamed": Run(2, ["--src", "1,2", "--dst", "1,2", "--dst_dtype", "float32"]),
    "pp2->dp2": Run(2, ["--src", "1,1,2", "--dst", "2,1", *STAGED]),
    "pp2->dp2-tied-fp16": Run(2, ["--src", "1,1,2", "--dst", "2,1", *STAGED, "--tied", "--dst_dtype", "float16"]),
    # 4 workers
    "tp4-kv2->dp2xtp2(+bf16)": Run(4, ["--src", "1,4", "--dst", "2,2", "--dst_dtype", "float32,bfloat16",
                                       "--pack_below_bytes", "256", "--n_kv_heads", "2"]),
    "dp2xtp2->tp4-kv2(+fp16)": Run(4, ["--src", "2,2", "--dst", "1,4", "--dst_dtype", "float32,float16",
                                       "--pack_below_bytes", "256", "--n_kv_heads", "2"]),
    "pp2xtp2->dp2xtp2": Run(4, ["--src", "1,2,2", "--dst", "2,2", *STAGED]),
    "pp4->dp2xtp2-tied": Run(4, ["--src", "1,1,4", "--dst", "2,2", *STAGED, "--tied"]),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    return Runs("reshard_worker.py", tmp_path_factory.mktemp("reshard"), RUNS, selected(request, "run"))


def oracle_tensors(oracle_dir, rank: int) -> dict[str, np.ndarray]:
    import mindspore as ms
    rank_dir = oracle_dir / f"rank_{rank}"
    newest = sorted(os.listdir(rank_dir))[-1]
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(str(rank_dir / newest)).items()}


@pytest.mark.msrun
@waits_for(1)
@pytest.mark.parametrize("run,dtype,communicates", [("tp2->dp2-fp16", "float16", True),
                                                     ("dp2->tp2", "float32", False),
                                                     ("tp2->tp2-renamed", "float32", False)],
                         ids=["tp2->dp2-fp16", "dp2->tp2", "tp2->tp2-renamed"])
def test_online_reshard_equals_transform_checkpoints(runs, tmp_path, run, dtype, communicates):
    import mindspore as ms
    out = runs(run)
    dst_strategy = rename_strategy(out / "dst_strategy_0.ckpt", "infer.", str(tmp_path / "dst_renamed.ckpt"))
    oracle_dir = transform_oracle(out, str(out / "src_strategy" / "strategy_0.ckpt"), dst_strategy, tmp_path)
    for rank in range(2):
        got = dict(np.load(out / f"dst_rank_{rank}.npz"))
        files = sorted(os.listdir(oracle_dir / f"rank_{rank}"))
        expected = {k: v.asnumpy() for k, v in ms.load_checkpoint(str(oracle_dir / f"rank_{rank}" / files[-1])).items()}
        names = [k for k in got if not k.startswith("__")]
        assert len(names) == len(expected) > 20
        for name in names:
            want = expected[name[len("infer."):]].astype(getattr(np, dtype))
            assert got[name].dtype == want.dtype, name
            np.testing.assert_array_equal(got[name], want, err_msg=f"rank {rank} {name}")
        if communicates:
            assert int(got["__buckets"]) > 1  # the 4 KiB bucket bound splits the move
        else:  # every rank already holds what it needs: no collective at all
            assert int(got["__bytes_sent"]) == 0


def as_dtype_like_mindspore(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` cast to `dtype` by MindSpore (float32 -> bfloat16 rounds to nearest even), as float32 for bf16."""
    import mindspore as ms
    if dtype == "bfloat16":
        return ms.Tensor(values, ms.bfloat16).astype(ms.float32).asnumpy()
    return values.astype(getattr(np, dtype))


# elements a rank sends per element of its destination shard of a split parameter: tp4 -> dp2 x tp2
# gathers quarters to rebuild halves; dp2 x tp2 -> tp4 sums a zero-padded half within the tp pair. A kv head shared
# by two tp4 ranks (2 kv heads) has a source group of two ranks (the module's docstring): either way they sum the
# half one of them needs and the other holds, a zero-padded AllReduce of one destination shard.
SENT_PER_DST_ELEMENT = {"gather": 0.5, "reduce": 2, "kv head shared by tp peers": 1}
WIRE_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 4}  # CPU has no bfloat16 collectives


@pytest.mark.msrun
@waits_for(1)
@pytest.mark.parametrize("run,dtypes,path", [("tp4-kv2->dp2xtp2(+bf16)", "float32,bfloat16", "gather"),
                                             ("dp2xtp2->tp4-kv2(+fp16)", "float32,float16", "reduce")],
                         ids=["tp4-kv2->dp2xtp2(+bf16)", "dp2xtp2->tp4-kv2(+fp16)"])
def test_online_reshard_4workers_equals_transform_checkpoints(runs, tmp_path, run, dtypes, path):
    """2 kv heads at tp=4: each rank holds its query heads' kv head, shared with its tp neighbour; resharded to
    and from dp2 x tp2 (one kv head per rank), into float32 and a narrower dtype, bit-equal with
    `transform_checkpoints`, sending what the layouts say."""
    workers = 4
    out = runs(run)
    dst_strategy = rename_strategy(out / "dst_strategy_0.ckpt", "infer.", str(tmp_path / "dst_renamed.ckpt"))
    src_strategy = out / "src_strategy" / "strategy_0.ckpt"
    tp4_strategy = src_strategy if path == "gather" else dst_strategy  # the names without infer.
    shared = {n for n, lay in read_strategy_file(str(tp4_strategy)).items() if len(lay.dev_matrix) == 3}
    assert len(shared) == 8  # wk/wv weight and bias of 2 layers
    oracle_dir = transform_oracle(out, str(src_strategy), dst_strategy, tmp_path)
    split = {n for n, lay in read_strategy_file(dst_strategy).items() if not lay.is_replicated}
    assert split > shared
    for i, dtype in enumerate(dtypes.split(",")):
        for rank in range(workers):
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
            want_sent = sum(SENT_PER_DST_ELEMENT["kv head shared by tp peers" if n in shared else path]
                            * expected[n].size for n in split) * WIRE_ITEMSIZE[dtype]
            assert int(got["__bytes_sent"]) == want_sent, f"rank {rank}"
            assert int(got["__buckets"]) > 1  # the 4 KiB bucket bound splits the move


@pytest.mark.msrun
@waits_for(1)
@pytest.mark.parametrize("run,world,tied,dtype", [("pp2->dp2", 2, False, "float32"),
                                                  ("pp2xtp2->dp2xtp2", 4, False, "float32"),
                                                  ("pp2->dp2-tied-fp16", 2, True, "float16"),
                                                  ("pp4->dp2xtp2-tied", 4, True, "float32")],
                         ids=["pp2->dp2", "pp2xtp2->dp2xtp2", "pp2->dp2-tied-fp16", "pp4->dp2xtp2-tied"])
def test_online_reshard_from_pipeline_stages_equals_transform_checkpoints(runs, tmp_path, run, world, tied, dtype):
    """Train net in pipeline stages -> inference net without stages, online: each rank gets what MindSpore's
    `transform_checkpoints` gives from the stages' checkpoints and their merged strategy, bit for bit (cast to the
    destination's dtype: float32 -> float16 when the inference net is in half precision). A tied embedding, which
    the first and the last stage hold, arrives once."""
    import mindspore as ms

    args = RUNS[run].args
    assert RUNS[run].workers == world and ("--tied" in args) == tied and ("float16" in args) == (dtype == "float16")
    out = runs(run)
    merged = str(tmp_path / "merged.ckpt")
    ms.parallel.merge_pipeline_strategys(str(out / "src_strategy"), merged)
    dst_strategy = rename_strategy(out / "dst_strategy_0.ckpt", "infer.", str(tmp_path / "dst_renamed.ckpt"))
    ms.parallel.transform_checkpoints(str(out / "src_ckpt"), str(tmp_path / "oracle"), "oracle", merged,
                                      dst_strategy)
    for rank in range(world):
        got = {k: v for k, v in np.load(out / f"dst_rank_{rank}.npz").items() if not k.startswith("__")}
        rank_dir = tmp_path / "oracle" / f"rank_{rank}"
        newest = sorted(os.listdir(rank_dir))[-1]
        expected = {k: v.asnumpy() for k, v in ms.load_checkpoint(str(rank_dir / newest)).items()}
        assert len(got) == len(expected) > 40
        assert ("infer.lm_head.weight" in got) == (not tied)
        for name, value in got.items():
            want = expected[name[len("infer."):]]
            want = want.astype(np.float16) if dtype == "float16" else want
            assert value.dtype == want.dtype, name
            np.testing.assert_array_equal(value, want, err_msg=f"rank {rank} {name}")


def test_wire_dtype_is_the_narrowest_exact_one():
    import mindspore as ms

    from mindrlhf.parallel.reshard import wire_dtype
    cpu = {ms.float32, ms.float16}
    assert wire_dtype({ms.float32}, {ms.float16}, cpu) == ms.float16      # cast before sending halves bytes
    assert wire_dtype({ms.float32}, {ms.float32}, cpu) == ms.float32
    assert wire_dtype({ms.float32}, {ms.bfloat16}, cpu) == ms.float32     # no bf16 collectives on CPU
    assert wire_dtype({ms.float32}, {ms.bfloat16}, cpu | {ms.bfloat16}) == ms.bfloat16
    assert wire_dtype({ms.float16}, {ms.float32}, cpu) == ms.float16      # a lone source dtype is exact too
    assert wire_dtype({ms.float32, ms.float16}, {ms.float32, ms.float16}, cpu) == ms.float32
