"""The documents point at what is there: every relative link of the user documents (README.md, docs/, the tutorial's
and the benchmarks' READMEs) and of the measurement history reaches a file of the repository and, with a
`#fragment`, one of its headings; every results file the user documents cite as a figure's source (not as what a
command writes) is in the repository (git ignores benchmarks/results/ but for the files added on purpose)."""
import functools
import re
import subprocess
from pathlib import Path

import pytest
from support.paths import BENCHMARKS, DOCS, README, ROOT, TUTORIAL

USER_DOCS = [README, TUTORIAL / "README.md", BENCHMARKS / "README.md", *sorted(DOCS.glob("*.md"))]
LINKED_DOCS = [*USER_DOCS, BENCHMARKS / "results" / "history.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.MULTILINE)
CITED_RESULT = re.compile(r"(?:benchmarks/)?results/([\w.-]+\.json)")
NAMED_AS_OUTPUT = re.compile(r"(?:--output|writes)\s+`?$")  # "--output results/x.json", "writes `results/x.json`"


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(doc: Path) -> set[str]:
    """The fragments of a markdown file's headings (a repeated heading's later ones get -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
    for match in HEADING.finditer(text):
        anchor = github_anchor(match.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


@functools.cache
def tracked_paths() -> frozenset[str] | None:
    """The repository's files and folders as git knows them (relative, POSIX), or None outside a git checkout (then
    the disk decides)."""
    if not (ROOT / ".git").exists():
        return None
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = listed.stdout.splitlines()
    return frozenset(files) | {parent.as_posix() for name in files for parent in Path(name).parents}


def in_repository(path: Path) -> bool:
    tracked = tracked_paths()
    if tracked is None:
        return path.exists()
    return path.resolve().relative_to(ROOT).as_posix() in tracked


def test_github_anchor_follows_githubs_rule():
    assert github_anchor("Qwen2.5-7B recipes (plan only)") == "qwen25-7b-recipes-plan-only"
    assert github_anchor("TRL + PEFT against `ours`") == "trl--peft-against-ours"
    assert github_anchor("[versus_trl.py](x.py): the whole job") == "versus_trlpy-the-whole-job"


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_heading(doc):
    broken = []
    for match in LINK.finditer(doc.read_text(encoding="utf-8")):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, fragment = target.partition("#")
        linked = (doc.parent / path) if path else doc
        if not in_repository(linked):
            broken.append(f"{target}: no such file in the repository")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: {linked.name} has no heading with that anchor")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_cited_results_files_are_in_the_repository(doc):
    text = doc.read_text(encoding="utf-8")
    missing = [match.group(0) for match in CITED_RESULT.finditer(text)
               if not NAMED_AS_OUTPUT.search(text[max(0, match.start() - 20):match.start()])
               and not in_repository(BENCHMARKS / "results" / match.group(1))]
    assert not missing, f"{doc.relative_to(ROOT)} cites results that are not in the repository: {missing}"
