"""`write_checkpoint`: a MindSpore `.ckpt` written tensor by tensor in bounded records, atomically;
`stored_tensors`: a `.ckpt` read tensor by tensor from the mapped file (one tensor's copy at a time).

`mindspore.save_checkpoint` holds ~3 copies of the largest tensor while it writes (its bytes, the record's
slice, the serialised record): 1.5 GiB for Qwen2.5-0.5B's embedding, which got a 0.5B GRPO run on a 24 GiB
machine OOM-killed while it saved. Here each tensor goes out in records of at most `CHECKPOINT_CHUNK_BYTES`
straight from its memory (MindSpore's loader joins the records of a name, as it does for its own files).
`mindspore.load_checkpoint` holds the file's bytes, their parsed records and the arrays at once (a resumed SmolLM2
job peaked 1.1 GiB above the straight run) and refuses a file larger than the host's free pages (without the page
cache); `stored_tensors` maps the file and copies one tensor at a time.
"""
from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

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


# MindSpore's tensor type names (`tensor_type` of checkpoint.proto's TensorProto) of the numpy dtypes; BFloat16 is
# MindSpore's numpy bfloat16, looked up when a file has one
_NUMPY_DTYPES = {"Int8": np.int8, "UInt8": np.uint8, "Int16": np.int16, "UInt16": np.uint16, "Int32": np.int32,
                 "UInt32": np.uint32, "Int64": np.int64, "UInt64": np.uint64, "Float16": np.float16,
                 "Float32": np.float32, "Float64": np.float64, "Bool": np.bool_}
_CRC_TRAILER = b"crc_num"  # `save_checkpoint(crc_check=True)` ends the file with it and 10 bytes of CRC


_ITEMSIZES = {**{name: np.dtype(dtype).itemsize for name, dtype in _NUMPY_DTYPES.items()}, "BFloat16": 2}


def _itemsize(name: str) -> int:
    """Bytes of one element of MindSpore's tensor type `name`; a type this reader does not know is a ValueError
    (`stored_tensors` asks for every tensor of a file, so `_numpy_dtype` only sees known names)."""
    try:
        return _ITEMSIZES[name]
    except KeyError:
        raise ValueError(f"tensor type {name!r} is not read here") from None


def _numpy_dtype(name: str):
    if name == "BFloat16":
        from mindspore.common.np_dtype import bfloat16

        return bfloat16
    return _NUMPY_DTYPES[name]


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a mapped `.ckpt` where its records lie (`stored_tensors`); `array()` reads it."""

    dtype: str  # MindSpore's name: Float32, BFloat16, ...
    shape: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]  # byte ranges of its records' contents, in order
    buffer: memoryview  # of `mapped`
    mapped: mmap.mmap

    def array(self) -> np.ndarray:
        """A numpy copy of the tensor (the only copy this makes). The file's pages it read leave this process's
        resident memory again (they stay in the page cache): reading a file costs one tensor, not the file."""
        out = np.empty(self.shape, np.dtype(_numpy_dtype(self.dtype)))
        flat = out.reshape(-1).view(np.uint8)
        at = 0
        for start, stop in self.spans:
            flat[at:at + stop - start] = np.frombuffer(self.buffer, np.uint8, stop - start, start)
            at += stop - start
            first = start - start % mmap.PAGESIZE
            self.mapped.madvise(mmap.MADV_DONTNEED, first, stop - first)
        return out


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise ValueError("a record is cut short")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("a malformed record")


def _fields(buf, pos: int, end: int) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of the protobuf message in buf[pos:end]: a varint's int, or a
    length-delimited field's (start, stop); fixed-width fields are skipped."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            if pos + length > end:
                raise ValueError("a record is cut short")
            value, pos = (pos, pos + length), pos + length
        elif wire in (1, 5):
            value, pos = None, pos + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"a malformed record (wire type {wire})")
        yield number, wire, value


def _record(buf, start: int, end: int) -> tuple[str, str, tuple[int, ...], tuple[int, int]]:
    """(name, tensor type, dims, content span) of one `Checkpoint.Value` (checkpoint.proto: tag = 1, tensor = 2
    {dims = 1, tensor_type = 2, tensor_content = 3})."""
    name, tensor = None, None
    for number, _, value in _fields(buf, start, end):
        if number == 1:
            name = bytes(buf[value[0]:value[1]]).decode()
        elif number == 2:
            tensor = value
        elif number == 3:
            raise ValueError("a map tensor, which is not read here")
    if name is None or tensor is None:
        raise ValueError("a record without a name or a tensor")
    dims, dtype, content = [], None, None
    for number, wire, value in _fields(buf, *tensor):
        if number == 1 and wire == 0:
            dims.append(value)
        elif number == 1:  # packed dims
            pos, stop = value
            while pos < stop:
                dim, pos = _varint(buf, pos, stop)
                dims.append(dim)
        elif number == 2:
            dtype = bytes(buf[value[0]:value[1]]).decode()
        elif number == 3:
            content = value
    if dtype is None or content is None:
        raise ValueError(f"the record of {name!r} has no tensor type or content")
    return name, dtype, tuple(dims), content


@contextlib.contextmanager
def stored_tensors(path: str) -> Iterator[dict[str, StoredTensor]]:
    """name -> `StoredTensor` of a MindSpore `.ckpt` (as `mindspore.save_checkpoint` or `write_checkpoint` writes
    it: `Checkpoint` records, a name's records in order), valid inside the `with`: the file is mapped, its records'
    headers read, and no tensor's data touched until `array()` copies it. A ValueError for a file that is not one
    (cut short, another format, an encrypted or map-tensor file)."""
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            raise ValueError("the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            end = len(buf)
            if end >= 17 and buf[end - 17:end - 10] == _CRC_TRAILER:
                end -= 17
            found: dict[str, tuple[str, tuple[int, ...], list]] = {}
            for number, wire, value in _fields(buf, 0, end):
                if number != 1 or wire != 2:
                    raise ValueError("not a sequence of MindSpore checkpoint records")
                name, dtype, dims, content = _record(buf, *value)
                if name in found:
                    found[name][2].append(content)
                else:
                    found[name] = (dtype, dims, [content])
            for name, (dtype, dims, spans) in found.items():
                stored, expected = sum(stop - start for start, stop in spans), int(np.prod(dims)) * _itemsize(dtype)
                if stored != expected:
                    raise ValueError(f"{name!r} holds {stored} bytes for a {dtype} tensor of shape {list(dims)} "
                                     f"({expected} bytes)")
            view = memoryview(buf)
            try:
                yield {name: StoredTensor(dtype, dims, tuple(spans), view, buf)
                       for name, (dtype, dims, spans) in found.items()}
            finally:
                view.release()
