"""Supervised and preference records: Alpaca, ShareGPT and chat `messages` conversations, and TRL-style or
Alpaca-style pairs, read as role/content messages and tokenised through a chat template, with a mask over the
assistant's tokens (the only ones SFT trains).

Every reader raises `DataError` starting with the record's `file:line` and naming the field that is wrong.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mindrlhf.data.sources import DataError

ROLES = ("system", "user", "assistant", "tool")
CHAT_ROLES = {role: role for role in ROLES}
# ShareGPT's speakers (LLaMA-Factory's and MindSpeed-LLM's names), as chat roles
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
RECORD_KINDS = ("prompts", "sft", "pairwise")


def record_kind(record: Mapping) -> str:
    """What a record is, from its fields: `pairwise` (chosen and rejected), `sft` (messages, conversations, or an
    Alpaca instruction with its output) or `prompts` (a question for the RL jobs)."""
    if "chosen" in record and "rejected" in record:
        return "pairwise"
    if "messages" in record or "conversations" in record or ("instruction" in record and "output" in record):
        return "sft"
    return "prompts"


def _text(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    return value


def _turns(value, where: str, field: str, speaker: str, text: str, roles: Mapping[str, str]) -> list[dict]:
    """A list of turns `{speaker: ..., text: ...}` (chat's role/content, ShareGPT's from/value) as role/content
    messages, each speaker mapped to its chat role by `roles`; checked."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field '{field}' must be a non-empty list of {{\"{speaker}\", \"{text}\"}} turns")
    messages = []
    for i, turn in enumerate(value):
        if not isinstance(turn, Mapping) or speaker not in turn or text not in turn:
            raise DataError(f"{where}: {field}[{i}] must be an object with '{speaker}' and '{text}'")
        role = roles.get(turn[speaker]) if isinstance(turn[speaker], str) else None
        if role is None:
            raise DataError(f"{where}: {field}[{i}].{speaker} is {turn[speaker]!r}, expected one of {', '.join(roles)}")
        messages.append({"role": role, "content": _text(turn[text], where, f"{field}[{i}].{text}")})
    return messages


def _chat_messages(value, where: str, field: str) -> list[dict]:
    return _turns(value, where, field, "role", "content", CHAT_ROLES)


def _sharegpt_messages(value, where: str) -> list[dict]:
    return _turns(value, where, "conversations", "from", "value", SHAREGPT_ROLES)


def _alpaca_prompt(record: Mapping, where: str) -> list[dict]:
    """The system message (if any), the `history` turns and the instruction (with its input) as the user's turn."""
    messages = [{"role": "system", "content": _text(record["system"], where, "system")}] if record.get("system") \
        else []
    history = record.get("history") or []
    if not isinstance(history, list):
        raise DataError(f"{where}: field 'history' must be a list of [instruction, answer] pairs")
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise DataError(f"{where}: history[{i}] must be a pair [instruction, answer]")
        messages += [{"role": "user", "content": _text(pair[0], where, f"history[{i}][0]")},
                     {"role": "assistant", "content": _text(pair[1], where, f"history[{i}][1]")}]
    key = "instruction" if "instruction" in record else "question" if "question" in record else "prompt"
    if key not in record:
        raise DataError(f"{where}: no 'instruction' (or 'question', 'prompt') field")
    question = _text(record[key], where, key)
    extra = record.get("input") or ""
    user = f"{question}\n{_text(extra, where, 'input')}" if extra else question
    return messages + [{"role": "user", "content": user}]


def sft_messages(record: Mapping, where: str) -> list[dict]:
    """The conversation of an SFT record (chat `messages`, ShareGPT `conversations`, or Alpaca's `instruction`,
    `input`, `output`, `system`, `history`), with at least one assistant turn after a user turn."""
    if "messages" in record:
        messages = _chat_messages(record["messages"], where, "messages")
    elif "conversations" in record:
        messages = _sharegpt_messages(record["conversations"], where)
    elif "instruction" in record:
        if "output" not in record:
            raise DataError(f"{where}: an Alpaca record needs 'output' (the answer to train on)")
        messages = _alpaca_prompt(record, where) + [
            {"role": "assistant", "content": _text(record["output"], where, "output")}]
    else:
        raise DataError(f"{where}: not an SFT record: expected 'messages', 'conversations' or 'instruction' + "
                        f"'output', got fields {sorted(record)}")
    _check_turns(messages, where)
    return messages


def record_tools(record: Mapping, where: str) -> list[dict] | None:
    """The `tools` of a record (TRL's dataset column: the JSON schemas the conversation's template renders, as
    `transformers.utils.get_json_schema` writes them), or None."""
    tools = record.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise DataError(f"{where}: field 'tools' must be a list of function schemas "
                        '({"type": "function", "function": {"name": ..., "parameters": ...}})')
    return [dict(t) for t in tools]


def _check_turns(messages: list[dict], where: str) -> None:
    first_answer = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first_answer is None:
        raise DataError(f"{where}: the conversation has no assistant turn to train on")
    if not any(m["role"] == "user" for m in messages[:first_answer]):
        raise DataError(f"{where}: the first assistant turn (message {first_answer}) has no user turn before it")


@dataclass(frozen=True)
class Pair:
    """A preference pair: the shared prompt's messages and each answer's (assistant) messages."""

    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]


def _answer(value, where: str, field: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, Mapping) and "from" in value:  # LLaMA-Factory's ShareGPT pairs: one turn each
        return _sharegpt_messages([value], where)
    return _chat_messages(value, where, field)


def pair_messages(record: Mapping, where: str) -> Pair:
    """The pair of a preference record: TRL's `prompt` / `chosen` / `rejected` (strings or messages; without a
    `prompt`, the conversations' common first messages are it), or an Alpaca-style prompt (`instruction` and
    `input`, or `question`, with `system`) and `chosen` / `rejected` answers."""
    for field in ("chosen", "rejected"):
        if field not in record:
            raise DataError(f"{where}: a pairwise record needs 'chosen' and 'rejected'; '{field}' is missing")
    chosen, rejected = (_answer(record[f], where, f) for f in ("chosen", "rejected"))
    if "prompt" in record and not isinstance(record["prompt"], str):
        prompt = _chat_messages(record["prompt"], where, "prompt")
    elif any(key in record for key in ("prompt", "instruction", "question")):
        prompt = _alpaca_prompt(record, where)
    elif "conversations" in record:
        prompt = _sharegpt_messages(record["conversations"], where)
    else:  # TRL's implicit prompt: chosen and rejected are whole conversations
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if not prompt or prompt[-1]["role"] not in ("user", "tool"):
        raise DataError(f"{where}: the prompt must end with a user turn")
    for field, answer in (("chosen", chosen), ("rejected", rejected)):
        if answer[0]["role"] != "assistant":
            raise DataError(f"{where}: '{field}' must start with the assistant's answer")
    return Pair(prompt, chosen, rejected)


ChatTemplate = Callable[..., str]  # (messages, add_generation_prompt=...) -> text, as `apply_chat_template`
Encode = Callable[[str], list[int]]


def conversation_segments(messages: Sequence[Mapping], render: ChatTemplate,
                          start: int = 0) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive (text, trained) pieces: each assistant turn after message `start`
    (its content and end-of-turn token, without the whitespace after it) is trained, the rest is not. A turn's text
    is what rendering the messages up to it adds to the rendering before it (with the generation prompt)."""
    pieces: list[tuple[str, bool]] = []
    done = render(messages[:start], add_generation_prompt=True) if start else ""
    pieces.append((done, False))
    for k in range(start, len(messages)):
        if messages[k]["role"] != "assistant":
            continue
        before = render(messages[:k], add_generation_prompt=True)
        after = render(messages[:k + 1], add_generation_prompt=False)
        if not (before.startswith(done) and after.startswith(before)):
            raise ValueError(f"the chat template does not render message {k} as an extension of the messages before "
                             "it (a template that rewrites earlier turns cannot mask the assistant's tokens)")
        answer = after[len(before):]
        trained = answer.rstrip(" \n")
        pieces += [(before[len(done):], False), (trained, True), (answer[len(trained):], False)]
        done = after
    full = render(list(messages), add_generation_prompt=False)
    pieces.append((full[len(done):] if full.startswith(done) else "", False))
    return [(text, trained) for text, trained in pieces if text]


def tokenize_segments(pieces: Sequence[tuple[str, bool]], encode: Encode) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) int32 of `pieces`, each piece tokenised on its own (their edges are the template's
    special tokens, where a tokeniser does not merge across)."""
    ids, mask = [], []
    for text, trained in pieces:
        tokens = encode(text)
        ids += tokens
        mask += [int(trained)] * len(tokens)
    return np.asarray(ids, np.int32), np.asarray(mask, np.int32)


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Samples of `lengths` tokens packed into rows of at most `capacity` tokens, best fit in decreasing length
    (TRL's `packing_strategy="bfd"`): row -> the indices of its samples, each row's in input order. A sample
    longer than `capacity` raises."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, more than a packed row's {capacity}")
        fits = [r for r in range(len(rows)) if room[r] >= lengths[i]]
        if fits:
            best = min(fits, key=lambda r: (room[r], r))
            rows[best].append(i)
            room[best] -= lengths[i]
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return [sorted(row) for row in rows]


def packing_positions(lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(position ids, segment ids) of one packed row of samples of `lengths` tokens: positions restart at 0 with
    each sample, segment ids count samples from 1 (attention stays within a segment)."""
    positions = np.concatenate([np.arange(n) for n in lengths]) if lengths else np.zeros(0, np.int64)
    segments = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return positions.astype(np.int32), segments.astype(np.int32)
