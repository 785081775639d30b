"""`write_checkpoint`: a MindSpore `.ckpt` written tensor by tensor in bounded records, atomically;
`read_checkpoint`: `mindspore.load_checkpoint` with its memory check counting the memory the host can give.

`mindspore.save_checkpoint` holds ~3 copies of the largest tensor while it writes (its bytes, the record's
slice, the serialised record): 1.5 GiB for Qwen2.5-0.5B's embedding, which got a 0.5B GRPO run on a 24 GiB
machine OOM-killed while it saved. Here each tensor goes out in records of at most `CHECKPOINT_CHUNK_BYTES`
straight from its memory (MindSpore's loader joins the records of a name, as it does for its own files).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from mindrlhf.utils.atomic import atomic_output

# MindSpore is imported by the functions that write and read: utils is MindSpore-free (tests/test_architecture.py)

CHECKPOINT_CHUNK_BYTES = 64 << 20


def _bytes_and_dtype(value):
    """(uint8 view of the data, MindSpore's dtype name) of a Tensor/Parameter or a numpy array (including
    MindSpore's numpy bfloat16), without copying a contiguous array."""
    import mindspore as ms

    if isinstance(value, np.ndarray):
        # MindSpore's name of the numpy dtype, from a one-element tensor
        dtype = str(ms.Tensor(np.zeros(1, value.dtype)).dtype)
    else:
        dtype, value = str(value.dtype), value.asnumpy()
    return np.ascontiguousarray(value).reshape(-1).view(np.uint8), dtype


def write_checkpoint(named_values: Iterable[tuple[str, object]], path: str) -> None:
    """Writes (name, Tensor or numpy array) pairs as a MindSpore `.ckpt` that `mindspore.load_checkpoint` reads,
    atomically (`atomic_output`: ordinary permissions, nothing left on failure); extra memory ~2 records."""
    from mindspore.train.checkpoint_pb2 import Checkpoint

    with atomic_output(path, ".ckpt") as tmp, open(tmp, "wb") as f:
        for name, value in named_values:
            data, dtype = _bytes_and_dtype(value)
            for start in range(0, max(len(data), 1), CHECKPOINT_CHUNK_BYTES):
                record = Checkpoint()
                entry = record.value.add()
                entry.tag = name
                entry.tensor.dims.extend(value.shape)
                entry.tensor.tensor_type = dtype
                entry.tensor.tensor_content = data[start:start + CHECKPOINT_CHUNK_BYTES].tobytes()
                f.write(record.SerializeToString())


def available_memory_bytes() -> int | None:
    """The memory the kernel can give a process now without swapping (`MemAvailable` of /proc/meminfo: free pages
    and the page cache and other memory it can reclaim), or None where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def read_checkpoint(path: str) -> dict:
    """`mindspore.load_checkpoint(path)` (name -> Parameter). MindSpore refuses a `.ckpt` larger than the host's
    *free* pages (`SC_AVPHYS_PAGES`), which leave out the page cache: on a host that has just written checkpoints
    most memory is cache, and a resumed SmolLM2 job (1.6 GB a rank file, 10 GiB available) was refused with ~0.2
    GiB "available". Here the check counts the memory the kernel can give (`available_memory_bytes`)."""
    import mindspore as ms
    from mindspore.train import serialization

    original = getattr(serialization, "_get_available_memory", None)
    if original is None:  # another MindSpore: its own check, whatever it is
        return ms.load_checkpoint(path)
    serialization._get_available_memory = available_memory_bytes
    try:
        return ms.load_checkpoint(path)
    finally:
        serialization._get_available_memory = original
