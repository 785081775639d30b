"""Extracting and comparing final answers of math problems (GSM8K / MATH style).

Gold answer, from a solution: the text after the last ``####`` (GSM8K), else the last ``\\boxed{...}``,
else the whole solution (`gold_answer_region`). Here it is read as one number (see `parse_number`); anything
else (``x+1``, ``\\sqrt{2}``, an interval) has no numeric gold, and the accuracy reward checks it by meaning
(`mindrlhf.reward.rules`) from the same regions.

Predicted answer, from a completion: the region is the content of the last ``<answer>...</answer>`` if
there is one (then it is authoritative: nothing outside it is looked at), else the last ``\\boxed{...}``
(braces may nest), else the rest of the line after the first ``####`` (GSM8K's answer line, as verl's strict
GSM8K reward reads it: a model that writes several has committed to the first), else the whole text; a
``\\boxed{}`` inside the answer tag narrows the region further (`completion_answer_region`). The region is read
as one number if it is one, else its last number is taken.

Number normalisation (both sides):
  - thousands separators ``1,000`` / ``1{,}000``, a ``$`` or ``\\$`` sign, LaTeX spacing, ``\\text{}``;
  - ``%`` is dropped, the value is kept: ``25%`` == ``25`` (GSM8K golds give percentages as bare numbers;
    so ``25%`` != ``0.25``);
  - a trailing period and trailing unit words after a space: ``72.``, ``72 dollars``, ``72 \\text{ cm}``;
  - a leading ``x =``; outer braces ``{72}``;
  - signs, decimals (``72.0`` == ``72``, ``.5``), and fractions ``3/4``, ``\\frac{3}{4}``, ``\\dfrac34``;
  - not supported: scientific notation, mixed numbers (``1 1/2``), radicals, pi, units glued with symbols.
Values are compared with a relative tolerance of 1e-6 (`answers_match`).
"""
from __future__ import annotations

import math
import re

_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
# A number, possibly signed, possibly a fraction; not glued to a preceding letter, digit or dot.
_CANDIDATE = re.compile(
    rf"(?<![A-Za-z0-9_.])(?P<sign>-?)(?:\\frac\{{(?P<frac_num>{_NUMBER})\}}\{{(?P<frac_den>{_NUMBER})\}}"
    rf"|(?P<num>{_NUMBER})(?:\s*/\s*(?P<den>{_NUMBER}))?)(?!\d)"
)
_WHOLE = re.compile(
    rf"(?P<sign>[+-]?)\s*(?:\\frac\{{(?P<frac_num>{_NUMBER})\}}\{{(?P<frac_den>{_NUMBER})\}}"
    rf"|(?P<num>{_NUMBER})(?:\s*/\s*(?P<den>{_NUMBER}))?)"
    r"(?:\s+[A-Za-z][^\d\\^_{}=+*/<>]*)?"  # trailing unit words ("72 dollars"), after a space
)
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_SHORT_FRAC = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")
_LONG_FRAC = re.compile(r"\\[dt]frac")
_VARIABLE_PREFIX = re.compile(r"^[A-Za-z]\w*\s*=\s*")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASH_ANSWER = re.compile(r"####([^\n]*)")


def last_boxed_content(text: str) -> str | None:
    """Content of the last well-formed ``\\boxed{...}`` (or ``\\fbox{}``) in `text`, nested braces included."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for position in range(start, len(text)):
            if text[position] == "{":
                depth += 1
            elif text[position] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:position]
    return None


def _strip_outer_braces(text: str) -> str:
    while text.startswith("{") and text.endswith("}"):
        depth = 0
        for position, char in enumerate(text):
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth == 0 and position < len(text) - 1:
                return text  # "{a}{b}": the first brace closes early
        text = text[1:-1].strip()
    return text


def _normalize(text: str) -> str:
    text = _TEXT_COMMAND.sub(r" \1", text.replace("\u2212", "-"))
    text = _SHORT_FRAC.sub(r"\\frac{\1}{\2}", text)
    text = _LONG_FRAC.sub(r"\\frac", text)
    text = _DEGREES.sub("", text).replace("°", "")
    text = text.replace("{,}", ",").replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    for spacing in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "~"):
        text = text.replace(spacing, " " if spacing in ("\\ ", "~") else "")
    text = _strip_outer_braces(text.strip())
    text = _VARIABLE_PREFIX.sub("", text)
    return text.strip().rstrip(".").strip()


def _to_float(match: re.Match) -> float | None:
    groups = match.groupdict()
    numerator = groups["frac_num"] if groups["frac_num"] is not None else groups["num"]
    denominator = groups["frac_den"] if groups["frac_num"] is not None else groups["den"]
    value = float(numerator.replace(",", ""))
    if denominator is not None:
        divisor = float(denominator.replace(",", ""))
        if divisor == 0:
            return None
        value /= divisor
    return -value if groups["sign"] == "-" else value


def parse_number(text: str) -> float | None:
    """The value of `text` if, once normalised, it is one number (optionally followed by unit words)."""
    match = _WHOLE.fullmatch(_normalize(text))
    return _to_float(match) if match else None


def last_number(text: str) -> float | None:
    """The value of the last number (or fraction) appearing anywhere in `text`."""
    matches = list(_CANDIDATE.finditer(_normalize(text)))
    for match in reversed(matches):
        value = _to_float(match)
        if value is not None:
            return value
    return None


def gold_answer_region(solution: str) -> str:
    """The part of a solution holding its gold answer: the rest of the line after the last ``####``, else the
    last ``\\boxed{}``'s content, else the whole solution."""
    if "####" in solution:
        lines = solution.rsplit("####", 1)[1].strip().splitlines()
        return lines[0] if lines else ""
    boxed = last_boxed_content(solution)
    return boxed if boxed is not None else solution


def boxed_gold_answer(solution: str) -> str | None:
    """The LaTeX inside a solution's last ``\\boxed{...}`` when that is its gold answer (no ``####`` line) and
    not blank (MATH's solutions), else None."""
    if "####" in solution:
        return None
    boxed = last_boxed_content(solution)
    return boxed if boxed is not None and boxed.strip() else None


def extract_gold_answer(solution: str) -> float | None:
    """The numeric gold answer of a solution (``#### N``, else ``\\boxed{N}``, else a bare number)."""
    return parse_number(gold_answer_region(solution))


def completion_answer_region(completion: str) -> tuple[str, bool]:
    """(region, narrowed): the part of a completion holding its answer (see the module doc) and whether it is
    narrower than the whole text (an ``<answer>`` tag, a ``\\boxed{}`` or a ``####`` line)."""
    answers = _ANSWER_TAG.findall(completion)
    region = answers[-1] if answers else completion
    boxed = last_boxed_content(region)
    if boxed is not None:
        return boxed, True
    if not answers:
        hash_line = _HASH_ANSWER.search(completion)
        if hash_line is not None:
            return hash_line.group(1), True
    return region, bool(answers)


def extract_completion_answer(completion: str) -> float | None:
    """The numeric answer of a completion: last ``<answer>`` tag, else last ``\\boxed{}``, else the first ``####``
    line, else last number."""
    region, _ = completion_answer_region(completion)
    value = parse_number(region)
    return value if value is not None else last_number(region)


def answers_match(predicted: float | None, gold: float | None, rel_tol: float = 1e-6) -> bool:
    """True iff both answers exist and agree within `rel_tol` (relative; absolute 1e-9 around zero)."""
    if predicted is None or gold is None:
        return False
    return math.isclose(predicted, gold, rel_tol=rel_tol, abs_tol=1e-9)


def r1_completion(gsm8k_answer: str, direct: bool = False) -> str:
    """`reasoning #### N` -> `<think>\\nreasoning\\n</think>\\n<answer>N</answer>` (calculator notes removed);
    `direct`: the answer without the worked steps, `<think>\\n</think>\\n<answer>N</answer>`."""
    reasoning, _, answer = gsm8k_answer.rpartition("####")
    reasoning = "" if direct else re.sub(r"<<[^>]*>>", "", reasoning).strip() + "\n"
    return f"<think>\n{reasoning}</think>\n<answer>{answer.strip()}</answer>"
