"""The tool turns of a multi-turn rollout: the calls read from each ended turn's text, run (all of a step's turns'
calls at once, `ToolRunner`), and their results rendered as the chat template's `tool` turn and tokenized, so that the
model reads them as it would in a conversation (`ToolTurns`, the Generator's tool-turn handler)."""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from mindrlhf.tool_use.calls import parse_tool_calls
from mindrlhf.tool_use.runner import ToolRunner
from mindrlhf.tool_use.schema import ToolDefinitionError

_TURN = "\u2063turn\u2063"  # a text no template writes, to find where the model's turn ends in a rendering
CUT = " ... (cut)"  # ends a result cut to fit the tool turn


@dataclasses.dataclass(frozen=True)
class ToolTurn:
    """A tool turn as the model reads it: its `tokens` (the template's framing included) and each call's record
    (name, arguments, result, status)."""
    tokens: list[int]
    calls: list[dict]


class ToolTurns:
    """Answers the turns a rollout's samples end: a turn whose text calls tools (`parse_tool_calls`) gets their
    results as the template's tool turn, at most `max_tokens` tokens (results cut to fit, counted as truncated); a
    turn without a call gets None. `tokenizer` is the policy's (a chat template that renders tool turns)."""

    def __init__(self, runner: ToolRunner, tokenizer, max_tokens: int):
        if not getattr(tokenizer, "supports_tools", False):
            raise ToolDefinitionError(f"tools: the tokenizer {tokenizer!r} has no chat template that renders tools; "
                                      "use a tokenizer folder whose template supports tool calling")
        self.runner, self.tokenizer, self.max_tokens = runner, tokenizer, max_tokens
        try:
            rendered = "=result=" in self.render(["=result="])
        except ValueError:  # the template dropped the assistant's text
            rendered = False
        if not rendered:
            raise ToolDefinitionError(f"tools: the chat template of {tokenizer!r} does not render a tool turn")
        framing = len(self._tokens([CUT.strip()], tokenizer.eos_token_id))
        if framing > max_tokens:
            raise ToolDefinitionError(f"generation.max_tool_response_tokens={max_tokens} cannot hold a tool turn: the "
                                      f"chat template's framing of one answer takes {framing} tokens; give at least "
                                      f"{framing} (and room for the answers)")

    def respond(self, turns: Sequence[Sequence[int]]) -> list[ToolTurn | None]:
        """The tool turn of each turn (its token ids), or None for a turn that called no tool."""
        calls = [parse_tool_calls(self.tokenizer.decode(list(turn))) for turn in turns]
        results = iter(self.runner.run([call for turn_calls in calls for call in turn_calls]))
        answers = []
        for turn, turn_calls in zip(turns, calls):
            if not turn_calls:
                answers.append(None)
                continue
            done = [next(results) for _ in turn_calls]
            texts = [result.text for result in done]
            tokens, cut = self._fitted(texts, int(turn[-1]))
            statuses = [result.status for result in done]
            if cut is not None:
                statuses = ["truncated" if status == "ok" else status for status in statuses]
                self.runner.counts.subtract(result.status for result in done)
                self.runner.counts.update(statuses)
            records = [{"name": call.name, "arguments": call.arguments, "result": text, "status": status}
                       for call, status, text in zip(turn_calls, statuses, cut or texts)]
            answers.append(ToolTurn(tokens, records))
        return answers

    def render(self, results: Sequence[str]) -> str:
        """The text the template puts after a model turn that ends at `_TURN` when `results` answer its calls: the
        end of the turn, the tool turn, and the prompt of the model's next turn."""
        messages = [{"role": "user", "content": "-"}, {"role": "assistant", "content": _TURN}]
        tool_turn = [{"role": "tool", "content": text} for text in results]
        text = self.tokenizer.apply_chat_template(messages + tool_turn, add_generation_prompt=True)
        return text[text.index(_TURN) + len(_TURN):]

    def _fitted(self, texts: list[str], last_token: int) -> tuple[list[int], list[str] | None]:
        """The tool turn's tokens after the model's `last_token` (whose own text, an end-of-turn token, the template
        also writes: it is not repeated) and, when the results had to be cut to fit `max_tokens`, the cut texts
        (each a beginning of its result and `CUT`; at worst `CUT` alone, which `__init__` checked fits)."""
        tokens = self._tokens(texts, last_token)
        if len(tokens) <= self.max_tokens:
            return tokens, None
        share = 1.0
        while share > 1e-3:
            share *= min(0.9, self.max_tokens / len(tokens))
            cut = [text[:int(len(text) * share)] + CUT for text in texts]
            tokens = self._tokens(cut, last_token)
            if len(tokens) <= self.max_tokens:
                return tokens, cut
        cut = [CUT.strip() for _ in texts]
        return self._tokens(cut, last_token), cut

    def _tokens(self, texts: list[str], last_token: int) -> list[int]:
        text = self.render(texts)
        end_of_turn = self.tokenizer.decode([last_token])
        if end_of_turn and text.startswith(end_of_turn):
            text = text[len(end_of_turn):]
        return self.tokenizer.encode(text)

    def counts(self) -> collections.Counter:
        """How the calls went so far: the runner's statuses (ok, error, timeout, truncated)."""
        return self.runner.counts
