"""Rule-based reward functions: `fn(completions, solutions) -> list[float]`, one value per completion."""
from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from mindrlhf.data.answers import answers_match, extract_completion_answer, extract_gold_answer, parse_number

logger = logging.getLogger(__name__)

_THINK_THEN_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_warned_about_gold = False


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


def _warn_unparseable_gold(solution: str) -> None:
    global _warned_about_gold
    if not _warned_about_gold:
        _warned_about_gold = True
        logger.warning("accuracy reward: no numeric gold answer in solution %r; such samples get 0.0 "
                       "(this warning is logged once)", solution[-200:])


def accuracy_reward(completions: Sequence[str], solutions: Sequence[str]) -> list[float]:
    """1.0 where the completion's final number equals the solution's gold number, else 0.0.

    The math-verifier reward of DeepSeek-R1 / Open-R1, for numeric answers; the extraction and
    normalisation rules are those of `mindrlhf.data.answers`. An unparseable gold gives 0.0.
    """
    check_reward_inputs(completions, solutions)
    rewards = []
    for completion, solution in zip(completions, solutions):
        gold = extract_gold_answer(solution)
        if gold is None:
            _warn_unparseable_gold(solution)
            rewards.append(0.0)
            continue
        rewards.append(1.0 if answers_match(extract_completion_answer(completion), gold) else 0.0)
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
