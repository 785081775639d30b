"""The samples of one generate call as they grow (`Trajectories`): each one's response row, how far it has come, the
random number each of its model tokens is drawn at, the end of a turn, and, in a multi-turn rollout, the tool turns
appended after a turn that calls a tool. Framework-free: the decoding strategies feed it the chosen tokens."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.generation.stopping import StopStrings


class ToolTurnAnswer(Protocol):
    """What a tool-turn handler gives back for a turn that called tools: the tool turn's tokens as the model reads
    them (the chat template's framing included) and a record of each call (name, arguments, result, status)."""
    tokens: Sequence[int]
    calls: list[dict]


class ToolTurnHandler(Protocol):
    """Answers the turns that ended: for each turn's tokens (the model's own, from its last tool turn or the prompt),
    its tool turn, or None when the turn called no tool (the response has ended)."""

    def respond(self, turns: Sequence[np.ndarray]) -> list[ToolTurnAnswer | None]: ...


class Uniforms:
    """The random number each model token is drawn at: sample s's token k at row k, column s; row k is drawn (for
    every sample, in one call of `draw`) the first time a sample reaches its token k, so the samples depend neither
    on the rows or slots that decode them nor on how their turns interleave."""

    def __init__(self, draw: Callable[[int], np.ndarray], tokens: int, batch: int):
        self.draw, self.batch = draw, batch
        self.rows = np.zeros((tokens, batch), np.float32)
        self.drawn = 0

    def at(self, samples: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The uniforms of `samples` for their token index `tokens` (two int arrays of one length)."""
        if samples.size:
            while self.drawn <= int(tokens.max()):
                self.rows[self.drawn] = self.draw(self.batch)
                self.drawn += 1
        return self.rows[tokens, samples]


class Trajectories:
    """Every sample's response row [B, response_width]: its tokens, mask (1 = token), log-probs (0 where the model
    did not choose the token) and `tool_mask` (1 = a tool turn's token). A sample has `length` tokens, `produced` of
    them the model's; it has finished when its turn ended without a tool call, at the budget of max_new_tokens model
    tokens, or at max_tool_calling_iterations tool turns."""

    def __init__(self, config: GenerationConfig, batch: int, with_log_probs: bool, stop: StopStrings | None,
                 uniforms: Uniforms, tools: ToolTurnHandler | None = None):
        self.config, self.stop, self.uniforms, self.tools = config, stop, uniforms, tools
        width = config.response_width
        self.response = np.full((batch, width), config.pad_token_id, np.int32)
        self.mask = np.zeros((batch, width), np.int32)
        self.tool_mask = np.zeros((batch, width), np.int32)
        self.log_probs = np.zeros((batch, width), np.float32) if with_log_probs else None
        self.length = np.zeros(batch, np.int64)
        self.produced = np.zeros(batch, np.int64)
        self.turn_start = np.zeros(batch, np.int64)
        self.tool_turns = np.zeros(batch, np.int64)
        self.finished = np.zeros(batch, bool)
        self.calls: list[list[dict]] = [[] for _ in range(batch)]
        self.tool_seconds = 0.0

    def draws(self, samples: np.ndarray) -> np.ndarray:
        """The uniforms `samples` draw their next model token at."""
        return self.uniforms.at(samples, self.produced[samples])

    def last_token(self, samples: np.ndarray) -> np.ndarray:
        """The newest token of each of `samples` (the one a decode step feeds)."""
        return self.response[samples, self.length[samples] - 1]

    def record(self, samples: np.ndarray, tokens: np.ndarray, log_probs: np.ndarray | None) -> dict[int, list[int]]:
        """Appends each of `samples`' next model token; a sample whose turn ends finishes, or, when its turn called a
        tool and it may take another tool turn, gets the tool turn appended. Returns the tokens to feed those:
        sample -> [its newest model token, the tool turn's tokens...]."""
        at = self.length[samples]
        self.response[samples, at] = tokens
        self.mask[samples, at] = 1
        if self.log_probs is not None:
            self.log_probs[samples, at] = log_probs
        self.length[samples] += 1
        self.produced[samples] += 1
        ended = samples[self._turn_ended(samples, tokens)]
        if self.tools is None or not ended.size:
            self.finished[ended] = True
            return {}
        may_call = (self.produced[ended] < self.config.max_new_tokens) & \
            (self.tool_turns[ended] < self.config.max_tool_calling_iterations)
        self.finished[ended[~may_call]] = True
        return self._tool_turns(ended[may_call])

    def _turn_ended(self, samples: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Whether each sample's newest token ended its turn: an EOS, the completion of a stop string within the turn,
        or the last model token of the budget."""
        ended = np.isin(tokens, self.config.eos_token_ids) | (self.produced[samples] >= self.config.max_new_tokens)
        if self.stop is not None:
            for i in np.flatnonzero(~ended):
                s = samples[i]
                ended[i] = self.stop.ends(self.response[s, self.turn_start[s]:self.length[s]])
        return ended

    def _tool_turns(self, samples: np.ndarray) -> dict[int, list[int]]:
        if not samples.size:
            return {}
        turns = [self.response[s, self.turn_start[s]:self.length[s]] for s in samples]
        start = time.perf_counter()
        answers = self.tools.respond(turns)
        self.tool_seconds += time.perf_counter() - start
        fed = {}
        for s, answer in zip(samples, answers):
            if answer is None:
                self.finished[s] = True
                continue
            tokens = list(answer.tokens)[:self.config.max_tool_response_tokens]
            at = int(self.length[s])
            self.response[s, at:at + len(tokens)] = tokens
            self.mask[s, at:at + len(tokens)] = 1
            self.tool_mask[s, at:at + len(tokens)] = 1
            fed[int(s)] = [int(self.response[s, at - 1]), *tokens]
            self.length[s] += len(tokens)
            self.turn_start[s] = self.length[s]
            self.tool_turns[s] += 1
            self.calls[s].extend(answer.calls)
        return fed


def segments(response_mask: np.ndarray, tool_mask: np.ndarray) -> list[tuple[str, int, int]]:
    """The turns of one response row as (role, start, end) runs of its tokens: "assistant" for the model's, "tool"
    for a tool turn's (`tool_mask` 1)."""
    runs: list[tuple[str, int, int]] = []
    for at in np.flatnonzero(response_mask):
        role = "tool" if tool_mask[at] else "assistant"
        if runs and runs[-1][0] == role and runs[-1][2] == at:
            runs[-1] = (role, runs[-1][1], at + 1)
        else:
            runs.append((role, int(at), int(at) + 1))
    return runs


def call_counts(calls: list[dict]) -> dict[str, int]:
    """How one response's tool calls went: all of them, and those that errored, timed out or were truncated."""
    statuses = [call.get("status") for call in calls]
    return {"calls": len(calls), "errors": statuses.count("error"), "timeouts": statuses.count("timeout"),
            "truncated": statuses.count("truncated")}
