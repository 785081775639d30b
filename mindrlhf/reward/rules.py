"""Rule-based reward functions: `fn(completions, solutions) -> list[float]`, one value per completion."""
from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Sequence

from mindrlhf.data.answers import (
    answers_match,
    completion_answer_region,
    extract_completion_answer,
    gold_answer_region,
    parse_number,
)
from mindrlhf.utils.deadline import TimeLimitExceeded, call_with_time_limit

logger = logging.getLogger(__name__)

ANSWER_TIME_LIMIT = 5.0  # seconds for one answer's check by meaning (parse + verify), in the main thread

_THINK_THEN_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_warned: set[str] = set()  # the once-only warnings already logged
_MATH_DELIMITER = re.compile(r"\$|\\\(|\\\[|\\boxed|\\fbox")
_TIMED_OUT = object()  # a gold whose parse ran past the limit (its other answers time out at once)
_timeouts_lock = threading.Lock()
_timeouts = 0


class _DropTimeoutNotice(logging.Filter):
    """Drops math-verify's notice that its own (signal-based) timeouts are off: `call_with_time_limit` bounds it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@functools.cache
def _math_verify():
    """(math-verify, what it reads on both sides), imported at the first check by meaning: it loads sympy (~0.7 s,
    which every process of a job whose golds are numbers would otherwise pay at start)."""
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutNotice())
    # LaTeX (as Open-R1's and TRL's accuracy rewards read answers), a \boxed{} first; one config object, so that its
    # compiled patterns stay in math-verify's cache
    return math_verify, (math_verify.LatexExtractionConfig(boxed_match_priority=0),)


def take_answer_check_timeouts() -> int:
    """The number of answer checks by meaning that ran past their time limit (and scored 0.0) in this process
    since the last call; the count restarts at 0."""
    global _timeouts
    with _timeouts_lock:
        count, _timeouts = _timeouts, 0
    return count


def _count_timeout() -> None:
    global _timeouts
    with _timeouts_lock:
        _timeouts += 1


def check_reward_inputs(completions: Sequence[str], solutions: Sequence[str]) -> None:
    """Both must be sequences of str of the same length; errors name the argument and the index."""
    for name, values in (("completions", completions), ("solutions", solutions)):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{name} must be a list of str, got {type(values).__name__}")
        for index, value in enumerate(values):
            if not isinstance(value, str):
                raise TypeError(f"{name}[{index}] must be a str, got {type(value).__name__}")
    if len(completions) != len(solutions):
        raise ValueError(f"completions and solutions must have the same length, got {len(completions)} "
                         f"completions and {len(solutions)} solutions")


def _warn_once(message: str, text: str) -> None:
    """Logs `message` (with the tail of `text`) the first time only."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message + " (this warning is logged once)", text[-200:])


def _parse(text: str, narrowed: bool) -> list:
    """math-verify's reading of `text` (its own signal timeout off); an answer region without math delimiters is
    read as one LaTeX formula."""
    if narrowed and not _MATH_DELIMITER.search(text):
        text = f"${text}$"
    math_verify, targets = _math_verify()
    return math_verify.parse(text, extraction_config=targets, extraction_mode="first_match", parsing_timeout=None)


def _matches_by_meaning(completion: str, gold_text: str, golds: dict) -> bool:
    """Whether the completion's answer equals the gold by meaning; `golds` caches the parsed golds of one call."""
    if gold_text not in golds:
        golds[gold_text] = _TIMED_OUT  # stays if the limit passes while the gold is parsed
        try:
            golds[gold_text] = _parse(gold_text, narrowed=True)
        except Exception:
            golds[gold_text] = []  # an error, not a timeout: its answers score 0.0 uncounted
            raise
        if not golds[gold_text]:
            _warn_once("accuracy reward: math-verify reads no answer in the gold %r either; such samples get 0.0",
                       gold_text)
    gold = golds[gold_text]
    if gold is _TIMED_OUT:
        raise TimeLimitExceeded("the gold answer's parse ran past the limit")
    if not gold:
        return False
    answer = _parse(*completion_answer_region(completion))
    return bool(answer) and _math_verify()[0].verify(gold, answer, timeout_seconds=None)


def _reward_by_meaning(completion: str, gold_text: str, golds: dict, seconds: float | None) -> float:
    """1.0 or 0.0 from `_matches_by_meaning` within `seconds` (a timeout is 0.0 and counted); never raises for
    a malformed answer (math-verify reads it as a string or not at all)."""
    _math_verify()  # imported outside the time limit
    try:
        return 1.0 if call_with_time_limit(_matches_by_meaning, seconds, completion, gold_text, golds) else 0.0
    except TimeLimitExceeded:
        _count_timeout()
        return 0.0
    except Exception:  # math-verify catches its own errors; this guards the reward against the rest
        logger.debug("accuracy reward: checking %r against %r failed", completion[-200:], gold_text, exc_info=True)
        return 0.0


def accuracy_reward(completions: Sequence[str], solutions: Sequence[str], *,
                    answer_time_limit: float | None = ANSWER_TIME_LIMIT) -> list[float]:
    """1.0 where the completion's final answer equals the solution's gold, else 0.0 (DeepSeek-R1 / Open-R1's
    math-verifier reward).

    A numeric gold is compared with the completion's final number (`mindrlhf.data.answers`); any other gold
    (``\\sqrt{12}``, a tuple, an interval) by meaning with math-verify, each answer's check limited to
    `answer_time_limit` seconds (None or 0: none) in the main thread and unbounded in others (signals reach the
    main thread only); a timeout scores 0.0 and is counted (`take_answer_check_timeouts`).
    """
    check_reward_inputs(completions, solutions)
    rewards = []
    golds: dict = {}
    for completion, solution in zip(completions, solutions):
        gold_text = gold_answer_region(solution)
        gold = parse_number(gold_text)
        if gold is not None:
            rewards.append(1.0 if answers_match(extract_completion_answer(completion), gold) else 0.0)
            continue
        _warn_once("accuracy reward: no numeric gold answer in solution %r; such answers are checked by meaning with "
                   "math-verify", solution)
        rewards.append(_reward_by_meaning(completion, gold_text, golds, answer_time_limit))
    return rewards


def is_think_answer_format(completion: str) -> bool:
    """True iff the text is ``<think>...</think>`` then ``<answer>...</answer>``, each tag exactly once,
    with only whitespace outside and between them (tag contents may be empty)."""
    if any(completion.count(tag) != 1 for tag in _FORMAT_TAGS):
        return False
    return _THINK_THEN_ANSWER.fullmatch(completion) is not None


def format_reward(completions: Sequence[str], solutions: Sequence[str]) -> list[float]:
    """1.0 where the completion follows the DeepSeek-R1 ``<think>..</think><answer>..</answer>`` template."""
    check_reward_inputs(completions, solutions)
    return [1.0 if is_think_answer_format(completion) else 0.0 for completion in completions]


def is_hash_answer_format(completion: str) -> bool:
    """True iff the text's only ``####`` is on its last line, followed by one number (GSM8K's answer line)."""
    lines = completion.strip().splitlines()
    if completion.count("####") != 1 or "####" not in lines[-1]:
        return False
    return parse_number(lines[-1].split("####", 1)[1]) is not None


def hash_format_reward(completions: Sequence[str], solutions: Sequence[str]) -> list[float]:
    """1.0 where the completion ends with one GSM8K answer line ``#### N`` (verl's GSM8K instruction "output the
    final answer after ####"); a response cut off at the length limit rarely does."""
    check_reward_inputs(completions, solutions)
    return [1.0 if is_hash_answer_format(completion) else 0.0 for completion in completions]
