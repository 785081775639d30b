"""GSM8K-style JSON / JSONL / Parquet -> MindRecord conversion of prompts (tokenised, templated) and gold answers.

The input is one file or a folder of them (`mindrlhf.data.sources` lists and reads them); the output one
MindRecord file (+ its `.db` index), `<folder>/prompts.mindrecord` when given a folder.

Output records (one per kept problem):
    prompt_ids     int64[-1]  token ids of the templated prompt, unpadded
    prompt_length  int64      len(prompt_ids)
    solution       string     the answer field as given (e.g. "...reasoning... #### 72")
    prompt         string     the templated prompt text
    columns        string     the record's other fields as a JSON object: reward functions with TRL's signature
                              get them as keyword arguments, one value per completion
"""
from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from mindrlhf.data.answers import boxed_gold_answer, extract_gold_answer
from mindrlhf.data.sources import CHOOSE_KEYS, DataError, is_parquet, list_input_files, location, read_records
from mindrlhf.data.templates import TEMPLATE_NAMES, build_prompt

logger = logging.getLogger(__name__)

MINDRECORD_SCHEMA = {
    "prompt_ids": {"type": "int64", "shape": [-1]},
    "prompt_length": {"type": "int64"},
    "solution": {"type": "string"},
    "prompt": {"type": "string"},
    "columns": {"type": "string"},
}
# Keywords the trainer itself passes to reward functions: a dataset field of one of these names is not passed on
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "solution")
MAX_LOGGED_BAD_LINES = 10
DEFAULT_OUTPUT_NAME = "prompts.mindrecord"  # the file written when --output_path is a folder


class TextTokenizer(Protocol):
    """What conversion needs from a tokenizer (`Qwen2Tokenizer` and `HFTokenizer` have it)."""

    def batch_encode(self, texts: Sequence[str]) -> list[list[int]]: ...

    def apply_chat_template(self, messages: list[dict]) -> str: ...


@dataclass
class ConversionStats:
    """Counts of one conversion run."""

    written: int = 0
    dropped_too_long: int = 0
    bad_lines: int = 0
    longest_prompt: int = 0
    bad_line_messages: list[str] = field(default_factory=list)
    dropped_columns: set[str] = field(default_factory=set)  # fields not passed to reward functions (reserved names)
    input_files: list[str] = field(default_factory=list)  # the files read, in reading order
    output_path: str = ""  # the MindRecord written (absolute)

    def summary(self) -> str:
        """One line for logs."""
        return (f"written {self.written}, dropped too long {self.dropped_too_long}, bad lines {self.bad_lines}, "
                f"longest written prompt {self.longest_prompt} tokens")


@dataclass
class Problem:
    """One question/answer pair and where it came from."""

    line: int  # 1-based line of a JSON / JSONL file, 0-based row of a Parquet file
    question: str
    answer: str
    columns: dict = field(default_factory=dict)
    source: str = ""  # the file it was read from
    parquet: bool = False

    @property
    def where(self) -> str:
        """`file:line` or `file:row N`, as error messages name it."""
        return location(self.source, self.line, self.parquet)


def _check_record(record: object, prompt_key: str, answer_key: str, numeric_answers: bool) -> tuple[str, str]:
    """The (question, answer) strings of a record, or ValueError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    values = []
    for key in (prompt_key, answer_key):
        if key not in record:
            raise ValueError(f"missing key {key!r} (keys present: {sorted(record)}); {CHOOSE_KEYS}")
        value = record[key]
        if not isinstance(value, str):
            raise ValueError(f"{key!r} must be a string, got {type(value).__name__}")
        if not value.strip():
            raise ValueError(f"{key!r} is empty")
        values.append(value)
    if numeric_answers and extract_gold_answer(values[1]) is None and boxed_gold_answer(values[1]) is None:
        raise ValueError(f"{answer_key!r} has no gold number the accuracy reward can parse (expected '#### 42', "
                         f"'\\boxed{{42}}' or a bare number, or a LaTeX answer in '\\boxed{{...}}'), got "
                         f"{values[1][-60:]!r}")
    return values[0], values[1]


def read_problems(path: str | os.PathLike, prompt_key: str = "question", answer_key: str = "answer",
                  skip_bad_lines: bool = False, stats: ConversionStats | None = None,
                  numeric_answers: bool = True) -> Iterator[Problem]:
    """Yields the problems of a JSON list, JSONL or Parquet file, or of every such file in a folder (in sorted
    file-name order, see `mindrlhf.data.sources`), each file's records in their order.

    A bad record (invalid JSON, missing key, non-string or empty value, with `numeric_answers` an answer with
    neither a gold number `extract_gold_answer` can parse nor a final ``\\boxed{...}`` LaTeX answer, which the
    accuracy reward checks by meaning) raises `DataError("file:line: ...")` (`file:row N:` for
    Parquet), or with `skip_bad_lines` is counted in `stats` and skipped. Invalid JSON inside a JSON list and a
    Parquet file without the `prompt_key` / `answer_key` columns are always fatal.
    """
    stats = stats if stats is not None else ConversionStats()
    for source in list_input_files(path):
        stats.input_files.append(source)
        yield from _file_problems(source, prompt_key, answer_key, skip_bad_lines, stats, numeric_answers)


def _file_problems(source: str, prompt_key: str, answer_key: str, skip_bad_lines: bool, stats: ConversionStats,
                   numeric_answers: bool) -> Iterator[Problem]:
    """`read_problems` for one input file."""
    parquet = is_parquet(source)
    for number, item in read_records(source, required_columns=(prompt_key, answer_key)):
        try:
            if isinstance(item, json.JSONDecodeError):
                raise ValueError(f"invalid JSON: {item.msg} (column {item.colno})")
            question, answer = _check_record(item, prompt_key, answer_key, numeric_answers)
        except ValueError as err:
            message = f"{location(source, number, parquet)}: {err}"
            if not skip_bad_lines:
                raise DataError(message) from None
            stats.bad_lines += 1
            if len(stats.bad_line_messages) < MAX_LOGGED_BAD_LINES:
                stats.bad_line_messages.append(message)
                logger.warning("skipping bad line: %s", message)
            continue
        columns = {key: value for key, value in item.items() if key not in (prompt_key, answer_key)}
        clashing = sorted(set(columns) & set(RESERVED_COLUMNS))
        if clashing:
            if not stats.dropped_columns:
                logger.warning("%s: field(s) %s are not passed to reward functions (the trainer passes its own "
                               "values under these names)", source, clashing)
            stats.dropped_columns.update(clashing)
            columns = {key: value for key, value in columns.items() if key not in RESERVED_COLUMNS}
        yield Problem(number, question, answer, columns, source, parquet)


# MindSpore's FileWriter reserves a 16 MiB header and 32 MiB pages (sparse: the disk holds only what is written, but
# the file's length counts against a size limit); it crashes the process when a write fails, so the room is checked
# before it starts
MINDRECORD_HEADER_BYTES = 1 << 24
MINDRECORD_PAGE_BYTES = 1 << 25
MIB = 1 << 20


def records_nbytes(records: list[dict]) -> int:
    """Bytes of the records' values (arrays, strings, numbers) as MindRecord stores them, roughly."""
    total = 0
    for record in records:
        for value in record.values():
            total += value.nbytes if isinstance(value, np.ndarray) else len(str(value).encode()) + 8
    return total


def mindrecord_room_problem(data_bytes: int, free_bytes: int, file_size_limit: int | None) -> str | None:
    """Why a MindRecord of `data_bytes` of values cannot be written where `free_bytes` are free under a file size
    limit of `file_size_limit` bytes (None: unlimited), or None when it fits (with room to spare for the index)."""
    pages = 1 + data_bytes // MINDRECORD_PAGE_BYTES
    length = MINDRECORD_HEADER_BYTES + pages * MINDRECORD_PAGE_BYTES
    if file_size_limit is not None and file_size_limit < length:
        return (f"the file size limit (ulimit -f) is {file_size_limit / MIB:.1f} MiB and this MindRecord file is "
                f"{length / MIB:.0f} MiB long (MindSpore reserves a 16 MiB header and 32 MiB pages; the disk holds "
                "only what is written)")
    needed = 2 * data_bytes + 4 * MIB
    if free_bytes < needed:
        return f"the disk has {free_bytes / MIB:.1f} MiB free and this MindRecord needs about {needed / MIB:.1f} MiB"
    return None


def file_size_limit() -> int | None:
    """This process's file size limit in bytes (`ulimit -f`), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def write_mindrecord_atomically(records: list[dict], output_path: str | os.PathLike, description: str,
                                schema: dict | None = None) -> None:
    """Writes `records` to a one-shard MindRecord `output_path` (+ `.db`), replacing any old pair.

    `schema` defaults to the prompt schema (`MINDRECORD_SCHEMA`).

    MindRecord stores its own file name inside, so the pair is written under the final name in a
    temporary folder next to the output and then moved into place. No room for it (a full disk, a file size limit)
    is a `DataError` naming the file and the cause, before anything is written.
    """
    output_path = os.path.abspath(os.fspath(output_path))
    out_dir = os.path.dirname(output_path)
    os.makedirs(out_dir, exist_ok=True)
    problem = mindrecord_room_problem(records_nbytes(records), shutil.disk_usage(out_dir).free, file_size_limit())
    if problem:
        raise DataError(f"{output_path}: cannot write it: {problem}")
    from mindspore.mindrecord import FileWriter  # heavy import, only when writing

    staging_dir = tempfile.mkdtemp(prefix=".mindrecord-tmp-", dir=out_dir)
    try:
        staged = os.path.join(staging_dir, os.path.basename(output_path))
        writer = FileWriter(staged, shard_num=1, overwrite=True)
        writer.add_schema(schema or MINDRECORD_SCHEMA, description)
        for start in range(0, len(records), 1000):
            writer.write_raw_data(records[start:start + 1000])
        writer.commit()
        os.replace(staged + ".db", output_path + ".db")
        os.replace(staged, output_path)
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)


def mindrecord_output_path(output_path: str | os.PathLike) -> str:
    """The MindRecord file `output_path` names, absolute: `output_path` itself, or `<output_path>/prompts.mindrecord`
    when it is an existing folder or ends with a path separator (MindRLHF's `--output_path /path/to/mindrecord/`)."""
    output_path = os.fspath(output_path)
    if output_path.endswith(("/", os.sep)) or os.path.isdir(output_path):
        output_path = os.path.join(output_path, DEFAULT_OUTPUT_NAME)
    return os.path.abspath(output_path)


def convert_to_mindrecord(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    tokenizer: TextTokenizer,
    template: str = "qwen_chat",
    max_prompt_length: int = 512,
    prompt_key: str = "question",
    answer_key: str = "answer",
    skip_bad_lines: bool = False,
    numeric_answers: bool = True,
    instruction: str = "",
    tools: list[dict] | None = None,
) -> ConversionStats:
    """Converts GSM8K-style problems into a MindRecord of tokenised prompts (each question followed by
    `instruction`, if any; `tools`, JSON schemas, offered to the model through the chat template).

    `input_path` is a JSON list, JSONL or Parquet file or a folder of them (`read_problems`); `output_path` a
    file or a folder (`mindrecord_output_path`; the file written is `stats.output_path`). An existing output
    (and its `.db`) is replaced only once the new one is complete. Prompts longer than `max_prompt_length`
    tokens are dropped and counted (never truncated: a cut question cannot be answered). Raises `DataError`
    for bad records (unless `skip_bad_lines`) and when no prompt is left to write.
    """
    if template not in TEMPLATE_NAMES:
        raise ValueError(f"unknown template {template!r}, expected one of {TEMPLATE_NAMES}")
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
    input_path = os.fspath(input_path)
    stats = ConversionStats(output_path=mindrecord_output_path(output_path))
    problems = list(read_problems(input_path, prompt_key, answer_key, skip_bad_lines, stats, numeric_answers))
    prompts = [build_prompt(problem.question, template, tokenizer.apply_chat_template, instruction, tools)
               for problem in problems]
    records = _prompt_records(problems, prompts, tokenizer, max_prompt_length, stats)
    if not records:
        raise DataError(f"{input_path}: no prompt left to write ({stats.summary()})")
    write_mindrecord_atomically(records, stats.output_path, f"mindrlhf prompts, template {template}")
    stats.written = len(records)
    logger.debug("%s -> %s: %s", input_path, stats.output_path, stats.summary())
    return stats


def _prompt_records(problems: list[Problem], prompts: list[str], tokenizer: TextTokenizer, max_prompt_length: int,
                    stats: ConversionStats) -> list[dict]:
    """The MindRecord rows of the prompts that fit `max_prompt_length` tokens; the others are counted in `stats`."""
    records = []
    for start in range(0, len(prompts), 512):
        token_ids = tokenizer.batch_encode(prompts[start:start + 512])
        for offset, ids in enumerate(token_ids):
            problem = problems[start + offset]
            if len(ids) > max_prompt_length:
                stats.dropped_too_long += 1
                logger.debug("%s: prompt has %d tokens > max_prompt_length %d, dropped",
                             problem.where, len(ids), max_prompt_length)
                continue
            # default=str: Parquet columns may hold values JSON has no type for (dates, decimals, bytes)
            records.append({"prompt_ids": np.asarray(ids, dtype=np.int64), "prompt_length": len(ids),
                            "solution": problem.answer, "prompt": prompts[start + offset],
                            "columns": json.dumps(problem.columns, ensure_ascii=False, default=str)})
            stats.longest_prompt = max(stats.longest_prompt, len(ids))
    return records
