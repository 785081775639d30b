"""Writes arithmetic word problems (two or three operands, + - *, small numbers) as GSM8K-style JSONL splits.

A task a model of a few million parameters can learn, for a bundled GRPO run that shows learning on problems
it never trained on: `arithmetic_train.jsonl` and a held-out `arithmetic_heldout.jsonl` whose questions never
appear in the train split. Each line is `{"question": ..., "answer": "<worked steps>\\n#### N"}`. Seeded and
standard-library only, so the files are rebuilt byte for byte:

    python examples/qwen_grpo_tutorial/data/make_arithmetic.py [--num_train 2000] [--num_heldout 200] [--seed 7]

`--task tools` writes `tool_arithmetic_train.jsonl` and `tool_arithmetic_heldout.jsonl` instead: products of two
3-digit numbers, too big for a small model to work out in its head, which a policy with a calculator answers
(model_configs/arith_tools).
"""
from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena", "Mateo",
         "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tomas", "Uma", "Viktor", "Wen", "Yusuf", "Zoe"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "coins", "books", "cards", "shells", "stamps", "cookies",
         "buttons", "balloons"]
CONTAINERS = ["bags", "boxes", "packs", "jars", "baskets"]

Problem = tuple[str, list[str], int]  # question, worked steps, answer


def _ask(rng: random.Random, name: str, item: str) -> str:
    return rng.choice([f"How many {item} does {name} have now?", f"How many {item} does {name} have in total?",
                       f"How many {item} does {name} end up with?", f"What is the number of {item} {name} has now?"])


def add(rng: random.Random) -> Problem:
    (name, friend), item = rng.sample(NAMES, 2), rng.choice(ITEMS)
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    story = rng.choice([f"{name} has {a} {item}. {friend} gives {name} {b} more.",
                        f"{name} had {a} {item} and then found {b} more.",
                        f"{name} collects {a} {item} on Monday and {b} {item} on Tuesday."])
    return f"{story} {_ask(rng, name, item)}", [f"{a} + {b} = {a + b}"], a + b


def subtract(rng: random.Random) -> Problem:
    (name, friend), item = rng.sample(NAMES, 2), rng.choice(ITEMS)
    a = rng.randint(5, 40)
    b = rng.randint(1, a - 1)
    story = rng.choice([f"{name} has {a} {item} and gives {b} to {friend}.",
                        f"{name} had {a} {item}, but {b} of them got lost.",
                        f"{name} buys {a} {item} and uses {b} of them."])
    return f"{story} {_ask(rng, name, item)}", [f"{a} - {b} = {a - b}"], a - b


def _product(rng: random.Random, low: int, high: int, stories: Callable[..., list[str]]) -> Problem:
    """A containers-of-items product of two numbers in [low, high], told by one of `stories(name, item, container,
    a, b)`."""
    name, item, container = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b = rng.randint(low, high), rng.randint(low, high)
    story = rng.choice(stories(name, item, container, a, b))
    return f"{story} {_ask(rng, name, item)}", [f"{a} * {b} = {a * b}"], a * b


def multiply(rng: random.Random) -> Problem:
    return _product(rng, 2, 9, lambda name, item, container, a, b: [
        f"{name} has {a} {container} with {b} {item} in each.",
        f"{name} buys {a} {container} of {item}, and each holds {b} {item}."])


def add_subtract(rng: random.Random) -> Problem:
    (name, friend), item = rng.sample(NAMES, 2), rng.choice(ITEMS)
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    c = rng.randint(1, a + b - 1)
    story = rng.choice([f"{name} has {a} {item}, gets {b} more from {friend}, then gives away {c}.",
                        f"{name} starts with {a} {item}, finds {b} more and loses {c}."])
    return (f"{story} {_ask(rng, name, item)}", [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"],
            a + b - c)


def multiply_add(rng: random.Random) -> Problem:
    name, item, container = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
    story = rng.choice([f"{name} has {a} {container} of {b} {item} each and {c} loose {item}.",
                        f"{name} buys {a} {container} with {b} {item} in each, then gets {c} more {item}."])
    return f"{story} {_ask(rng, name, item)}", [f"{a} * {b} = {a * b}", f"{a * b} + {c} = {a * b + c}"], a * b + c


def multiply_subtract(rng: random.Random) -> Problem:
    (name, friend), item, container = rng.sample(NAMES, 2), rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, a * b - 1)
    story = rng.choice([f"{name} has {a} {container} with {b} {item} in each and gives {c} {item} to {friend}.",
                        f"{name} fills {a} {container} with {b} {item} each, then eats {c} of them."])
    return f"{story} {_ask(rng, name, item)}", [f"{a} * {b} = {a * b}", f"{a * b} - {c} = {a * b - c}"], a * b - c


def big_multiply(rng: random.Random) -> Problem:
    return _product(rng, 101, 999, lambda name, item, container, a, b: [
        f"{name} has {a} {container} with {b} {item} in each.",
        f"{name} packs {b} {item} into each of {a} {container}."])


def big_rate(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(101, 999), rng.randint(101, 999)
    question = rng.choice([f"{name} makes {a} {item} a day. How many {item} does {name} make in {b} days?",
                           f"A shop sells {a} {item} every week. How many {item} does it sell in {b} weeks?"])
    return question, [f"{a} * {b} = {a * b}"], a * b


TEMPLATES: list[Callable[[random.Random], Problem]] = [
    add, subtract, multiply, add_subtract, multiply_add, multiply_subtract]
TASKS = {"word": ("arithmetic", TEMPLATES), "tools": ("tool_arithmetic", [big_multiply, big_rate])}


def make_splits(num_train: int, num_heldout: int, seed: int,
                templates: list[Callable[[random.Random], Problem]] = TEMPLATES) -> tuple[list[dict], list[dict]]:
    """(train, held-out) problems with distinct questions, the templates in turn; deterministic per arguments."""
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[dict] = []
    index = 0
    while len(problems) < num_train + num_heldout:
        question, steps, answer = templates[index % len(templates)](rng)
        index += 1
        if question in seen:
            continue
        seen.add(question)
        problems.append({"question": question, "answer": "\n".join(steps) + f"\n#### {answer}"})
    return problems[:num_train], problems[num_train:]


def main(argv: list[str] | None = None) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_train", type=int, default=2000)
    parser.add_argument("--num_heldout", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output_dir", default=here)
    parser.add_argument("--task", choices=sorted(TASKS), default="word",
                        help="word: the word problems; tools: products of 3-digit numbers, for a calculator")
    args = parser.parse_args(argv)
    stem, templates = TASKS[args.task]
    train, heldout = make_splits(args.num_train, args.num_heldout, args.seed, templates)
    for name, problems in ((f"{stem}_train.jsonl", train), (f"{stem}_heldout.jsonl", heldout)):
        path = os.path.join(args.output_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in problems)
        print(f"wrote {len(problems)} problems to {path}")


if __name__ == "__main__":
    main()
