"""Rows of a batch, pure arithmetic: each data-parallel rank's share, its rows of each optimizer update, the graph
calls (micro-batches) of a pass with their prompts read once per group of responses, and the response widths a
call reads.

Rows are responses: sample i of prompt j is row j * G + i (G responses per prompt).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mindrlhf.data.experience import PROMPT_COLUMNS


def update_slices(rows_per_rank: int, groups_per_update: int, group_size: int, dp_size: int) -> list[slice]:
    """A data-parallel rank's rows of each optimizer update of one pass, its rows being in update order
    (`rows_of_updates`): consecutive runs of its share of an update (`groups_per_update` x `group_size` / `dp_size`
    rows; the last run may be shorter)."""
    update_rows = groups_per_update * group_size
    if update_rows % dp_size:
        raise ValueError(f"an update of {groups_per_update} prompts x {group_size} responses cannot be split evenly "
                         f"over data_parallel={dp_size}")
    run = update_rows // dp_size
    return [slice(start, min(start + run, rows_per_rank)) for start in range(0, rows_per_rank, run)]


def rows_of_rank(num_rows: int, dp_size: int, dp_rank: int) -> slice:
    """This data-parallel rank's contiguous share of `num_rows` rows (which dp_size must divide)."""
    if num_rows % dp_size:
        raise ValueError(f"{num_rows} rows cannot be split evenly over data_parallel={dp_size}")
    per_rank = num_rows // dp_size
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def rows_of_updates(num_rows: int, update_rows: int, dp_size: int, dp_rank: int) -> np.ndarray:
    """The rows a data-parallel rank trains on in a pass over `num_rows` rows, in update order: its share
    (`rows_of_rank`) of each run of `update_rows` rows (an optimizer update; the last run may be shorter). Every
    layout makes the same updates of the same rows: a job learns alike whatever its dp."""
    parts = []
    for start in range(0, num_rows, update_rows):
        share = rows_of_rank(min(update_rows, num_rows - start), dp_size, dp_rank)
        parts.append(np.arange(start + share.start, start + share.stop))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclasses.dataclass(frozen=True)
class RankRows:
    """A data-parallel rank's rows of a step's training batch in update order (`rows`, a table of columns with
    `rows()`, `num_rows` and `response_mask`; its updates are consecutive runs, `update_slices`), their indices in
    the whole batch (`batch_rows`) and what the ranks' updates must agree on: `row_tokens` [dp, n], the loss's
    tokens of every rank's rows, each in its rank's order (and their lengths, `lengths`)."""

    rows: Any
    row_tokens: np.ndarray
    batch_rows: np.ndarray
    row_lengths: np.ndarray | None = None  # [dp, n] the responses' lengths, when the loss counts other tokens

    @property
    def lengths(self) -> np.ndarray:
        """[dp, n] every rank's responses' lengths (what a call must read)."""
        return self.row_tokens if self.row_lengths is None else self.row_lengths

    @classmethod
    def of_batch(cls, batch, dp_size: int, dp_rank: int, update_rows: int,
                 token_mask: str = "response_mask") -> RankRows:
        """This rank's rows (`rows_of_updates`) of the whole `batch`, which every rank holds; `row_tokens` counts
        the tokens of `token_mask` (the loss's: SFT trains only the assistant's tokens of a response)."""
        ranks = [rows_of_updates(batch.num_rows, update_rows, dp_size, rank) for rank in range(dp_size)]

        def per_rank(values: np.ndarray) -> np.ndarray:
            return np.stack([values[rows] for rows in ranks]).reshape(dp_size, -1)

        lengths = per_rank(batch.response_mask.sum(axis=1))
        tokens = lengths if token_mask == "response_mask" else per_rank(batch[token_mask].sum(axis=1))
        return cls(batch.rows(ranks[dp_rank]), tokens, ranks[dp_rank],
                   None if token_mask == "response_mask" else lengths)


def group_unit(group_size: int, dp_size: int) -> int:
    """Smallest number of groups whose rows split evenly over `dp_size` ranks."""
    return dp_size // math.gcd(group_size, dp_size)


def prompt_run(group_size: int, first_row: int, rows: int) -> int:
    """The most consecutive rows, from the first, that always hold one prompt: `rows` rows starting at row `first_row`
    of an experience whose prompts come in groups of `group_size` responses (row j G + i is response i of prompt j).
    What a graph call may read once for that many responses."""
    return math.gcd(group_size, first_row, rows)


def prompt_micro_batches(columns: Mapping[str, np.ndarray], size: int, share: int,
                         names: Sequence[str] | None = None) -> list[list]:
    """Graph-call inputs from `columns` (name -> rows): consecutive micro-batches of `size` responses, each the
    columns `names` (default: all, in order) in the order the cell takes them (a name may come twice: a loss without
    a reference reads the old log-probs in its place), the prompt columns (`PROMPT_COLUMNS`) once per `share`
    responses ([size / share, P]), as the response cells take them (`mindrlhf.algorithms.policy_cells`). `share`
    must divide `size` and be a run of :func:`prompt_run`."""
    import mindspore as ms

    if size % share:
        raise ValueError(f"{share} responses a prompt do not divide micro-batches of {size}")
    names = list(columns) if names is None else names
    rows = len(columns[names[0]])
    return [[ms.Tensor(columns[name][start:start + size:share] if name in PROMPT_COLUMNS else
                       columns[name][start:start + size]) for name in names] for start in range(0, rows, size)]


def response_widths(max_width: int, buckets: int) -> list[int]:
    """The widths a pass may cut responses padded to `max_width` to: `buckets` even steps up to `max_width`, each
    rounded up to a multiple of 8 (48 in 3: 16, 32, 48); one width (`max_width`) with `buckets` <= 1."""
    steps = max(1, buckets)
    return sorted({min(max_width, math.ceil(math.ceil(k * max_width / steps) / 8) * 8) for k in range(1, steps + 1)})


def trimmed_width(longest: int, widths: list[int]) -> int:
    """The narrowest of `widths` that holds a response of `longest` tokens (the widest of `widths` is the
    responses' padded width)."""
    return min(width for width in widths if width >= longest)


def trim_responses(columns: Mapping[str, np.ndarray], width: int) -> dict[str, np.ndarray]:
    """`columns` with every per-token column of the responses ([N, R], any but `PROMPT_COLUMNS`) cut to its first
    `width` positions: the rest is padding after every response's end."""
    return {name: a[:, :width] if a.ndim > 1 and name not in PROMPT_COLUMNS else a for name, a in columns.items()}
