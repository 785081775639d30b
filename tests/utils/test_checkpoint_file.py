"""`mindrlhf.utils.checkpoint_file`: `stored_tensors` reads what MindSpore's own writer and `write_checkpoint` write,
value for value as `mindspore.load_checkpoint` reads it (the oracle), one tensor at a time from the mapped file."""
import os
import tracemalloc

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindrlhf.utils import checkpoint_file  # noqa: E402
from mindrlhf.utils.checkpoint_file import stored_tensors, write_checkpoint  # noqa: E402


def tensors() -> dict:
    """One tensor of each dtype a job's files hold, a 0-d one and an empty one."""
    rng = np.random.default_rng(0)
    return {
        "model.w": ms.Tensor(rng.normal(size=(96, 8)).astype(np.float32)),  # 3 KiB
        "model.h": ms.Tensor(rng.normal(size=(3, 4, 2)).astype(np.float16)),
        "model.b": ms.Tensor(rng.normal(size=(7,)).astype(np.float32), ms.bfloat16),
        "adam_step": ms.Tensor(np.array(12, np.int32)),
        "mask": ms.Tensor(np.array([True, False, True])),
        "ids": ms.Tensor(np.arange(9, dtype=np.int64).reshape(3, 3)),
        "empty": ms.Tensor(np.zeros((0, 4), np.float32)),
    }


def read_all(path) -> dict:
    with stored_tensors(path) as stored:
        return {name: (tensor.dtype, tensor.shape, tensor.array()) for name, tensor in stored.items()}


def assert_reads_like_mindspore(path):
    expected = ms.load_checkpoint(path)
    got = read_all(path)
    assert list(got) == list(expected)  # the file's order
    for name, param in expected.items():
        dtype, shape, value = got[name]
        assert shape == tuple(param.shape) and value.shape == shape, name
        assert value.dtype == param.asnumpy().dtype, name
        np.testing.assert_array_equal(value.reshape(-1).view(np.uint8), param.asnumpy().reshape(-1).view(np.uint8),
                                      err_msg=name)


@pytest.mark.parametrize("crc_check", [False, True])
def test_files_of_mindspores_writer_read_as_mindspore_reads_them(tmp_path, monkeypatch, crc_check):
    """Including a tensor MindSpore splits into several records (its slice size made small here) and the CRC
    trailer of `crc_check=True`."""
    from mindspore.train import serialization

    monkeypatch.setattr(serialization, "SLICE_SIZE", 1)  # KiB: model.w goes out in 3 records
    path = str(tmp_path / "ms.ckpt")
    ms.save_checkpoint([{"name": name, "data": value} for name, value in tensors().items()], path, crc_check=crc_check)
    with stored_tensors(path) as stored:
        assert len(stored["model.w"].spans) == 3
    assert_reads_like_mindspore(path)


def test_files_of_write_checkpoint_in_many_records_read_as_mindspore_reads_them(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_file, "CHECKPOINT_CHUNK_BYTES", 16)  # every tensor in records of 16 bytes
    path = str(tmp_path / "ours.ckpt")
    write_checkpoint(tensors().items(), path)
    with stored_tensors(path) as stored:
        assert len(stored["model.w"].spans) == 96 * 8 * 4 // 16
    assert_reads_like_mindspore(path)


def test_a_file_that_is_not_a_whole_checkpoint_is_a_value_error(tmp_path):
    path = tmp_path / "w.ckpt"
    write_checkpoint(tensors().items(), str(path))
    data = path.read_bytes()
    for name, content, message in (("cut.ckpt", data[:len(data) // 2], "cut short|holds"),
                                   ("empty.ckpt", b"", "empty"),
                                   ("text.ckpt", b'{"step": 3}\n', "malformed|not a sequence")):
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            read_all(str(bad))


def test_a_file_larger_than_the_free_pages_is_read_and_only_the_tensors_asked_for_are_copied(tmp_path, monkeypatch):
    """MindSpore's loader refuses a file larger than the host's free pages (without the page cache; a host that has
    just written checkpoints has few): the mapped file is read whatever they are. Reading one tensor of four copies
    that tensor, not the file."""
    from mindrlhf.checkpoint.step import read_arrays

    size = 1 << 21  # 8 MiB of float32 each
    values = {f"t{i}": np.full(size, i, np.float32) for i in range(4)}
    path = str(tmp_path / "big.ckpt")
    write_checkpoint(values.items(), path)
    sysconf = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 256 if name == "SC_AVPHYS_PAGES" else sysconf(name))
    with pytest.raises(ValueError, match="exceeds current available memory"):
        ms.load_checkpoint(path)
    tracemalloc.start()
    try:
        got = read_arrays(path, keep=lambda name: name == "t2")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert list(got) == ["t2"]
    np.testing.assert_array_equal(got["t2"], values["t2"])
    assert 4 * size <= peak < 1.25 * 4 * size, peak  # one tensor's bytes
