"""The data of the stages before RL as the engines read it: rows of [prompt | response] (`Experience` columns) with
a seeded held-out split, epochs and a position a checkpoint keeps.

SFT: a row per conversation, its prompt the tokens before its first trained token (`loss_mask` marks the trained
ones of its response). Pairs: two rows per pair, the chosen answer then the rejected one, on the same prompt.
"""
from __future__ import annotations

import os

import numpy as np

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
            order = np.random.default_rng(seed).permutation(len(records))
            held = max(1, round(eval_fraction * len(records))) if eval_fraction > 0 else 0
            if held >= len(records):
                raise DataError(f"{path}: {len(records)} record(s) leave none to train on after holding out {held} "
                                f"(eval_fraction={eval_fraction})")
            self.held_out = [records[i] for i in sorted(order[:held])]
            self.train = [records[i] for i in sorted(order[held:])]
        every = self.train + self.held_out
        self.prompt_width = _round_up(max(len(r[0]) for r in every))
        self.response_width = _round_up(max(len(answer) for r in every for answer in self._answers(r)))
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

    @staticmethod
    def _answers(record: tuple) -> tuple:
        """The token rows of a record that are read as responses."""
        return record[1:2]

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

    def _record(self, record: dict, number: int, path: str) -> tuple:
        ids = np.asarray(record["input_ids"], np.int32).reshape(-1)
        mask = np.asarray(record["loss_mask"], np.int32).reshape(-1)
        if ids.shape != mask.shape or not mask.any() or mask[0]:
            raise DataError(f"{path}: record {number}: expected input_ids and a loss_mask of the same length, some "
                            "tokens trained and the first not (write it with rlhf_data.py --kind sft)")
        return split_at_first_trained(ids, mask)

    def _columns(self, records: list[tuple]) -> dict[str, np.ndarray]:
        columns = {**self._prompt_columns([r[0] for r in records]),
                   **self._response_columns([r[1] for r in records])}
        loss_mask = np.zeros_like(columns["response_mask"])
        for i, (_, _, mask) in enumerate(records):
            loss_mask[i, :len(mask)] = mask
        columns["loss_mask"] = loss_mask
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

    def _columns(self, records: list[tuple]) -> dict[str, np.ndarray]:
        return {**self._prompt_columns([r[0] for r in records for _ in range(2)]),
                **self._response_columns([answer for r in records for answer in r[1:]])}
