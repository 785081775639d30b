"""Tool calls read from a model's text in the Hermes convention of Qwen2.5's chat template: each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, or, as SmolLM2's function-calling
models write them, a JSON list of such objects in one block. A call that cannot be read is kept as an error text to
answer the model with, not dropped; an answer too long for the model is cut (`cut_answer`)."""
from __future__ import annotations

import dataclasses
import json
import re

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call of a turn: the tool's `name` and its keyword `arguments`, or the `error` that made it unreadable
    (then name and arguments are what could be read)."""
    name: str
    arguments: dict
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in `text`, in order; an unterminated last block counts as a malformed call."""
    calls = []
    for match in _BLOCK.finditer(text):
        body, closed = match.group(1).strip(), match.group(0).endswith(CLOSE)
        calls += _read_block(body) if closed else [ToolCall("", {}, f"the tool call is not closed with {CLOSE}")]
    return calls


def _read_block(body: str) -> list[ToolCall]:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return [ToolCall("", {}, f"the tool call is not JSON ({err.msg} at character {err.pos})")]
    if isinstance(value, list) and value:  # SmolLM2's form: the turn's calls as one list
        return [_read_call(call) for call in value]
    return [_read_call(value)]


def _read_call(call) -> ToolCall:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCall("", {}, 'the tool call is not an object with a "name" string')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], {}, f'the "arguments" of {call["name"]} are not an object')
    return ToolCall(call["name"], arguments)


def cut_answer(text: str, max_chars: int) -> str | None:
    """`text` cut at `max_chars` with a note saying so, or None when it fits."""
    return None if len(text) <= max_chars else text[:max_chars] + f"\n... (cut at {max_chars} characters)"
