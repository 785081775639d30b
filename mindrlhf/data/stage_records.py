"""SFT and pairwise data -> MindRecord: each conversation tokenised through the chat template with the mask of the
assistant's tokens, each preference pair with its prompt stored once.

SFT records:      input_ids int32[-1], loss_mask int32[-1] (1 on the tokens trained: every assistant turn)
Pairwise records: prompt_ids int32[-1], chosen_ids int32[-1], rejected_ids int32[-1] (each answer's own tokens,
                  its end-of-turn token included)
"""
from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, field

import numpy as np

from mindrlhf.data.conversations import (
    conversation_segments,
    pair_messages,
    record_kind,
    record_tools,
    sft_messages,
    tokenize_segments,
)
from mindrlhf.data.mindrecord import MAX_LOGGED_BAD_LINES, mindrecord_output_path, write_mindrecord_atomically
from mindrlhf.data.sources import DataError, is_parquet, list_input_files, location, read_records

logger = logging.getLogger("rlhf_data")

SFT_SCHEMA = {"input_ids": {"type": "int32", "shape": [-1]}, "loss_mask": {"type": "int32", "shape": [-1]}}
PAIRWISE_SCHEMA = {"prompt_ids": {"type": "int32", "shape": [-1]}, "chosen_ids": {"type": "int32", "shape": [-1]},
                   "rejected_ids": {"type": "int32", "shape": [-1]}}
SCHEMAS = {"sft": SFT_SCHEMA, "pairwise": PAIRWISE_SCHEMA}


@dataclass
class StageDataStats:
    """Counts of one SFT or pairwise conversion."""

    kind: str
    written: int = 0
    dropped_too_long: int = 0
    bad_lines: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    input_files: list[str] = field(default_factory=list)
    output_path: str = ""

    def summary(self) -> str:
        return (f"{self.kind}: written {self.written}, dropped too long {self.dropped_too_long}, bad lines "
                f"{self.bad_lines}, {self.tokens} tokens ({self.trained_tokens} trained)")


def sft_record(record: dict, where: str, tokenizer) -> dict:
    """The SFT MindRecord row of one conversation record (with its `tools`, if any, rendered by the template)."""
    tools = record_tools(record, where)
    render = functools.partial(tokenizer.apply_chat_template, tools=tools) if tools else tokenizer.apply_chat_template
    pieces = conversation_segments(sft_messages(record, where), render)
    ids, mask = tokenize_segments(pieces, tokenizer.encode)
    return {"input_ids": ids, "loss_mask": mask}


def pairwise_record(record: dict, where: str, tokenizer) -> dict:
    """The pairwise MindRecord row of one preference record: the prompt (with the generation prompt) and each
    answer's trained tokens."""
    pair = pair_messages(record, where)
    render = tokenizer.apply_chat_template
    prompt = np.asarray(tokenizer.encode(render(pair.prompt, add_generation_prompt=True)), np.int32)
    row = {"prompt_ids": prompt}
    for name, answer in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        pieces = conversation_segments(pair.prompt + answer, render, start=len(pair.prompt))
        ids, mask = tokenize_segments(pieces[1:], tokenizer.encode)  # pieces[0] is the prompt
        row[f"{name}_ids"] = ids[:np.flatnonzero(mask)[-1] + 1]
    return row


def _row_length(row: dict) -> int:
    if "input_ids" in row:
        return len(row["input_ids"])
    return len(row["prompt_ids"]) + max(len(row["chosen_ids"]), len(row["rejected_ids"]))


def convert_stage_data(input_path: str | os.PathLike, output_path: str | os.PathLike, tokenizer, kind: str = "auto",
                       max_length: int = 2048, skip_bad_lines: bool = False) -> StageDataStats:
    """Converts SFT (`kind="sft"`) or pairwise (`"pairwise"`) records, or either found from the first record's
    fields (`"auto"`), into one MindRecord (`mindrecord_output_path` of `output_path`). Rows longer than
    `max_length` tokens (a pair: its prompt and longer answer) are dropped and counted, never cut. A bad record
    raises `DataError("file:line: ...")`, or with `skip_bad_lines` is counted and skipped."""
    rows, stats = [], StageDataStats(kind)
    stats.output_path = mindrecord_output_path(output_path)
    for source in list_input_files(input_path):
        stats.input_files.append(source)
        parquet = is_parquet(source)
        for number, item in read_records(source):
            where = location(source, number, parquet)
            try:
                if isinstance(item, json.JSONDecodeError):
                    raise DataError(f"{where}: invalid JSON: {item.msg} (column {item.colno})")
                if not isinstance(item, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(item).__name__}")
                if stats.kind == "auto":
                    stats.kind = record_kind(item)
                    if stats.kind == "prompts":
                        raise DataError(f"{where}: neither an SFT record (messages, conversations, or instruction "
                                        "+ output) nor a pair (chosen + rejected); prompts for the RL jobs are "
                                        "converted with --kind prompts")
                make = sft_record if stats.kind == "sft" else pairwise_record
                row = make(item, where, tokenizer)
            except (DataError, ValueError) as err:
                message = str(err) if str(err).startswith(where) else f"{where}: {err}"
                if not skip_bad_lines:
                    raise DataError(message) from None
                stats.bad_lines += 1
                if stats.bad_lines <= MAX_LOGGED_BAD_LINES:
                    logger.warning("skipping bad line: %s", message)
                continue
            if _row_length(row) > max_length:
                stats.dropped_too_long += 1
                continue
            rows.append(row)
            stats.tokens += _row_length(row)
            stats.trained_tokens += int(row["loss_mask"].sum()) if "loss_mask" in row else \
                len(row["chosen_ids"]) + len(row["rejected_ids"])
    if not rows:
        raise DataError(f"{os.fspath(input_path)}: no record left to write ({stats.summary()})")
    write_mindrecord_atomically(rows, stats.output_path, f"mindrlhf {stats.kind} data", schema=SCHEMAS[stats.kind])
    stats.written = len(rows)
    return stats
