"""A tensor-parallel group's tool turns: the leader's answers reach every rank (two ranks as threads over a group
sum), the other ranks run no tool; the payload round-trips non-ASCII results and answers without a call."""
import threading

import numpy as np

from mindrlhf.tool_use.group import GroupToolTurns, decode_answers, encode_answers, padded_size
from mindrlhf.tool_use.turns import ToolTurn


class ThreadGroup:
    """A group sum over `ranks` threads (each calls `group_sum` in turn, as ranks call a collective)."""

    def __init__(self, ranks: int):
        self.barrier = threading.Barrier(ranks)
        self.parts: dict[int, np.ndarray] = {}
        self.calls: list[tuple] = []

    def member(self, rank: int):
        group = self

        class Member:
            def group_sum(self, array, name):
                group.calls.append((rank, name, np.asarray(array).shape))
                group.parts[rank] = np.asarray(array, np.float32)
                group.barrier.wait()
                total = sum(group.parts.values())
                group.barrier.wait()
                return total
        return Member()


class SaltedTurns:
    """Answers every even-length turn with tokens and a result that name this rank; odd turns call no tool."""

    def __init__(self, rank: int):
        self.rank, self.asked = rank, 0

    def respond(self, turns):
        self.asked += 1
        calls = [{"name": "f", "result": f"rang {self.rank} é✓"}]
        return [None if len(t) % 2 else ToolTurn([1000 + self.rank, len(t)], calls) for t in turns]


def test_every_rank_of_the_group_gets_the_leaders_answers_and_only_the_leader_calls():
    group = ThreadGroup(2)
    handlers = [SaltedTurns(0), SaltedTurns(1)]
    shared = [GroupToolTurns(handlers[r], group.member(r), "tp", leader=r == 0) for r in range(2)]
    turns = [[5, 6], [7], [1, 2, 3, 4]]
    results = [None, None]

    def run(rank):
        results[rank] = shared[rank].respond(turns)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    expected = handlers[0].respond(turns)
    assert results[0] == results[1] == expected
    assert results[1][0].tokens == [1000, 2] and results[1][1] is None
    assert results[1][2].calls == [{"name": "f", "result": "rang 0 é✓"}]
    assert handlers[1].asked == 0  # the other rank ran no tool
    assert {name for _, name, _ in group.calls} == {"tp"}
    size_calls = [shape for rank, _, shape in group.calls if rank == 1]
    assert size_calls[0] == (1,) and size_calls[1] == (padded_size(encode_answers(expected).size),)


def test_the_payload_round_trips_and_its_sizes_are_powers_of_two():
    call = {"name": "calc", "arguments": {"x": "1/0"}, "result": "错误", "status": "error"}
    answers = [ToolTurn([3, 151643], [call]), None]
    payload = encode_answers(answers)
    assert decode_answers(payload.astype(np.float32)) == answers
    assert [padded_size(n) for n in (0, 1, 256, 257, 5000)] == [256, 256, 256, 512, 8192]
