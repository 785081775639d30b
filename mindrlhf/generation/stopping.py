"""Stop strings (vLLM's `stop`, transformers' `stop_strings`): a response ends at the token that completes one of
them in its decoded text, and that token stays in the response, as an EOS does. The check runs after every token,
so a string is always completed by the newest one; only the response's tail is decoded."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class StopStrings:
    """Finds responses whose newest token completed one of `strings`; `detokenize` gives the text of token ids
    (the rewards' decoding: special tokens skipped, so a special token's name never matches)."""

    def __init__(self, strings: Sequence[str], detokenize: Callable[[Sequence[int]], str]):
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop strings must be a non-empty list of non-empty strings, got {strings!r}")
        self.strings = tuple(strings)
        self.detokenize = detokenize
        self.longest = max(len(s.encode("utf-8")) for s in self.strings)

    def ends(self, tokens: np.ndarray) -> bool:
        """Whether the text of `tokens` (a response so far) holds a stop string. Decodes a window of the last tokens,
        widened until the tokens between its first and the newest cover the longest string's bytes: a string the
        newest token completed then starts inside the window (a character split by the window's start garbles only
        what comes before it; the first token is a margin for decoders that drop a text's leading space)."""
        width = self.longest + 2
        while True:
            tail = tokens[-width:]
            if self._holds(self.detokenize(tail)):
                return True
            if width >= len(tokens) or len(self.detokenize(tail[1:-1]).encode("utf-8")) >= self.longest:
                return False
            width *= 2

    def _holds(self, text: str) -> bool:
        return any(s in text for s in self.strings)
