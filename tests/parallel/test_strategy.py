"""Parameter layouts and strategy files, with `mindspore.parallel.transform_checkpoints` as the oracle.

Source shards are cut the way the tensor-parallel layers hold them (by `Layout.tp_rank`), independently
of `ParamLayout`, so a tensor_map counted from the wrong side cannot agree with itself and pass.
"""
from __future__ import annotations

import glob
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore.train import node_strategy_pb2

from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.strategy import (
    ParamLayout,
    StrategyError,
    full_shapes_from_local,
    layouts_for,
    read_strategy_file,
    strategy_file_name,
    validate_pair,
    world_size_of,
    write_strategy_file,
)

SPLIT_AXES = {
    "model.layers.0.attention.wq.weight": 0,  # [H*hd, D], column parallel
    "model.layers.0.attention.wq.bias": 0,
    "model.layers.0.attention.wo.weight": 1,  # [D, H*hd], row parallel
    "model.norm_out.weight": None,
}
FULL_SHAPES = {
    "model.layers.0.attention.wq.weight": (8, 6),
    "model.layers.0.attention.wq.bias": (8,),
    "model.layers.0.attention.wo.weight": (6, 8),
    "model.norm_out.weight": (6,),
}
LAYOUTS = {"tp2": Layout(dp=1, tp=2), "dp2": Layout(dp=2, tp=1), "dp2tp2": Layout(dp=2, tp=2),
           "tp4": Layout(dp=1, tp=4)}


def full_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in FULL_SHAPES.items()}


def tp_shard(full: np.ndarray, axis: int | None, layout: Layout, rank: int) -> np.ndarray:
    """What a tensor-parallel layer holds on `rank`: tp_rank-th chunk along `axis`, same on every dp rank."""
    if axis is None:
        return full
    return np.split(full, layout.tp, axis=axis)[layout.coords(rank)[1]]


def save_rank_checkpoints(root: str, layout: Layout, tensors: dict[str, np.ndarray]) -> None:
    for rank in range(layout.world_size):
        os.makedirs(os.path.join(root, f"rank_{rank}"), exist_ok=True)
        shards = [{"name": n, "data": ms.Tensor(tp_shard(t, SPLIT_AXES[n], layout, rank))} for n, t in tensors.items()]
        ms.save_checkpoint(shards, os.path.join(root, f"rank_{rank}", "ckpt.ckpt"))


def load_rank(root: str, rank: int) -> dict[str, np.ndarray]:
    (path,) = glob.glob(os.path.join(root, f"rank_{rank}", "*.ckpt"))
    return {name: p.asnumpy() for name, p in ms.load_checkpoint(path).items()}


def assert_bitwise_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert actual.tobytes() == expected.tobytes(), what


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Per-rank checkpoints and strategy files (one per rank, as a job writes them) for each layout."""
    root = tmp_path_factory.mktemp("strategy_oracle")
    tensors = full_tensors()
    strategies = {}
    for key, layout in LAYOUTS.items():
        save_rank_checkpoints(str(root / key), layout, tensors)
        layouts = layouts_for(layout, SPLIT_AXES, FULL_SHAPES)
        for rank in range(layout.world_size):
            write_strategy_file(root / f"{key}_strategy" / strategy_file_name(rank), layouts)
        strategies[key] = str(root / f"{key}_strategy" / strategy_file_name(0))
    return {"root": root, "tensors": tensors, "strategies": strategies}


# ---------------------------------------------------------------- ParamLayout (pure)
@pytest.mark.parametrize("key", list(LAYOUTS))
@pytest.mark.parametrize("name", list(SPLIT_AXES))
def test_slice_of_is_what_the_tp_layer_holds(key, name):
    layout = LAYOUTS[key]
    full = full_tensors()[name]
    lay = layouts_for(layout, SPLIT_AXES, FULL_SHAPES)[name]
    for rank in range(layout.world_size):
        assert np.array_equal(full[lay.slice_of(rank)], tp_shard(full, SPLIT_AXES[name], layout, rank))
        assert lay.local_shape == tp_shard(full, SPLIT_AXES[name], layout, rank).shape


def test_tensor_map_counts_device_axes_from_the_right():
    # dev_matrix [dp=2, tp=4]: tensor_map 0 is the last (tp) axis, 1 the first (dp) axis.
    by_tp = ParamLayout("w", (2, 4), (0, -1), (8, 4))
    by_dp = ParamLayout("w", (2, 4), (1, -1), (8, 4))
    assert by_tp.split_counts == (4, 1) and by_dp.split_counts == (2, 1)
    assert by_tp.device_coords(5) == (1, 1)
    assert by_tp.slice_of(5) == (slice(2, 4), slice(0, 4))
    assert by_dp.slice_of(5) == (slice(4, 8), slice(0, 4))
    assert layouts_for(Layout(dp=2, tp=4), {"w": 0}, {"w": (8, 4)})["w"].tensor_map == (0, -1)


@pytest.mark.parametrize("dev_matrix, tensor_map, shape", [
    ((2, 3, 2), (2, 0), (4, 6)),
    ((2, 3, 2), (0, 2), (4, 6)),
    ((2, 3, 2), (1, -1, 2), (6, 5, 4)),
    ((4,), (-1, -1), (3, 5)),
    ((2, 2), (1, 0), (4, 4)),
])
def test_slice_of_matches_mindspore_slicing(dev_matrix, tensor_map, shape):
    from mindspore.parallel._tensor import _load_tensor  # private, used only as an oracle

    full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    lay = ParamLayout("p", dev_matrix, tensor_map, shape)
    for rank in range(lay.world_size):
        expected = _load_tensor(ms.Tensor(full), list(dev_matrix), list(tensor_map), rank_id=rank)
        assert np.array_equal(full[lay.slice_of(rank)], expected), rank


def test_shapes_and_replication():
    lay = ParamLayout("w", [2, 2], [-1, 0], [6, 8])
    assert lay.dev_matrix == (2, 2) and lay.tensor_map == (-1, 0) and lay.full_shape == (6, 8)
    assert lay.local_shape == (6, 4) and lay.world_size == 4 and not lay.is_replicated
    assert lay.full_shape_from_local((6, 4)) == (6, 8)
    assert lay.shard_index(1) == lay.shard_index(3) == (0, 1)
    assert ParamLayout("n", (2, 2), (-1,), (6,)).is_replicated
    with pytest.raises(StrategyError, match="full shape unknown"):
        _ = ParamLayout("w", (2,), (0,)).local_shape
    with pytest.raises(StrategyError, match="rank 4 outside"):
        lay.slice_of(4)


@pytest.mark.parametrize("dev_matrix, tensor_map, shape, message", [
    ((2, 2), (2, -1), (4, 4), "tensor_map entries"),
    ((2, 2), (0, 0), (4, 4), "more than one tensor dimension"),
    ((2, 2), (0, -1), (3, 4), "not divisible"),
    ((2, 2), (0,), (4, 4), "full shape has 2 dims"),
    ((0, 2), (0,), (4,), "sizes >= 1"),
])
def test_invalid_layout_names_the_parameter(dev_matrix, tensor_map, shape, message):
    with pytest.raises(StrategyError, match=f"parameter 'w.bad'.*{message}"):
        ParamLayout("w.bad", dev_matrix, tensor_map, shape)


def test_layouts_for_and_local_shapes():
    layout = Layout(dp=2, tp=2)
    layouts = layouts_for(layout, SPLIT_AXES, FULL_SHAPES)
    assert {n: lay.tensor_map for n, lay in layouts.items()} == {
        "model.layers.0.attention.wq.weight": (0, -1), "model.layers.0.attention.wq.bias": (0,),
        "model.layers.0.attention.wo.weight": (-1, 0), "model.norm_out.weight": (-1,)}
    assert all(lay.dev_matrix == (2, 2) for lay in layouts.values())
    local = {n: lay.local_shape for n, lay in layouts.items()}
    assert full_shapes_from_local(layout, SPLIT_AXES, local) == FULL_SHAPES
    assert layouts_for(layout, {"w": -1}, {"w": (4, 6)})["w"].tensor_map == (-1, 0)


def test_layouts_for_errors():
    with pytest.raises(StrategyError, match="only in split_axes: a; only in full_shapes: b"):
        layouts_for(Layout(tp=2), {"a": 0}, {"b": (4,)})
    with pytest.raises(StrategyError, match="parameter 'w': split axis 2 out of range"):
        layouts_for(Layout(tp=2), {"w": 2}, {"w": (4, 4)})
    with pytest.raises(StrategyError, match="parameter 'w'.*not divisible"):
        layouts_for(Layout(tp=4), {"w": 0}, {"w": (6, 4)})


# ---------------------------------------------------------------- strategy files
def test_written_file_reads_back_with_build_searched_strategy(tmp_path):
    layouts = layouts_for(Layout(dp=2, tp=2), SPLIT_AXES, FULL_SHAPES)
    path = write_strategy_file(tmp_path / "s.ckpt", layouts)
    searched = ms.build_searched_strategy(path)  # dict: name -> node_strategy_pb2.ParallelLayouts
    assert set(searched) == set(layouts)
    for name, lay in layouts.items():
        proto = searched[name]
        assert isinstance(proto, node_strategy_pb2.ParallelLayouts)
        assert [list(d.dim) for d in proto.dev_matrix] == [[2, 2]]
        assert [list(t.dim) for t in proto.tensor_map] == [list(lay.tensor_map)]
        assert len(proto.param_split_shape) == 1 and list(proto.param_split_shape[0].dim) == []
        assert proto.IsInitialized() and proto.opt_weight_shard_size == 0
    assert read_strategy_file(path) == {n: ParamLayout(n, lay.dev_matrix, lay.tensor_map) for n, lay in layouts.items()}
    assert os.listdir(tmp_path) == ["s.ckpt"]  # no temp file left behind


def test_write_overwrites_atomically(tmp_path):
    path = tmp_path / "sub" / "s.ckpt"
    write_strategy_file(path, {"a": ParamLayout("a", (2,), (0,))})
    write_strategy_file(path, {"b": ParamLayout("b", (4,), (-1,))}, stage=0)
    assert read_strategy_file(path) == {"b": ParamLayout("b", (4,), (-1,))}
    assert os.listdir(tmp_path / "sub") == ["s.ckpt"]


@pytest.mark.parametrize("path, layouts, message", [
    ("s.ckpt", {}, "no parameter layouts"),
    ("s.ckpt", {"a-b": ParamLayout("a-b", (2,), (0,))}, "parameter 'a-b' has a '-'"),
    ("s.json", {"a": ParamLayout("a", (2,), (0,))}, "'.json'"),
    ("s.ckpt", {"a": ParamLayout("b", (2,), (0,))}, "key 'a' holds the layout of parameter 'b'"),
    ("s.ckpt", {"a": ParamLayout("a", (2,), (0,)), "b": ParamLayout("b", (4,), (0,))}, r"one world size, got \[2, 4\]"),
])
def test_write_errors(tmp_path, path, layouts, message):
    with pytest.raises(StrategyError, match=message):
        write_strategy_file(tmp_path / path, layouts)
    assert not os.listdir(tmp_path)


def test_read_errors(tmp_path, job):
    with pytest.raises(StrategyError, match="strategy file not found"):
        read_strategy_file(tmp_path / "missing.ckpt")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(StrategyError, match="empty.ckpt: strategy file is empty"):
        read_strategy_file(tmp_path / "empty.ckpt")
    (tmp_path / "junk.ckpt").write_bytes(b"\xff\xfe not a protobuf at all")
    with pytest.raises(StrategyError, match="junk.ckpt: not a MindSpore strategy file"):
        read_strategy_file(tmp_path / "junk.ckpt")
    with pytest.raises(StrategyError, match="ckpt.ckpt: not a MindSpore strategy file"):
        read_strategy_file(os.path.join(job["root"], "tp2", "rank_0", "ckpt.ckpt"))


def test_read_file_merged_by_merge_pipeline_strategys(tmp_path, job):
    # merge_pipeline_strategys globs '<dir>/*.ckpt', skips byte-identical files and files of a stage already
    # merged, prefixes names with '<stage>-' and sets current_stage=1.
    merged = str(tmp_path / "merged.ckpt")
    ms.parallel.merge_pipeline_strategys(os.path.dirname(job["strategies"]["dp2tp2"]), merged)
    assert sorted(ms.build_searched_strategy(merged)) == sorted(f"0-{n}" for n in SPLIT_AXES)
    assert read_strategy_file(merged) == read_strategy_file(job["strategies"]["dp2tp2"])


# ---------------------------------------------------------------- validate_pair
def _layouts(key: str, prefix: str = "") -> dict[str, ParamLayout]:
    layouts = layouts_for(LAYOUTS[key], SPLIT_AXES, FULL_SHAPES)
    return {prefix + n: ParamLayout(prefix + n, lay.dev_matrix, lay.tensor_map, lay.full_shape)
            for n, lay in layouts.items()}


def test_validate_pair_accepts_matching_layouts():
    pairs = validate_pair(_layouts("tp4"), _layouts("dp2tp2"))
    assert pairs == {n: n for n in SPLIT_AXES}
    name_map = {n: "infer." + n for n in SPLIT_AXES}
    assert validate_pair(_layouts("tp4"), _layouts("dp2tp2", "infer."), name_map) == {v: k for k, v in name_map.items()}
    assert world_size_of(_layouts("tp4")) == 4


def test_validate_pair_lists_unmatched_names():
    src, dst = _layouts("tp2"), _layouts("dp2", "infer.")
    name_map = {n: "infer." + n for n in list(SPLIT_AXES)[:2]}
    name_map["train.ghost"] = "infer.ghost"
    with pytest.raises(StrategyError) as err:
        validate_pair(src, dst, name_map, "train strategy a.ckpt", "infer strategy b.ckpt")
    text = str(err.value)
    assert "cannot reshard train strategy a.ckpt -> infer strategy b.ckpt" in text
    assert "name map keys not in train strategy a.ckpt: train.ghost" in text
    assert "name map values not in infer strategy b.ckpt: infer.ghost" in text
    assert ("infer strategy b.ckpt parameters with no train strategy a.ckpt counterpart: "
            "infer.model.layers.0.attention.wo.weight, infer.model.norm_out.weight") in text
    assert "train strategy a.ckpt parameters with no infer strategy b.ckpt counterpart: " in text
    some = {n: "infer." + n for n in SPLIT_AXES}
    assert validate_pair({**src, "extra": ParamLayout("extra", (1, 2), (-1,))}, dst, some, allow_unused_src=True)


def test_validate_pair_world_size_and_shapes():
    with pytest.raises(StrategyError, match="world size mismatch: train covers 2 ranks, infer 4"):
        validate_pair(_layouts("tp2"), _layouts("tp4"), None, "train", "infer")
    dst = _layouts("dp2")
    dst["model.norm_out.weight"] = dst["model.norm_out.weight"].with_full_shape((8,))
    dst["model.layers.0.attention.wq.bias"] = ParamLayout("model.layers.0.attention.wq.bias", (2, 1), (0, -1))
    with pytest.raises(StrategyError) as err:
        validate_pair(_layouts("tp2"), dst, None, "train", "infer")
    text = str(err.value)
    assert ("shape mismatch: train 'model.norm_out.weight' (dev_matrix=[1, 2] tensor_map=[-1] full_shape=[6]) vs "
            "infer 'model.norm_out.weight' (dev_matrix=[2, 1] tensor_map=[-1] full_shape=[8])") in text
    assert "train 'model.layers.0.attention.wq.bias' (dev_matrix=[1, 2] tensor_map=[0]" in text


# ---------------------------------------------------------------- oracle: transform_checkpoints
@pytest.mark.parametrize("key", list(LAYOUTS))
def test_merge_to_full_checkpoint_is_bit_exact(job, tmp_path, key):
    ms.parallel.transform_checkpoints(os.path.join(job["root"], key), str(tmp_path), "full_",
                                      job["strategies"][key], None)
    assert os.listdir(tmp_path) == ["rank_0"]  # dst_strategy_file=None merges into rank_0 only
    merged = load_rank(str(tmp_path), 0)
    assert set(merged) == set(job["tensors"])
    for name, full in job["tensors"].items():
        assert_bitwise_equal(merged[name], full, f"{key} {name}")


@pytest.mark.parametrize("src_key, dst_key", [("tp2", "dp2tp2"), ("tp4", "dp2tp2"), ("dp2tp2", "tp4"),
                                              ("dp2", "tp2")])
def test_reshard_gives_each_rank_its_tp_shard(job, tmp_path, src_key, dst_key):
    dst_layout = LAYOUTS[dst_key]
    ms.parallel.transform_checkpoints(os.path.join(job["root"], src_key), str(tmp_path), "resharded_",
                                      job["strategies"][src_key], job["strategies"][dst_key])
    assert sorted(os.listdir(tmp_path)) == [f"rank_{r}" for r in range(dst_layout.world_size)]
    for rank in range(dst_layout.world_size):
        got = load_rank(str(tmp_path), rank)
        for name, full in job["tensors"].items():
            expected = tp_shard(full, SPLIT_AXES[name], dst_layout, rank)
            assert_bitwise_equal(got[name], expected, f"{src_key}->{dst_key} rank {rank} {name}")


def test_kv_heads_shared_by_tp_peers_transform_like_mindspore(tmp_path):
    """tp=4 over 2 kv heads: wk's rows are cut in 2, each half held by 2 consecutive tp ranks (device matrix
    [dp, 2, 2]). MindSpore's transform merges such shards and reshards them to dp2 x tp2 (where each tp rank
    holds one head) bit for bit, and back."""
    from mindrlhf.parallel.layers import shard_array

    full = {"wk": np.random.default_rng(7).standard_normal((4, 6)).astype(np.float32),
            "norm": np.random.default_rng(8).standard_normal((6,)).astype(np.float32)}
    axes, shapes = {"wk": 0, "norm": None}, {"wk": (4, 6), "norm": (6,)}
    shared, plain = Layout(dp=1, tp=4), Layout(dp=2, tp=2)
    layouts = {"shared": layouts_for(shared, axes, shapes, {"wk": 2}), "plain": layouts_for(plain, axes, shapes)}
    assert layouts["shared"]["wk"].dev_matrix == (1, 2, 2) and layouts["shared"]["wk"].tensor_map == (1, -1)
    assert full_shapes_from_local(shared, axes, {"wk": (2, 6), "norm": (6,)}, {"wk": 2}) == shapes
    held = {"shared": lambda name, rank: shard_array(full[name], axes[name], 2, shared.shard_of(2, rank)),
            "plain": lambda name, rank: shard_array(full[name], axes[name], 2, plain.coords(rank)[1])}
    for key, layout in (("shared", shared), ("plain", plain)):
        for rank in range(layout.world_size):
            for name in full:  # the layout's slice is what the layer holds
                assert np.array_equal(full[name][layouts[key][name].slice_of(rank)], held[key](name, rank))
            os.makedirs(tmp_path / key / f"rank_{rank}")
            ms.save_checkpoint([{"name": n, "data": ms.Tensor(held[key](n, rank))} for n in full],
                               str(tmp_path / key / f"rank_{rank}" / "ckpt.ckpt"))
        write_strategy_file(tmp_path / f"{key}.ckpt", layouts[key])
    assert shared.shard_group_ranks(2, 3) == [2, 3] and plain.shard_group_ranks(2, 3) == [3]
    ms.parallel.transform_checkpoints(str(tmp_path / "shared"), str(tmp_path / "full"), "full_",
                                      str(tmp_path / "shared.ckpt"), None)
    merged = load_rank(str(tmp_path / "full"), 0)
    for name in full:
        assert_bitwise_equal(merged[name], full[name], name)
    for src, dst, layout in (("shared", "plain", plain), ("plain", "shared", shared)):
        ms.parallel.transform_checkpoints(str(tmp_path / src), str(tmp_path / f"to_{dst}"), "t_",
                                          str(tmp_path / f"{src}.ckpt"), str(tmp_path / f"{dst}.ckpt"))
        for rank in range(layout.world_size):
            got = load_rank(str(tmp_path / f"to_{dst}"), rank)
            for name in full:
                assert_bitwise_equal(got[name], held[dst](name, rank), f"{src}->{dst} rank {rank} {name}")


def test_merged_pipeline_strategy_works_as_source(job, tmp_path):
    merged = str(tmp_path / "merged_strategy.ckpt")
    ms.parallel.merge_pipeline_strategys(os.path.dirname(job["strategies"]["dp2tp2"]), merged)
    ms.parallel.transform_checkpoints(os.path.join(job["root"], "dp2tp2"), str(tmp_path / "out"), "full_",
                                      merged, None)
    merged_ckpt = load_rank(str(tmp_path / "out"), 0)
    for name, full in job["tensors"].items():
        assert_bitwise_equal(merged_ckpt[name], full, name)


def test_tensor_map_counted_from_the_left_silently_gives_wrong_weights(job, tmp_path):
    """The DESIGN.md pitfall: tp mapped to device axis 1 (dp's) raises nothing but reorders the shards."""
    layout = LAYOUTS["dp2tp2"]
    left = {n: ParamLayout(n, layout.dev_matrix, tuple(1 if m == 0 else m for m in lay.tensor_map), lay.full_shape)
            for n, lay in layouts_for(layout, SPLIT_AXES, FULL_SHAPES).items()}
    wrong = write_strategy_file(tmp_path / "left.ckpt", left)
    ms.parallel.transform_checkpoints(os.path.join(job["root"], "dp2tp2"), str(tmp_path / "out"), "full_", wrong, None)
    merged = load_rank(str(tmp_path / "out"), 0)
    name = "model.layers.0.attention.wo.weight"
    assert merged[name].shape == FULL_SHAPES[name]
    assert not np.array_equal(merged[name], job["tensors"][name])
    assert np.array_equal(merged["model.norm_out.weight"], job["tensors"]["model.norm_out.weight"])
