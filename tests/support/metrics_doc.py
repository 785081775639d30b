"""docs/metrics.md, one table row per metric the trainer writes: its rows, a row's name as a pattern, and
`assert_documented` for the metrics.jsonl of any run (tests/trainer/test_metrics_doc.py checks the table itself)."""
import re

from support.paths import DOCS

DOC = DOCS / "metrics.md"


def metric_rows() -> dict[str, list[str]]:
    """Each row of the table: its metric (`<phase>`-like placeholders kept) -> its other cells."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        name = cells[0].strip("`")
        assert name not in rows, f"docs/metrics.md has two rows for {name}"
        assert len(cells) == 5 and all(cells), f"docs/metrics.md: the row of {name} needs its 5 cells"
        rows[name] = cells[1:]
    return rows


def name_pattern(name: str) -> re.Pattern:
    """A row's name as a pattern: a placeholder such as `<phase>` stands for one name part."""
    parts = re.split(r"(<[a-z]+>)", name)
    return re.compile("".join("[^/]+" if part.startswith("<") else re.escape(part) for part in parts) + r"\Z")


def undocumented(keys) -> list[str]:
    patterns = [name_pattern(name) for name in metric_rows()]
    return sorted(key for key in set(keys) if not any(p.match(key) for p in patterns))


def assert_documented(records) -> None:
    """Every key of `records` (metrics.jsonl lines, or metrics dicts) has its row in docs/metrics.md."""
    missing = undocumented(key for record in records for key in record)
    assert not missing, f"metrics without a row in docs/metrics.md: {missing}"
