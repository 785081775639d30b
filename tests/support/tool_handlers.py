"""Tool-turn handlers standing in for `ToolTurns` in rollout tests: answers that depend on a turn's tokens (and, to
tell ranks apart, on a `salt`)."""
from types import SimpleNamespace


class CountingTool:
    """A turn of an even number of tokens is answered with 1 to 6 tokens that depend on the turn's tokens and on
    `salt` (ids 100..119); an odd one called no tool (the response ends). Records every turn it was asked."""

    def __init__(self, salt: int = 0):
        self.salt = salt
        self.turns = []

    def respond(self, turns):
        answers = []
        for turn in turns:
            self.turns.append(list(turn))
            if len(turn) % 2:
                answers.append(None)
                continue
            key = int(sum(turn)) + self.salt
            answers.append(SimpleNamespace(tokens=[100 + (key + i) % 20 for i in range(key % 6 + 1)],
                                           calls=[{"name": "count", "turn": len(turn), "salt": self.salt}]))
        return answers
