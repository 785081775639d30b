"""tools/transform_checkpoint.py: happy paths through a subprocess, error checks in-process (cheaper)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from support.checkpoints import NET_LAYOUTS, mindspore_split, tiny_strategy
from support.msrun import run_command
from support.paths import TINY_SFT_CKPT
from support.tools import TRANSFORM_CHECKPOINT

from mindrlhf.cli import transform_checkpoint
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.strategy import layouts_for, strategy_file_name, write_strategy_file

TOOL = str(TRANSFORM_CHECKPOINT)
SPLIT_AXES = {"layer.w1.weight": 0, "layer.w2.weight": 1, "norm.weight": None, "layer.w1.bias": 0}
FULL_SHAPES = {"layer.w1.weight": (8, 6), "layer.w2.weight": (6, 8), "norm.weight": (6,), "layer.w1.bias": (8,)}


def _tp_shard(full: np.ndarray, axis: int | None, layout: Layout, rank: int) -> np.ndarray:
    return full if axis is None else np.split(full, layout.tp, axis=axis)[layout.coords(rank)[1]]


def _make_job(root: str, layout: Layout, tensors: dict[str, np.ndarray]) -> str:
    """rank_<i>/ckpt.ckpt and strategy/<per-rank files> under root; returns the strategy folder."""
    layouts = layouts_for(layout, SPLIT_AXES, FULL_SHAPES)
    for rank in range(layout.world_size):
        os.makedirs(os.path.join(root, f"rank_{rank}"))
        shards = [{"name": n, "data": ms.Tensor(_tp_shard(t, SPLIT_AXES[n], layout, rank))} for n, t in tensors.items()]
        ms.save_checkpoint(shards, os.path.join(root, f"rank_{rank}", "ckpt.ckpt"))
        write_strategy_file(os.path.join(root, "strategy", strategy_file_name(rank)), layouts)
    return os.path.join(root, "strategy")


def _load_rank(root: str, rank: int) -> dict[str, np.ndarray]:
    (path,) = glob.glob(os.path.join(root, f"rank_{rank}", "*.ckpt"))
    return {name: p.asnumpy() for name, p in ms.load_checkpoint(path).items()}


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GLOG_v": "3"}  # MindSpore: errors only
    return run_command([sys.executable, TOOL, *args], env, timeout=120)


@pytest.fixture(scope="module")
def tensors():
    rng = np.random.default_rng(7)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in FULL_SHAPES.items()}


@pytest.fixture
def tp2_job(tmp_path, tensors):
    strategy_dir = _make_job(str(tmp_path / "src"), Layout(dp=1, tp=2), tensors)
    return str(tmp_path / "src"), strategy_dir


def test_cli_merges_to_full_checkpoint(tmp_path, tp2_job, tensors):
    src, strategy_dir = tp2_job
    result = _run("--src_checkpoint", src, "--src_strategy", strategy_dir, "--dst_checkpoint", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "into one full checkpoint" in result.stdout
    assert os.listdir(tmp_path / "out") == ["rank_0"]
    merged = _load_rank(str(tmp_path / "out"), 0)
    for name, full in tensors.items():
        assert merged[name].tobytes() == full.tobytes(), name


def test_cli_reshards_with_dst_strategy(tmp_path, tp2_job, tensors):
    src, strategy_dir = tp2_job
    dst_layout = Layout(dp=2, tp=2)
    dst_strategy = write_strategy_file(tmp_path / "dst_strategy.ckpt", layouts_for(dst_layout, SPLIT_AXES, FULL_SHAPES))
    result = _run("--src_checkpoint", src, "--src_strategy", os.path.join(strategy_dir, strategy_file_name(1)),
                  "--dst_checkpoint", str(tmp_path / "out"), "--dst_strategy", dst_strategy, "--prefix", "infer_")
    assert result.returncode == 0, result.stderr
    for rank in range(4):
        assert os.path.isfile(tmp_path / "out" / f"rank_{rank}" / f"infer_{rank}.ckpt")
        got = _load_rank(str(tmp_path / "out"), rank)
        for name, full in tensors.items():
            assert np.array_equal(got[name], _tp_shard(full, SPLIT_AXES[name], dst_layout, rank)), (rank, name)


@pytest.mark.slow
def test_cli_reports_missing_rank_file(tmp_path, tp2_job):
    src, strategy_dir = tp2_job
    shutil.rmtree(os.path.join(src, "rank_1"))
    result = _run("--src_checkpoint", src, "--src_strategy", strategy_dir, "--dst_checkpoint", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "missing rank file(s) for rank(s) [1]" in result.stderr and "world size" in result.stderr
    assert not os.path.exists(tmp_path / "out")


def _error(capsys, *argv: str) -> str:
    assert transform_checkpoint.main(list(argv)) == 2
    return capsys.readouterr().err


def test_errors_before_transform(tmp_path, tp2_job, tensors, capsys):
    src, strategy_dir = tp2_job
    out = str(tmp_path / "out")
    assert "--src_checkpoint /nonexistent: no such folder" in _error(
        capsys, "--src_checkpoint", "/nonexistent", "--src_strategy", strategy_dir, "--dst_checkpoint", out)
    # without --src_strategy too: the missing folder is the news, not the strategy it would have held
    assert "--src_checkpoint /nonexistent: no such folder" in _error(
        capsys, "--src_checkpoint", "/nonexistent", "--dst_checkpoint", out)
    assert "--src_strategy /nonexistent.ckpt: no such file or folder" in _error(
        capsys, "--src_checkpoint", src, "--src_strategy", "/nonexistent.ckpt", "--dst_checkpoint", out)
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"\x00\x01junk")
    assert "strategy not readable" in _error(
        capsys, "--src_checkpoint", src, "--src_strategy", str(junk), "--dst_checkpoint", out)
    assert "strategy not readable" in _error(
        capsys, "--src_checkpoint", src, "--src_strategy", os.path.join(src, "rank_0", "ckpt.ckpt"),
        "--dst_checkpoint", out)
    os.makedirs(tmp_path / "empty")
    assert "folder holds no strategy files" in _error(
        capsys, "--src_checkpoint", src, "--src_strategy", str(tmp_path / "empty"), "--dst_checkpoint", out)
    assert not os.path.exists(out)


def test_strategy_folder_of_different_world_sizes(tmp_path, tp2_job, capsys):
    src, strategy_dir = tp2_job
    write_strategy_file(os.path.join(strategy_dir, strategy_file_name(2)),
                        layouts_for(Layout(dp=2, tp=2), SPLIT_AXES, FULL_SHAPES))
    err = _error(capsys, "--src_checkpoint", src, "--src_strategy", strategy_dir, "--dst_checkpoint",
                 str(tmp_path / "out"))
    assert "strategy files of different world sizes" in err
    assert "ckpt_strategy_rank_0.ckpt: 2" in err and "ckpt_strategy_rank_2.ckpt: 4" in err


def test_checkpoint_and_strategy_mismatches(tmp_path, tp2_job, capsys):
    src, strategy_dir = tp2_job
    out = str(tmp_path / "out")
    tp4 = write_strategy_file(tmp_path / "tp4.ckpt", layouts_for(Layout(tp=4), SPLIT_AXES, FULL_SHAPES))
    assert "missing rank file(s) for rank(s) [2, 3]" in _error(
        capsys, "--src_checkpoint", src, "--src_strategy", tp4, "--dst_checkpoint", out)
    other = write_strategy_file(tmp_path / "other.ckpt", layouts_for(Layout(tp=2), {"x": 0}, {"x": (4,)}))
    assert "only in" in _error(capsys, "--src_checkpoint", src, "--src_strategy", strategy_dir,
                               "--dst_checkpoint", out, "--dst_strategy", other)
    assert "names parameters missing from" in _error(
        capsys, "--src_checkpoint", src, "--src_strategy", other, "--dst_checkpoint", out)
    os.makedirs(os.path.join(out, "rank_0"))
    assert "already holds rank_<i> folders" in _error(
        capsys, "--src_checkpoint", src, "--src_strategy", strategy_dir, "--dst_checkpoint", out)


# ---------------------------------------------------------------- a whole checkpoint into shards (MindRLHF's tutorial)
WHOLE = str(TINY_SFT_CKPT)


@pytest.mark.parametrize("key", list(NET_LAYOUTS))
def test_whole_checkpoint_splits_like_mindspore_bit_for_bit(tmp_path, key, capsys):
    from mindrlhf.parallel.strategy import read_staged_strategy_file

    strategy_dir, plain = tiny_strategy(str(tmp_path), key)
    oracle = mindspore_split(str(tmp_path), plain)
    out = str(tmp_path / "out")
    assert transform_checkpoint.main([f"--src_checkpoint={WHOLE}", f"--dst_checkpoint={out}",
                                f"--dst_strategy={strategy_dir}"]) == 0, capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["rank_0", "rank_1", "strategy.ckpt"]
    ours = [_load_rank(out, rank) for rank in range(2)]
    for rank in range(2):
        assert os.listdir(os.path.join(out, f"rank_{rank}")) == [f"checkpoint_{rank}.ckpt"]
        theirs = _load_rank(oracle, rank)
        assert sorted(ours[rank]) == sorted(theirs), rank
        for name, value in theirs.items():
            got = ours[rank][name]
            assert (got.dtype, got.shape) == (value.dtype, value.shape), (rank, name)
            assert got.tobytes() == value.tobytes(), (rank, name)
    if key == "tp2":  # the shards really differ per rank
        name = "model.layers.0.attention.wq.weight"
        assert ours[0][name].shape == (32, 64) and not np.array_equal(ours[0][name], ours[1][name])
    if key == "pp2":  # each rank holds its stage
        assert "lm_head.weight" in ours[1] and "lm_head.weight" not in ours[0]
    # the folder describes itself: the strategy with the checkpoint's plain names
    assert read_staged_strategy_file(os.path.join(out, "strategy.ckpt")) == read_staged_strategy_file(plain)


def test_shards_reshard_folder_to_folder_onto_stage_files(tmp_path, capsys):
    """A folder the tool wrote names its own strategy (no --src_strategy), and a destination folder of the stages'
    own files is merged for MindSpore: tp=2 shards -> pp=2 equal the whole checkpoint cut for pp=2."""
    tp2_strategy, _ = tiny_strategy(str(tmp_path / "tp2"), "tp2")
    pp2_strategy, pp2_plain = tiny_strategy(str(tmp_path / "pp2"), "pp2", prefix="")
    tool = transform_checkpoint
    assert tool.main([f"--src_checkpoint={WHOLE}", f"--dst_checkpoint={tmp_path / 'tp2_shards'}",
                      f"--dst_strategy={tp2_strategy}"]) == 0
    assert tool.main(["--src_checkpoint", str(tmp_path / "tp2_shards"), "--dst_checkpoint", str(tmp_path / "pp2"),
                      "--dst_strategy", pp2_strategy, "--prefix", "pp_"]) == 0, capsys.readouterr().err
    oracle = mindspore_split(str(tmp_path / "oracle"), pp2_plain)
    for rank in range(2):
        got, expected = _load_rank(str(tmp_path / "pp2"), rank), _load_rank(oracle, rank)
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            assert got[name].tobytes() == value.tobytes(), (rank, name)
    assert os.path.isfile(tmp_path / "pp2" / "strategy.ckpt")


def test_whole_checkpoint_errors(tmp_path, capsys):
    out = str(tmp_path / "out")
    strategy_dir, _ = tiny_strategy(str(tmp_path), "tp2")
    assert "--src_strategy: not used with a whole checkpoint" in _error(
        capsys, "--src_checkpoint", WHOLE, "--src_strategy", strategy_dir, "--dst_checkpoint", out,
        "--dst_strategy", strategy_dir)
    assert "is already one whole checkpoint: give --dst_strategy" in _error(
        capsys, "--src_checkpoint", WHOLE, "--dst_checkpoint", out)
    other = write_strategy_file(tmp_path / "other.ckpt", layouts_for(Layout(tp=2), SPLIT_AXES, FULL_SHAPES))
    err = _error(capsys, "--src_checkpoint", WHOLE, "--dst_checkpoint", out, "--dst_strategy", other)
    assert f"{other} names parameters with no entry in {WHOLE}" in err and "layer.w1.bias" in err
    # files of one stage that disagree: not two stages to merge
    write_strategy_file(os.path.join(strategy_dir, strategy_file_name(5)),
                        layouts_for(Layout(dp=2, tp=1), {"model.norm_out.weight": None},
                                    {"model.norm_out.weight": (64,)}))
    err = _error(capsys, "--src_checkpoint", WHOLE, "--dst_checkpoint", out, "--dst_strategy", strategy_dir)
    assert "disagree on parameter" in err and "of pipeline stage 0" in err
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"\x00junk")
    assert "not a readable MindSpore checkpoint" in _error(
        capsys, "--src_checkpoint", str(junk), "--dst_checkpoint", out, "--dst_strategy", other)
    assert not os.path.exists(out)
