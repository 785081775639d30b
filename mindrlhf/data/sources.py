"""Input files of the prompt conversion: which files a `--file_path` names, and their records as dicts.

A path is one file or a folder. A folder stands for every `*.json`, `*.jsonl` and `*.parquet` file directly inside
it (not in subfolders; hidden files skipped), read in sorted file-name order (Python string order, so shard names
like `train-00000-of-00002.parquet` come in shard order). Records keep their order within each file.

Each record comes with its position for error messages (`where`): the 1-based line for JSON / JSONL (the line an
item of a JSON list starts on), `row N` (0-based, as pandas and `datasets` index it) for Parquet.
Pure Python apart from `pyarrow`, which is imported only when a Parquet file is read.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence

# what a message about the data's field names advises, in the tool's and in run_grpo.sh's terms
CHOOSE_KEYS = "choose them with --prompt_key / --answer_key (run_grpo.sh: PROMPT_KEY / ANSWER_KEY)"

INPUT_EXTENSIONS = (".json", ".jsonl", ".parquet")
PYARROW_REQUIREMENT = "pyarrow==25.0.1"
PARQUET_BATCH_ROWS = 1024
_JSON_WHITESPACE = " \t\n\r"
_PARQUET_MAGIC = b"PAR1"


class DataError(ValueError):
    """A problem with user data; the message starts with `file:line:` (`file:row N:` for Parquet, or `file:`)
    and says what was wrong."""


def list_input_files(path: str | os.PathLike) -> list[str]:
    """The data files `path` stands for: `[path]` for a file, the folder's input files in sorted name order for a
    folder. Raises `DataError` for a missing path and for a folder without input files."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"{path}: input data file not found")
    names = sorted(name for name in os.listdir(path)
                   if not name.startswith(".") and name.lower().endswith(INPUT_EXTENSIONS)
                   and os.path.isfile(os.path.join(path, name)))
    if not names:
        raise DataError(f"{path}: no input data file in this folder (expected files ending with "
                        f"{', '.join(INPUT_EXTENSIONS)} directly inside it)")
    return [os.path.join(path, name) for name in names]


def is_parquet(path: str) -> bool:
    """Whether `path` is read as Parquet: its name ends with `.parquet` or it starts with Parquet's magic bytes."""
    if path.lower().endswith(".parquet"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(len(_PARQUET_MAGIC)) == _PARQUET_MAGIC
    except OSError:
        return False


def location(path: str, number: int, parquet: bool) -> str:
    """`file:line` (JSON, 1-based) or `file:row N` (Parquet, 0-based): the prefix of a record's messages."""
    return f"{path}:row {number}" if parquet else f"{path}:{number}"


def read_records(path: str | os.PathLike, required_columns: Sequence[str] = ()) -> Iterator[tuple[int, object]]:
    """(line or row number, record) for each record of one JSON list, JSONL or Parquet file.

    A JSONL line that is not valid JSON comes as its `json.JSONDecodeError` (the caller decides whether to skip
    it); invalid JSON inside a JSON list raises `DataError` (the rest of the list cannot be located).
    `required_columns` are checked against a Parquet file's schema before any row is read (`DataError` naming
    the columns it has); JSON records are checked one by one by the caller.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: input data file not found")
    if is_parquet(path):
        return _parquet_rows(path, required_columns)
    text = _read_text(path)
    if text.lstrip(_JSON_WHITESPACE).startswith("["):
        return _json_list_items(text, path)
    return _jsonl_items(text)


def _read_text(path: str) -> str:
    """The UTF-8 text of `path` (a byte-order mark is dropped), or `DataError`."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise DataError(f"{path}: cannot read input data file: {err.strerror}") from None


def _jsonl_items(text: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed object or the JSONDecodeError) for each non-blank line."""
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as err:
            yield line_no, err


def _json_list_items(text: str, path: str) -> Iterator[tuple[int, object]]:
    """Yields (line number where the item starts, item) for a top-level JSON array."""
    decoder = json.JSONDecoder()
    position, line = 0, 1

    def skip_whitespace(start: int) -> int:
        while start < len(text) and text[start] in _JSON_WHITESPACE:
            start += 1
        return start

    def line_at(target: int) -> int:
        nonlocal position, line
        line += text.count("\n", position, target)
        position = target
        return line

    cursor = skip_whitespace(0) + 1  # past '['
    cursor = skip_whitespace(cursor)
    if cursor < len(text) and text[cursor] == "]":
        cursor = skip_whitespace(cursor + 1)
    else:
        while True:
            item_line = line_at(cursor)
            try:
                item, cursor = decoder.raw_decode(text, cursor)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{err.lineno}: invalid JSON in the list: {err.msg} "
                                f"(column {err.colno})") from None
            yield item_line, item
            cursor = skip_whitespace(cursor)
            if cursor < len(text) and text[cursor] == ",":
                cursor = skip_whitespace(cursor + 1)
                continue
            if cursor < len(text) and text[cursor] == "]":
                cursor = skip_whitespace(cursor + 1)
                break
            raise DataError(f"{path}:{line_at(min(cursor, len(text)))}: invalid JSON in the list: "
                            f"expected ',' or ']' after an item")
    if cursor != len(text):
        raise DataError(f"{path}:{line_at(cursor)}: unexpected text after the end of the JSON list")


def _open_parquet(path: str):
    """`pyarrow.parquet.ParquetFile` of `path`; `DataError` when pyarrow is missing or the file is not Parquet."""
    try:
        import pyarrow  # optional: only Parquet input needs it
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DataError(f"{path}: reading Parquet needs pyarrow, which is not installed ({err}); install it with "
                        f"`pip install {PYARROW_REQUIREMENT}` (it is in requirements.txt)") from None
    try:
        return pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as err:
        raise DataError(f"{path}: cannot read as Parquet: {err}") from None


def _parquet_rows(path: str, required_columns: Sequence[str]) -> Iterator[tuple[int, object]]:
    """(0-based row number, row as a dict of Python values) for each row of a Parquet file, in file order.

    Opens and checks the file at once (not at the first `next`), so a missing column is reported up front."""
    parquet = _open_parquet(path)
    columns = parquet.schema_arrow.names
    missing = [name for name in required_columns if name not in columns]
    if missing:
        parquet.close()
        raise DataError(f"{path}: no column {', '.join(repr(name) for name in missing)} (columns present: "
                        f"{columns}); {CHOOSE_KEYS}")

    def rows() -> Iterator[tuple[int, object]]:
        row = 0
        try:
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                for record in batch.to_pylist():
                    yield row, record
                    row += 1
        except (ValueError, OSError) as err:  # pyarrow's ArrowInvalid / ArrowIOError: a damaged file
            raise DataError(f"{path}:row {row}: cannot read as Parquet: {err}") from None
        finally:
            parquet.close()

    return rows()
