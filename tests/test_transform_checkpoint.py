"""tools/transform_checkpoint.py: happy paths through a subprocess, error checks in-process (cheaper)."""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest

from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.strategy import layouts_for, strategy_file_name, write_strategy_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "transform_checkpoint.py")
SPLIT_AXES = {"layer.w1.weight": 0, "layer.w2.weight": 1, "norm.weight": None, "layer.w1.bias": 0}
FULL_SHAPES = {"layer.w1.weight": (8, 6), "layer.w2.weight": (6, 8), "norm.weight": (6,), "layer.w1.bias": (8,)}


def _tool_module():
    spec = importlib.util.spec_from_file_location("transform_checkpoint_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=120, check=False,
                          env=env)


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


def test_cli_reports_missing_rank_file(tmp_path, tp2_job):
    src, strategy_dir = tp2_job
    shutil.rmtree(os.path.join(src, "rank_1"))
    result = _run("--src_checkpoint", src, "--src_strategy", strategy_dir, "--dst_checkpoint", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "missing rank file(s) for rank(s) [1]" in result.stderr and "world size" in result.stderr
    assert not os.path.exists(tmp_path / "out")


def _error(capsys, *argv: str) -> str:
    assert _tool_module().main(list(argv)) == 2
    return capsys.readouterr().err


def test_errors_before_transform(tmp_path, tp2_job, tensors, capsys):
    src, strategy_dir = tp2_job
    out = str(tmp_path / "out")
    assert "--src_checkpoint /nonexistent: no such folder" in _error(
        capsys, "--src_checkpoint", "/nonexistent", "--src_strategy", strategy_dir, "--dst_checkpoint", out)
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
