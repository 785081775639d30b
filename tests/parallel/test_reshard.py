"""Online reshard: layout planning (pure) and, under msrun, bit-equality with transform_checkpoints."""
import os

import numpy as np
import pytest
from support.checkpoints import rename_strategy, transform_oracle
from support.configs import tiny_qwen2_config
from support.msrun import run_worker

from mindrlhf.parallel.reshard import make_buckets, plan_reshard, source_group
from mindrlhf.parallel.strategy import ParamLayout, StrategyError


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
@pytest.mark.msrun
@pytest.mark.parametrize("src,dst,dtype,communicates", [("1,2", "2,1", "float16", True),
                                                         ("2,1", "1,2", "float32", False),
                                                         ("1,2", "1,2", "float32", False)],
                         ids=["tp2->dp2-fp16", "dp2->tp2", "tp2->tp2-renamed"])
def test_online_reshard_equals_transform_checkpoints(tmp_path, src, dst, dtype, communicates):
    import mindspore as ms
    out = tmp_path / "run"
    run_worker("reshard_worker.py", ["--src", src, "--dst", dst, "--dst_dtype", dtype, "--out", str(out)], 2,
               tmp_path / "log")
    dst_strategy = rename_strategy(out / "dst_strategy_0.ckpt", "infer.", str(tmp_path / "dst_renamed.ckpt"))
    oracle_dir = transform_oracle(out, str(out / "src_strategy_0.ckpt"), dst_strategy, tmp_path)
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
