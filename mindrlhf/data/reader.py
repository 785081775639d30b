"""Reads the prompt MindRecord into left-padded, bucketed, data-parallel-sharded, resumable batches."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence

import numpy as np

from mindrlhf.configs.generation import bucket_length
from mindrlhf.data.sources import DataError

REQUIRED_FIELDS = ("prompt_ids", "solution")


def pad_rows(rows: Sequence[Sequence[int]], width: int, pad_token_id: int,
             side: str = "left") -> tuple[np.ndarray, np.ndarray]:
    """Token rows padded to `width`: (ids int32 [N, width], mask int32 [N, width], 1 on tokens).

    `side="left"` for prompts (generation continues at the right edge), "right" for responses.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    ids = np.full((len(rows), width), pad_token_id, dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"row {i} has {len(row)} tokens, more than the padded width {width}")
        if len(row):
            where = slice(width - len(row), width) if side == "left" else slice(0, len(row))
            ids[i, where] = row
            mask[i, where] = 1
    return ids, mask


def pipeline_error(err: Exception) -> str:
    """The line of MindSpore's dataset error report that says what went wrong (its 'Dataset Pipeline Error Message'
    section, without the `[ERROR] [Internal ERROR]` tags), else the report's first line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for at, line in enumerate(lines):
        if line.startswith("- Dataset Pipeline Error Message") and at + 2 < len(lines):
            return lines[at + 2].replace("[ERROR]", "").replace("[Internal ERROR]", "").strip()
    return lines[0] if lines else type(err).__name__


def read_mindrecord(mindrecord_path: str | os.PathLike, required: Sequence[str], kind: str = "prompts",
                    ) -> tuple[list[dict], dict]:
    """(every record, the schema) of a MindRecord file of `rlhf_data.py --kind <kind>`, in file order; a missing,
    damaged or other kind of file is a one-line `DataError` / `FileNotFoundError` naming it."""
    mindrecord_path = os.fspath(mindrecord_path)
    if not os.path.isfile(mindrecord_path):
        raise FileNotFoundError(f"{mindrecord_path}: MindRecord file not found "
                                f"(write it with examples/qwen_grpo_tutorial/rlhf_data.py --kind {kind})")
    if not os.path.isfile(mindrecord_path + ".db"):
        raise FileNotFoundError(f"{mindrecord_path}.db: MindRecord index file not found (it must lie next to "
                                f"{os.path.basename(mindrecord_path)})")
    from mindspore.mindrecord import FileReader  # heavy import, only when reading

    try:
        reader = FileReader(mindrecord_path, num_consumer=1)
    except Exception as err:  # MindSpore raises RuntimeError with a multi-line pipeline report
        raise DataError(f"{mindrecord_path}: cannot read MindRecord file ({pipeline_error(err)}): it is damaged or "
                        "cut short (a write or copy that did not finish?); write it again with "
                        "examples/qwen_grpo_tutorial/rlhf_data.py") from None
    try:
        schema = reader.schema()
        missing = [name for name in required if name not in schema]
        if missing:
            raise DataError(f"{mindrecord_path}: MindRecord has no field(s) {missing} (fields: {sorted(schema)}); "
                            f"expected the output of rlhf_data.py --kind {kind}")
        records = list(reader.get_next())
    finally:
        reader.close()
    return records, schema


def read_prompt_records(mindrecord_path: str | os.PathLike, with_columns: bool = False) -> tuple:
    """All (prompt_ids, solution) of a MindRecord written by `convert_to_mindrecord`, in file order; with
    `with_columns` also each record's other dataset fields (a dict; empty in files written before they were
    kept)."""
    records, schema = read_mindrecord(mindrecord_path, REQUIRED_FIELDS)
    prompt_ids = [np.asarray(record["prompt_ids"], dtype=np.int64).reshape(-1) for record in records]
    solutions = [_text(record["solution"]) for record in records]
    if not with_columns:
        return prompt_ids, solutions
    columns = [json.loads(_text(record["columns"])) if "columns" in schema else {} for record in records]
    return prompt_ids, solutions, columns


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class PromptDataset:
    """Batches of prompts from a MindRecord, for one data-parallel rank.

    Every epoch the samples are ordered by a permutation drawn from (seed, epoch) (or file order when
    `shuffle` is False) and cut into global batches of `batch_size * dp_size`; rank r takes samples
    [r * batch_size, (r + 1) * batch_size) of each global batch, so the ranks see disjoint parts that
    together make the whole global batch. With `drop_last` the incomplete tail of an epoch is skipped;
    without it the tail is completed with samples from the start of the epoch's order.

    A batch is a dict of numpy arrays:
        prompt_ids      int32 [batch_size, L]  left-padded with `pad_token_id`
        attention_mask  int32 [batch_size, L]  1 on prompt tokens, 0 on padding
        prompt_length   int32 [batch_size]
        solution        list[str]
        columns         list[dict]             the prompts' other dataset fields (for reward functions)
        sample_index    int64 [batch_size]     position of each sample in the file
    L is the longest prompt of the whole global batch rounded up with `bucket_length`, so all dp ranks
    get the same shape.

    `state_dict()` / `load_state_dict()` hold the position (epoch, global batches consumed in it): a
    reader restored from a state yields exactly the batch the saved reader would have yielded next.
    """

    def __init__(
        self,
        mindrecord_path: str | os.PathLike,
        batch_size: int,
        pad_token_id: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        length_buckets: Sequence[int] | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size), got dp_rank={dp_rank}, dp_size={dp_size}")
        if length_buckets is not None:
            length_buckets = [int(b) for b in length_buckets]
            if any(b < 1 for b in length_buckets) or length_buckets != sorted(set(length_buckets)):
                raise ValueError(f"length_buckets must be positive and strictly increasing, got {length_buckets}")
        self.mindrecord_path = os.fspath(mindrecord_path)
        self.batch_size = batch_size
        self.pad_token_id = int(pad_token_id)
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.length_buckets = length_buckets
        self._prompt_ids, self._solutions, self._columns = read_prompt_records(self.mindrecord_path,
                                                                               with_columns=True)
        self._lengths = np.array([len(ids) for ids in self._prompt_ids], dtype=np.int64)
        if length_buckets and self.num_samples and self._lengths.max() > length_buckets[-1]:
            raise ValueError(f"{self.mindrecord_path}: longest prompt has {self._lengths.max()} tokens, more than "
                             f"the largest length bucket {length_buckets[-1]}")
        if self.batches_per_epoch == 0:
            raise DataError(f"{self.mindrecord_path}: {self.num_samples} prompts do not fill one global batch of "
                            f"{self.global_batch_size} (batch_size {batch_size} x dp_size {dp_size}) with "
                            f"drop_last=True")
        self._epoch = 0
        self._index = 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def num_samples(self) -> int:
        """Number of prompts in the file."""
        return len(self._prompt_ids)

    @property
    def global_batch_size(self) -> int:
        """Prompts per step over all dp ranks."""
        return self.batch_size * self.dp_size

    @property
    def batches_per_epoch(self) -> int:
        """Global batches (= steps) per epoch."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return -(-self.num_samples // self.global_batch_size)

    @property
    def epoch(self) -> int:
        """Epoch the next batch comes from."""
        return self._epoch

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample indices of `epoch` in reading order, `batches_per_epoch * global_batch_size` long."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        order = np.resize(order, self.batches_per_epoch * self.global_batch_size)  # cyclic fill of the tail
        self._order_cache = (epoch, order)
        return order

    def batch_at(self, epoch: int, index: int) -> dict:
        """This rank's part of global batch `index` of `epoch` (does not move the position)."""
        if not 0 <= index < self.batches_per_epoch:
            raise IndexError(f"batch index {index} out of range [0, {self.batches_per_epoch})")
        global_batch = self.epoch_order(epoch)[index * self.global_batch_size:(index + 1) * self.global_batch_size]
        padded_length = bucket_length(int(self._lengths[global_batch].max()), self.length_buckets)
        local = global_batch[self.dp_rank * self.batch_size:(self.dp_rank + 1) * self.batch_size]
        prompt_ids, attention_mask = pad_rows([self._prompt_ids[sample] for sample in local], padded_length,
                                              self.pad_token_id)
        return {
            "prompt_ids": prompt_ids,
            "attention_mask": attention_mask,
            "prompt_length": self._lengths[local].astype(np.int32),
            "solution": [self._solutions[sample] for sample in local],
            "columns": [self._columns[sample] for sample in local],
            "sample_index": local.astype(np.int64),
        }

    def next_batch(self) -> dict:
        """The next batch; moves on to the next epoch after the last batch of an epoch."""
        batch = self.batch_at(self._epoch, self._index)
        self._index += 1
        if self._index == self.batches_per_epoch:
            self._epoch += 1
            self._index = 0
        return batch

    def __iter__(self) -> Iterator[dict]:
        """The remaining batches of the current epoch."""
        epoch = self._epoch
        while self._epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """Position of the reader: {"epoch": epoch of the next batch, "index": global batches done in it}."""
        return {"epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state: dict) -> None:
        """Restores a position saved by `state_dict` (same file, seed and global batch size)."""
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"data state must be {{'epoch': int, 'index': int}}, got {state!r}") from None
        if epoch < 0 or not 0 <= index < self.batches_per_epoch:
            raise ValueError(f"data state {state!r} out of range: {self.batches_per_epoch} batches per epoch "
                             f"(global batch {self.global_batch_size}, {self.num_samples} prompts)")
        self._epoch, self._index = epoch, index
