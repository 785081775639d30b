"""Reward functions by name (`accuracy`, `format`) or by import path (`my_pkg.rewards:fn`), and their
weighted combination (TRL's `reward_funcs` / `reward_weights`)."""
from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np

from mindrlhf.reward.rules import accuracy_reward, check_reward_inputs, format_reward

RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]

REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to the registry under `name` (names must be new)."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARD_FUNCTIONS:
            raise ValueError(f"reward function {name!r} is already registered")
        REWARD_FUNCTIONS[name] = fn
        return fn

    return decorator


def _import_reward_function(path: str) -> RewardFn:
    module_name, _, attribute_path = path.rpartition(":")
    if not module_name or not attribute_path:
        raise ValueError(f"reward function import path {path!r} must look like 'package.module:function'")
    try:
        target = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"reward function {path!r}: cannot import module {module_name!r}: {err}") from err
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise AttributeError(f"reward function {path!r}: {type(target).__name__} "
                                 f"{getattr(target, '__name__', target)!r} has no attribute {attribute!r}")
        target = getattr(target, attribute)
    if not callable(target):
        raise TypeError(f"reward function {path!r} is not callable (it is a {type(target).__name__})")
    return target


def get_reward_function(name_or_path: str) -> RewardFn:
    """A registered reward function by name, or a user function by import path 'package.module:function'."""
    if not isinstance(name_or_path, str):
        raise TypeError(f"a reward function is named by a str, got {type(name_or_path).__name__}")
    if ":" in name_or_path:
        return _import_reward_function(name_or_path)
    if name_or_path not in REWARD_FUNCTIONS:
        raise ValueError(f"unknown reward function {name_or_path!r}; expected one of {sorted(REWARD_FUNCTIONS)} "
                         f"or an import path 'package.module:function'")
    return REWARD_FUNCTIONS[name_or_path]


def _checked_rewards(name: str, values, expected_length: int) -> np.ndarray:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"reward function {name!r} must return a list of numbers, got {type(values).__name__}")
    if len(values) != expected_length:
        raise ValueError(f"reward function {name!r} returned {len(values)} values for {expected_length} completions")
    for index, value in enumerate(values):
        if not isinstance(value, numbers.Real):
            raise TypeError(f"reward function {name!r} returned {type(value).__name__} at index {index}, "
                            f"expected a number")
        if not math.isfinite(value):
            raise ValueError(f"reward function {name!r} returned {value} at index {index}, expected a finite number")
    return np.asarray(values, dtype=np.float64).reshape(expected_length)


class WeightedRewards:
    """`(completions, solutions) -> (total, per_function)`: total = sum_i weight_i * reward_i (float32 [n]);
    per_function maps each name (as given) to its unweighted rewards (float32 [n])."""

    def __init__(self, names: Sequence[str], functions: Sequence[RewardFn], weights: Sequence[float]):
        self.names = tuple(names)
        self.functions = tuple(functions)
        self.weights = tuple(weights)

    def __call__(self, completions: Sequence[str], solutions: Sequence[str]):
        check_reward_inputs(completions, solutions)
        total = np.zeros(len(completions), dtype=np.float64)
        per_function = {}
        for name, fn, weight in zip(self.names, self.functions, self.weights):
            try:
                values = fn(completions, solutions)
            except Exception as err:
                err.add_note(f"raised by reward function {name!r}")
                raise
            rewards = _checked_rewards(name, values, len(completions))
            total += weight * rewards
            per_function[name] = rewards.astype(np.float32)
        return total.astype(np.float32), per_function

    def __repr__(self) -> str:
        terms = ", ".join(f"{weight:g} * {name}" for name, weight in zip(self.names, self.weights))
        return f"WeightedRewards({terms})"


def build_reward_fn(names_or_paths: Sequence[str], weights: Sequence[float] | None = None) -> WeightedRewards:
    """The weighted sum of the named reward functions (weights default to 1.0 each, as in TRL)."""
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
    return WeightedRewards(names, functions, [float(weight) for weight in weights])
