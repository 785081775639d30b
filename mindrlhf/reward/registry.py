"""Reward functions by name (`accuracy`, `format`, `hash_format`) or by import path (`my_pkg.rewards:fn`), and their
weighted combination (TRL's `reward_funcs` / `reward_weights`).

Two signatures are accepted, told apart once from the function's signature:

* TRL's, when the function takes `**kwargs` or a parameter named `prompts`: it is called with keywords
  `fn(prompts=..., completions=..., completion_ids=..., solution=..., **columns)` (the gold answers under the
  dataset column name `solution`), so reward code written for TRL's `GRPOTrainer` works unchanged;
* otherwise `fn(completions, solutions)`, positionally (the built-ins).

Either may return `None` for a sample ("no opinion"): that function's term is then left out of the sample's
weighted sum (a NaN summed with `nansum`, as TRL does), and its per-function term holds NaN; a sample every
function skipped gets 0, with a warning.

A function that raises, returns anything but one finite number (or None) per completion, or runs past its time
limit (`reward.reward_timeout`) is a `RewardError` naming it and what it did (where it raised); so is one that
cannot be loaded, whatever its module raises on import.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from mindrlhf.reward.rules import accuracy_reward, check_reward_inputs, format_reward, hash_format_reward
from mindrlhf.utils.deadline import TimeLimitExceeded, call_with_time_limit
from mindrlhf.utils.registry import Registry
from mindrlhf.utils.tracebacks import where_raised

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float | None]]

REWARD_FUNCTIONS: Registry = Registry("reward function")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to the registry under `name` (names must be new)."""
    return REWARD_FUNCTIONS.register(name)


register_reward("accuracy")(accuracy_reward)
register_reward("format")(format_reward)
register_reward("hash_format")(hash_format_reward)


def takes_trl_keywords(fn: Callable) -> bool:
    """True when `fn` has TRL's reward signature (`**kwargs` or a `prompts` parameter), see the module doc."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: the positional form
        return False
    return any(p.kind is p.VAR_KEYWORD or p.name == "prompts" for p in parameters)


class RewardError(ValueError):
    """A reward function that cannot be loaded, or that failed, hung or returned something other than one number
    (or None) per completion; the message names the function and what it did."""


def _raised(what: str, err: BaseException) -> RewardError:
    if isinstance(err, SyntaxError):
        return RewardError(f"{what}: {err.filename}:{err.lineno}: SyntaxError: {err.msg}")
    where = where_raised(err)
    text = str(err).strip().splitlines()
    return RewardError(f"{what} raised {type(err).__name__}{': ' + text[0] if text else ''}"
                       f"{f' at {where}' if where else ''}")


def _import_reward_function(path: str) -> RewardFn:
    module_name, _, attribute_path = path.rpartition(":")
    if not module_name or not attribute_path:
        raise RewardError(f"reward function import path {path!r} must look like 'package.module:function'")
    try:
        target = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise RewardError(f"reward function {path!r}: cannot import module {module_name!r}: {err}") from None
    except Exception as err:  # whatever the module raises while it is imported
        raise _raised(f"reward function {path!r}: importing module {module_name!r}", err) from None
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise RewardError(f"reward function {path!r}: {type(target).__name__} "
                              f"{getattr(target, '__name__', target)!r} has no attribute {attribute!r}")
        target = getattr(target, attribute)
    if not callable(target):
        raise RewardError(f"reward function {path!r} is not callable (it is a {type(target).__name__})")
    return target


def get_reward_function(name_or_path: str) -> RewardFn:
    """A registered reward function by name, or a user function by import path 'package.module:function'."""
    if not isinstance(name_or_path, str):
        raise TypeError(f"a reward function is named by a str, got {type(name_or_path).__name__}")
    if ":" in name_or_path:
        return _import_reward_function(name_or_path)
    if name_or_path not in REWARD_FUNCTIONS:
        raise RewardError(f"unknown reward function {name_or_path!r}; expected one of "
                          f"{list(REWARD_FUNCTIONS.names())} or an import path 'package.module:function'")
    return REWARD_FUNCTIONS.get(name_or_path)


def _checked_rewards(name: str, values, expected_length: int) -> np.ndarray:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise RewardError(f"reward function {name!r} must return a list of numbers, got {type(values).__name__}")
    if len(values) != expected_length:
        raise RewardError(f"reward function {name!r} returned {len(values)} values for {expected_length} "
                          "completions")
    for index, value in enumerate(values):
        if value is None:
            continue
        if not isinstance(value, numbers.Real):
            raise RewardError(f"reward function {name!r} returned {type(value).__name__} {value!r:.40} at index "
                              f"{index}, expected a number or None")
        if not math.isfinite(value):
            raise RewardError(f"reward function {name!r} returned {value} at index {index}, expected a finite "
                              "number (or None for no opinion)")
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64).reshape(expected_length)


class WeightedRewards:
    """`(completions, solutions, prompts=None, completion_ids=None, model_completions=None, **columns) -> (total,
    per_function)`: total = sum_i weight_i * reward_i over the functions with an opinion (float32 [n]); per_function
    maps each name (as given) to its unweighted rewards (float32 [n], NaN where it returned None). `prompts`,
    `completion_ids` and `columns` are passed to the TRL-form functions only (see the module doc); the two-argument
    functions read `model_completions` when given (a multi-turn rollout's model text: no tool's answer)."""

    def __init__(self, names: Sequence[str], functions: Sequence[RewardFn], weights: Sequence[float],
                 timeout: float | None = None):
        self.names = tuple(names)
        self.timeout = timeout
        self.functions = tuple(functions)
        self.weights = tuple(weights)
        self.trl_form = tuple(takes_trl_keywords(fn) for fn in self.functions)

    @property
    def needs_prompts(self) -> bool:
        """Whether any function takes TRL's keywords (the caller decodes the prompts only then)."""
        return any(self.trl_form)

    def __call__(self, completions: Sequence[str], solutions: Sequence[str], prompts: Sequence[str] | None = None,
                 completion_ids: Sequence[Sequence[int]] | None = None,
                 model_completions: Sequence[str] | None = None, **columns):
        check_reward_inputs(completions, solutions)
        own = completions if model_completions is None else model_completions
        weighted = np.zeros((len(self.functions), len(completions)), dtype=np.float64)
        per_function = {}
        for index, (name, fn, weight, trl_form) in enumerate(zip(self.names, self.functions, self.weights,
                                                                  self.trl_form)):
            if trl_form:
                call = partial(fn, prompts=prompts, completions=list(completions), completion_ids=completion_ids,
                               solution=list(solutions), **columns)
            else:
                call = partial(fn, own, solutions)
            try:
                values = call_with_time_limit(call, self.timeout)
            except TimeLimitExceeded:
                raise RewardError(f"reward function {name!r} did not return within {self.timeout:g} s for "
                                  f"{len(completions)} completions (reward.reward_timeout)") from None
            except Exception as err:
                raise _raised(f"reward function {name!r}", err) from err
            rewards = _checked_rewards(name, values, len(completions))
            weighted[index] = weight * rewards
            per_function[name] = rewards.astype(np.float32)
        no_opinion = np.isnan(weighted).all(axis=0) if len(self.functions) else np.zeros(0, bool)
        if no_opinion.any():
            logger.warning("every reward function returned None for sample(s) %s: their reward is 0",
                           np.flatnonzero(no_opinion).tolist()[:10])
        return np.nansum(weighted, axis=0).astype(np.float32), per_function

    def __repr__(self) -> str:
        terms = ", ".join(f"{weight:g} * {name}" for name, weight in zip(self.names, self.weights))
        return f"WeightedRewards({terms})"


def columns_per_completion(rows: Sequence[dict], repeats: int) -> dict[str, list]:
    """Dataset fields of each prompt (`rows`, one dict per prompt) as TRL passes them: one list per field name
    with each prompt's value `repeats` times (its completions), None where a prompt lacks the field."""
    names = sorted({name for row in rows for name in row})
    return {name: [row.get(name) for row in rows for _ in range(repeats)] for name in names}


def build_reward_fn(names_or_paths: Sequence[str], weights: Sequence[float] | None = None,
                    timeout: float | None = None) -> WeightedRewards:
    """The weighted sum of the named reward functions (weights default to 1.0 each, as in TRL); each call of a
    function is limited to `timeout` seconds (None or 0: no limit; `mindrlhf.utils.deadline`)."""
    if isinstance(names_or_paths, str) or not isinstance(names_or_paths, Sequence) or not names_or_paths:
        raise TypeError(f"names_or_paths must be a non-empty list of reward function names, got {names_or_paths!r}")
    names = list(names_or_paths)
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"reward functions listed more than once: {duplicates}")
    functions = [get_reward_function(name) for name in names]
    if weights is None:
        weights = [1.0] * len(names)
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, np.ndarray)):
        raise TypeError(f"weights must be a list of numbers, got {type(weights).__name__}")
    if len(weights) != len(names):
        raise ValueError(f"weights has {len(weights)} entries but {len(names)} reward functions are given {names}")
    for name, weight in zip(names, weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"weight of reward function {name!r} must be a finite number, got {weight!r}")
    return WeightedRewards(names, functions, [float(weight) for weight in weights], timeout)
