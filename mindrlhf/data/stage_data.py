"""The data of the stages before RL as the engines read it: rows of [prompt | response] (`Experience` columns) with
a seeded held-out split, epochs and a position a checkpoint keeps.

SFT: a row per conversation, its prompt the tokens before its first trained token (`loss_mask` marks the trained
ones of its response); packed (`PackedSFTDataset`), several whole conversations a row, as its response.
Pairs: two rows per pair, the chosen answer then the rejected one, on the same prompt.
"""
from __future__ import annotations

import os

import numpy as np

from mindrlhf.data.conversations import pack_rows, packing_positions
from mindrlhf.data.experience import Experience
from mindrlhf.data.reader import pad_rows, read_mindrecord
from mindrlhf.data.sources import DataError

WIDTH_STEP = 8  # padded widths are multiples of it (one compiled shape per width)
SPLITS = ("train", "held_out")


def split_at_first_trained(ids: np.ndarray, loss_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt, response, the response's loss mask) of one SFT row: the prompt ends before its first trained token."""
    first = int(np.argmax(loss_mask > 0))
    return ids[:first], ids[first:], loss_mask[first:]


def _round_up(n: int) -> int:
    return max(WIDTH_STEP, -(-n // WIDTH_STEP) * WIDTH_STEP)


def held_out_records(keys: list, fraction: float, seed: int) -> list[int]:
    """Indices of the records held out: a seeded draw of whole groups (records of one non-None key; None: a record of
    its own) until `fraction` of the records (at least one) is reached; 0 holds none out."""
    if fraction <= 0:
        return []
    groups: dict = {}
    for index, key in enumerate(keys):
        groups.setdefault(index if key is None else key, []).append(index)
    members = list(groups.values())
    target, held = max(1, round(fraction * len(keys))), []
    for group in np.random.default_rng(seed).permutation(len(members)):
        if len(held) >= target:
            break
        held += members[group]
    return held


class StageDataset:
    """Records of a MindRecord (`rlhf_data.py --kind <KIND>`) in a training split, in a fresh seeded order each
    epoch, and a held-out split (`eval_path`'s records, or a seeded `eval_fraction` of the file's, at least one).
    Every batch of a run has the same widths (the longest prompt and answer of the data, rounded up to
    `WIDTH_STEP`): one compiled shape. Every rank reads the same batches (the engines take their share).
    `row_values` holds per-row values of each split a stage computes once (DPO's reference log-probs)."""

    KIND = ""
    FIELDS: tuple[str, ...] = ()
    ROWS_PER_RECORD = 1

    def __init__(self, path: str, pad_token_id: int, seed: int = 0, eval_fraction: float = 0.0, eval_path: str = ""):
        self.pad_token_id, self.seed = pad_token_id, seed
        records = self._read(path)
        if eval_path:
            self.train, self.held_out = records, self._read(eval_path)
        else:
            held = held_out_records([self._group_key(r) for r in records], eval_fraction, seed)
            if len(held) >= len(records):
                raise DataError(f"{path}: {len(records)} record(s) leave none to train on after holding out "
                                f"{len(held)} (eval_fraction={eval_fraction})")
            self.held_out = [records[i] for i in sorted(held)]
            self.train = [records[i] for i in sorted(set(range(len(records))) - set(held))]
        self.prompt_width, self.response_width = self._widths(self.train + self.held_out)
        self.train, self.held_out = self._arrange(self.train), self._arrange(self.held_out)
        self.row_values: dict[str, dict[str, np.ndarray]] = {split: {} for split in SPLITS}
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _read(self, path: str) -> list[tuple]:
        records, _ = read_mindrecord(path, self.FIELDS, kind=self.KIND)
        if not records:
            raise DataError(f"{os.fspath(path)}: no record")
        return [self._record(record, number, os.fspath(path)) for number, record in enumerate(records)]

    def _record(self, record: dict, number: int, path: str) -> tuple:
        raise NotImplementedError

    def _widths(self, records: list[tuple]) -> tuple[int, int]:
        """(prompt width, response width) of every batch: the longest prompt and answer, rounded up."""
        return (_round_up(max(len(r[0]) for r in records)),
                _round_up(max(len(answer) for r in records for answer in self._answers(r))))

    def _arrange(self, records: list[tuple]) -> list[tuple]:
        """A split's records as the rows batches draw from (packed rows: several records each)."""
        return records

    @staticmethod
    def _answers(record: tuple) -> tuple:
        """The token rows of a record that are read as responses."""
        return record[1:2]

    @staticmethod
    def _group_key(record: tuple) -> bytes | None:
        """Records of one key are held out together (None: each record on its own)."""
        return None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.train))

    def steps_per_epoch(self, batch_size: int) -> int:
        """Whole batches of `batch_size` records in an epoch (the last incomplete one is left out)."""
        return len(self.train) // batch_size

    def next_batch(self, batch_size: int) -> Experience:
        """The rows of the next `batch_size` training records; a new epoch (a new order) starts when the current one
        has fewer left."""
        if batch_size > len(self.train):
            raise DataError(f"schedule.batch_size={batch_size} is larger than the {len(self.train)} training records")
        if self.position + batch_size > len(self.train):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        picked = self._order[self.position:self.position + batch_size]
        self.position += batch_size
        return self.rows("train", picked)

    def split_rows(self, split: str) -> Experience:
        """Every record of `split` ("train" or "held_out") as rows, in order."""
        return self.rows(split, np.arange(len(getattr(self, split))))

    def rows(self, split: str, indices: np.ndarray) -> Experience:
        """Columns of the rows of `split`'s records `indices` (with that split's `row_values`)."""
        records = getattr(self, split)
        columns = self._columns([records[i] for i in indices])
        rows = (np.asarray(indices)[:, None] * self.ROWS_PER_RECORD + np.arange(self.ROWS_PER_RECORD)).reshape(-1)
        columns.update({name: values[rows] for name, values in self.row_values[split].items()})
        return Experience(columns)

    def _columns(self, records: list[tuple]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _prompt_columns(self, prompts: list[np.ndarray]) -> dict[str, np.ndarray]:
        ids, mask = pad_rows(prompts, self.prompt_width, self.pad_token_id)
        return {"prompt_ids": ids, "prompt_mask": mask}

    def _response_columns(self, responses: list[np.ndarray]) -> dict[str, np.ndarray]:
        ids, mask = pad_rows(responses, self.response_width, self.pad_token_id, side="right")
        return {"response_ids": ids, "response_mask": mask}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


class SFTDataset(StageDataset):
    """`rlhf_data.py --kind sft` conversations: a row each, with the `loss_mask` of its response's trained tokens."""

    KIND, FIELDS = "sft", ("input_ids", "loss_mask")

    @staticmethod
    def _conversation(record: dict, number: int, path: str) -> tuple[np.ndarray, np.ndarray]:
        """(input ids, loss mask) of a record, checked: equal lengths, some tokens trained and the first not."""
        ids = np.asarray(record["input_ids"], np.int32).reshape(-1)
        mask = np.asarray(record["loss_mask"], np.int32).reshape(-1)
        if ids.shape != mask.shape or not mask.any() or mask[0]:
            raise DataError(f"{path}: record {number}: expected input_ids and a loss_mask of the same length, some "
                            "tokens trained and the first not (write it with rlhf_data.py --kind sft)")
        return ids, mask

    def _record(self, record: dict, number: int, path: str) -> tuple:
        return split_at_first_trained(*self._conversation(record, number, path))

    def _columns(self, records: list[tuple]) -> dict[str, np.ndarray]:
        columns = {**self._prompt_columns([r[0] for r in records]),
                   **self._response_columns([r[1] for r in records])}
        loss_mask = np.zeros_like(columns["response_mask"])
        for i, (_, _, mask) in enumerate(records):
            loss_mask[i, :len(mask)] = mask
        columns["loss_mask"] = loss_mask
        return columns


class PackedSFTDataset(SFTDataset):
    """SFT conversations packed whole into rows of up to `max_length` tokens (0: the longest conversation, rounded
    up), best fit in decreasing length (TRL's `packing_strategy="bfd"`); a row's conversations are its response (no
    prompt columns), with `position_ids` restarting at each and `segment_ids` (1, 2, .. ; 0 for padding) that keep
    attention within each. A batch is `batch_size` packed rows; each split is packed once, before the first epoch."""

    def __init__(self, path: str, pad_token_id: int, seed: int = 0, eval_fraction: float = 0.0, eval_path: str = "",
                 max_length: int = 0):
        self.max_length = max_length
        super().__init__(path, pad_token_id, seed, eval_fraction, eval_path)

    def padding_shares(self) -> tuple[float, float]:
        """The share of the training rows' positions that is padding, packed and unpacked (`SFTDataset`'s rows: a
        conversation each, its prompt and response padded to the longest)."""
        prompts, responses = [], []
        for _, mask, _, segments in self.train:
            for k in range(1, int(segments.max()) + 1):
                trained = mask[segments == k] > 0
                prompts.append(int(np.argmax(trained)))
                responses.append(len(trained) - prompts[-1])
        tokens = sum(prompts) + sum(responses)
        unpacked = len(prompts) * (_round_up(max(prompts)) + _round_up(max(responses)))
        return 1 - tokens / (len(self.train) * self.response_width), 1 - tokens / unpacked

    def _record(self, record: dict, number: int, path: str) -> tuple:
        ids, mask = self._conversation(record, number, path)
        if self.max_length and len(ids) > self.max_length:
            raise DataError(f"{path}: record {number}: {len(ids)} tokens, more than sft.max_length={self.max_length} "
                            "(a packed row holds whole conversations)")
        return ids, mask

    def _widths(self, records: list[tuple]) -> tuple[int, int]:
        return 0, self.max_length or _round_up(max(len(r[0]) for r in records))

    def _arrange(self, records: list[tuple]) -> list[tuple]:
        if not records:
            return records
        lengths = [len(r[0]) for r in records]
        rows = pack_rows(lengths, self.response_width)
        packed = []
        for row in rows:
            positions, segments = packing_positions([lengths[i] for i in row])
            packed.append((np.concatenate([records[i][0] for i in row]), np.concatenate([records[i][1] for i in row]),
                           positions, segments))
        return packed

    @staticmethod
    def _answers(record: tuple) -> tuple:
        return record[:1]

    def _columns(self, records: list[tuple]) -> dict[str, np.ndarray]:
        columns = self._response_columns([r[0] for r in records])
        for name, part in (("loss_mask", 1), ("position_ids", 2), ("segment_ids", 3)):
            columns[name] = pad_rows([r[part] for r in records], self.response_width, 0, side="right")[0]
        return columns


class PairDataset(StageDataset):
    """`rlhf_data.py --kind pairwise` pairs: two rows each, the chosen answer (row 2j) and the rejected one (2j + 1),
    on the same prompt."""

    KIND, FIELDS, ROWS_PER_RECORD = "pairwise", ("prompt_ids", "chosen_ids", "rejected_ids"), 2

    def _record(self, record: dict, number: int, path: str) -> tuple:
        prompt, chosen, rejected = (np.asarray(record[f], np.int32).reshape(-1) for f in self.FIELDS)
        if not (len(prompt) and len(chosen) and len(rejected)):
            raise DataError(f"{path}: record {number}: an empty prompt or answer (write it with rlhf_data.py --kind "
                            "pairwise)")
        return prompt, chosen, rejected

    @staticmethod
    def _answers(record: tuple) -> tuple:
        return record[1:]

    @staticmethod
    def _group_key(record: tuple) -> bytes:
        # the pairs of one prompt (several wrong answers against its right one) all train or all stay held out
        return record[0].tobytes()

    def _columns(self, records: list[tuple]) -> dict[str, np.ndarray]:
        return {**self._prompt_columns([r[0] for r in records for _ in range(2)]),
                **self._response_columns([answer for r in records for answer in r[1:]])}
