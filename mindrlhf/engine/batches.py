"""Rows of a batch, pure arithmetic: each data-parallel rank's share, its rows of each optimizer update, the graph
calls (micro-batches) of a pass with their prompts read once per group of responses, and the response widths a
call reads.

Rows are responses: sample i of prompt j is row j * G + i (G responses per prompt).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


def update_slices(rows_per_rank: int, groups_per_update: int, group_size: int, dp_size: int) -> list[slice]:
    """A data-parallel rank's rows of each optimizer update of one pass: consecutive runs of its share of an
    update (`groups_per_update` x `group_size` / `dp_size` rows) of its own rows, as verl's workers split theirs
    into mini-batches (an update's rows are every rank's run of the same index; the last run may be shorter)."""
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


@dataclasses.dataclass(frozen=True)
class RankRows:
    """A data-parallel rank's rows of a step's training batch (`rows`, a table of columns with `rows()`,
    `num_rows` and `response_mask`) and what the ranks' updates must agree on: `row_tokens` [dp, n], the response
    tokens of every rank's rows, rank-major (row i of rank r is row r n + i of the whole batch)."""

    rows: Any
    row_tokens: np.ndarray
    dp_rank: int

    @property
    def first_row(self) -> int:
        """The index of this rank's first row in the whole batch."""
        return self.dp_rank * self.row_tokens.shape[1]

    @classmethod
    def of_batch(cls, batch, dp_size: int, dp_rank: int) -> RankRows:
        """This rank's contiguous share (`rows_of_rank`) of the whole `batch`, which every rank holds."""
        row_tokens = batch.response_mask.sum(axis=1).reshape(dp_size, -1) if batch.num_rows else \
            np.zeros((dp_size, 0), np.int64)
        return cls(batch.rows(rows_of_rank(batch.num_rows, dp_size, dp_rank)), row_tokens, dp_rank)


def group_unit(group_size: int, dp_size: int) -> int:
    """Smallest number of groups whose rows split evenly over `dp_size` ranks."""
    return dp_size // math.gcd(group_size, dp_size)


def prompt_run(group_size: int, first_row: int, rows: int) -> int:
    """The most consecutive rows, from the first, that always hold one prompt: `rows` rows starting at row `first_row`
    of an experience whose prompts come in groups of `group_size` responses (row j G + i is response i of prompt j).
    What a graph call may read once for that many responses."""
    return math.gcd(group_size, first_row, rows)


def prompt_micro_batches(arrays, size: int, share: int) -> list[list]:
    """Graph-call inputs from the rows of `arrays` (prompt ids, prompt mask, then per-response columns): consecutive
    micro-batches of `size` responses, each with its prompts once per `share` responses ([size / share, P]), as the
    response cells take them (`mindrlhf.algorithms.policy_cells`). `share` must divide `size` and be a run of
    :func:`prompt_run`."""
    import mindspore as ms

    if size % share:
        raise ValueError(f"{share} responses a prompt do not divide micro-batches of {size}")
    rows = len(arrays[0])
    return [[ms.Tensor(a[start:start + size:share]) for a in arrays[:2]] +
            [ms.Tensor(a[start:start + size]) for a in arrays[2:]] for start in range(0, rows, size)]


def response_widths(max_width: int, buckets: int) -> list[int]:
    """The widths a pass may cut responses padded to `max_width` to: `buckets` even steps up to `max_width`, each
    rounded up to a multiple of 8 (48 in 3: 16, 32, 48); one width (`max_width`) with `buckets` <= 1."""
    steps = max(1, buckets)
    return sorted({min(max_width, math.ceil(math.ceil(k * max_width / steps) / 8) * 8) for k in range(1, steps + 1)})


def trimmed_width(longest: int, widths: list[int]) -> int:
    """The narrowest of `widths` that holds a response of `longest` tokens (the widest of `widths` is the
    responses' padded width)."""
    return min(width for width in widths if width >= longest)


def trim_responses(arrays, width: int) -> list:
    """`arrays` (prompt ids, prompt mask, then per-response columns) with every per-token column ([N, R]) cut to
    its first `width` positions: the rest is padding after every response's end."""
    return list(arrays[:2]) + [a[:, :width] if a.ndim > 1 else a for a in arrays[2:]]
