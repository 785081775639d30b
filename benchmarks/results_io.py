"""Writing a benchmark's results: JSON, atomically, creating the folder."""
from __future__ import annotations

import json
import os


def write_results(result: dict, path: str) -> None:
    """Writes `result` as indented JSON to `path` (through a temporary file) and says where."""
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, path)
    print(f"wrote {path}")


def format_columns(head, rows) -> str:
    """`head` and `rows` as left-aligned text columns, with a rule under the head."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(row) for row in rows])
