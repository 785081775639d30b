"""One set of tool answers for a group of ranks that roll out the same samples (a tensor-parallel inference group):
the group's first rank runs the tools and the others receive its answers, so that every rank appends the same tool
turns even when a tool is not deterministic or times out on one rank only."""
from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from mindrlhf.tool_use.turns import ToolTurn

_MIN_PAYLOAD = 256  # bytes; the payload is padded to a power of two (one collective graph per size)


def encode_answers(answers: Sequence[ToolTurn | None]) -> np.ndarray:
    """The answers as UTF-8 JSON bytes (uint8)."""
    records = [None if a is None else {"tokens": [int(t) for t in a.tokens], "calls": a.calls} for a in answers]
    return np.frombuffer(json.dumps(records, ensure_ascii=False).encode(), np.uint8)


def decode_answers(payload: np.ndarray) -> list[ToolTurn | None]:
    """The answers `encode_answers` wrote."""
    records = json.loads(payload.astype(np.uint8).tobytes().decode())
    return [None if r is None else ToolTurn(r["tokens"], r["calls"]) for r in records]


def padded_size(size: int) -> int:
    """The payload's bucket: the smallest power of two >= `size` (at least `_MIN_PAYLOAD`)."""
    return max(_MIN_PAYLOAD, 1 << max(0, int(size) - 1).bit_length())


class GroupToolTurns:
    """A tool-turn handler shared by `group`'s ranks: the `leader` answers with `turns` (`ToolTurns`), the others
    contribute zeros to two group sums (the payload's size, then the payload) and read the leader's answers.
    `comm` is an `ArrayCollectives`; every rank of the group calls `respond` with the same turns."""

    def __init__(self, turns, comm, group: str, leader: bool):
        self.turns, self.comm, self.group, self.leader = turns, comm, group, leader

    def respond(self, turns: Sequence[Sequence[int]]) -> list[ToolTurn | None]:
        payload = encode_answers(self.turns.respond(turns)) if self.leader else np.zeros(0, np.uint8)
        size = int(self.comm.group_sum(np.array([payload.size], np.float32), self.group)[0])
        padded = np.zeros(padded_size(size), np.float32)
        padded[:payload.size] = payload  # bytes are exact in float32, and a sum with zeros is exact
        received = self.comm.group_sum(padded, self.group)
        return decode_answers(received[:size])
