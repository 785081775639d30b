"""Writes gsm8k_sample.jsonl: GSM8K-style word problems generated from templates, deterministically.

The held-out split the bundled run evaluates on is made the same way with another seed, without any
question of the training sample:

    python examples/qwen_grpo_tutorial/data/make_sample.py --num 64 --seed 4321 \
        --exclude examples/qwen_grpo_tutorial/data/gsm8k_sample.jsonl \
        --output examples/qwen_grpo_tutorial/data/gsm8k_heldout.jsonl


Each line is {"question": ..., "answer": "<reasoning with <<a*b=c>> calculator notes>\\n#### N"}, the
format of the GSM8K dataset, so the tutorial runs offline without downloading it. Needs only the
standard library:

    python examples/qwen_grpo_tutorial/data/make_sample.py [--num 64] [--seed 1234] [--output FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable

NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina",
         "Lin", "Priya", "Omar", "Sofia", "Mei", "Carlos"]

Problem = tuple[str, list[str], int]  # question, reasoning lines, final answer


def _money(value: int) -> str:
    return f"${value:,}"


def shopping(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    notebooks, notebook_price = rng.randint(2, 9), rng.randint(2, 7)
    pens, pen_price = rng.randint(3, 12), rng.randint(1, 3)
    cost_notebooks, cost_pens = notebooks * notebook_price, pens * pen_price
    total = cost_notebooks + cost_pens
    question = (f"{name} buys {notebooks} notebooks at {_money(notebook_price)} each and {pens} pens at "
                f"{_money(pen_price)} each. How much money does {name} spend in total?")
    lines = [f"The notebooks cost {notebooks} * {notebook_price} = <<{notebooks}*{notebook_price}={cost_notebooks}>>"
             f"{cost_notebooks} dollars.",
             f"The pens cost {pens} * {pen_price} = <<{pens}*{pen_price}={cost_pens}>>{cost_pens} dollars.",
             f"In total {name} spends {cost_notebooks} + {cost_pens} = <<{cost_notebooks}+{cost_pens}={total}>>"
             f"{total} dollars."]
    return question, lines, total


def marbles(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    friends, each = rng.randint(2, 6), rng.randint(3, 9)
    given = friends * each
    total = given + rng.randint(5, 40)
    left = total - given
    question = (f"{name} has {total} marbles. {name} gives {each} marbles to each of {friends} friends. "
                f"How many marbles does {name} have left?")
    lines = [f"{name} gives away {friends} * {each} = <<{friends}*{each}={given}>>{given} marbles.",
             f"So {name} has {total} - {given} = <<{total}-{given}={left}>>{left} marbles left."]
    return question, lines, left


def train_trip(rng: random.Random) -> Problem:
    speed1, hours1 = rng.choice([40, 45, 50, 60, 65, 70]), rng.randint(2, 5)
    speed2, hours2 = rng.choice([30, 35, 55, 75, 80]), rng.randint(2, 4)
    part1, part2 = speed1 * hours1, speed2 * hours2
    total = part1 + part2
    question = (f"A train travels at {speed1} miles per hour for {hours1} hours and then at {speed2} miles per "
                f"hour for {hours2} hours. How many miles does the train travel in all?")
    lines = [f"First it travels {speed1} * {hours1} = <<{speed1}*{hours1}={part1}>>{part1} miles.",
             f"Then it travels {speed2} * {hours2} = <<{speed2}*{hours2}={part2}>>{part2} miles.",
             f"In all it travels {part1} + {part2} = <<{part1}+{part2}={total}>>{total} miles."]
    return question, lines, total


def discount(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    percent = rng.choice([10, 20, 25, 50])
    price = rng.randint(2, 15) * 20
    shipping = rng.randint(3, 12)
    saved = price * percent // 100
    sale_price = price - saved
    total = sale_price + shipping
    question = (f"A jacket costs {_money(price)}. It is on sale for {percent}% off, and {name} pays "
                f"{_money(shipping)} for shipping. How many dollars does {name} pay in total?")
    lines = [f"The discount is {price} * {percent} / 100 = <<{price}*{percent}/100={saved}>>{saved} dollars.",
             f"The sale price is {price} - {saved} = <<{price}-{saved}={sale_price}>>{sale_price} dollars.",
             f"With shipping {name} pays {sale_price} + {shipping} = <<{sale_price}+{shipping}={total}>>"
             f"{total} dollars."]
    return question, lines, total


def savings(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    weekly, weeks = rng.randint(5, 30), rng.randint(4, 12)
    saved = weekly * weeks
    bike = rng.randint(saved // 3, saved - 1)
    left = saved - bike
    question = (f"{name} saves {_money(weekly)} every week. After {weeks} weeks, {name} buys a bike for "
                f"{_money(bike)}. How much money does {name} have left?")
    lines = [f"{name} saves {weekly} * {weeks} = <<{weekly}*{weeks}={saved}>>{saved} dollars.",
             f"After buying the bike {name} has {saved} - {bike} = <<{saved}-{bike}={left}>>{left} dollars left."]
    return question, lines, left


def ages(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    age, times, years = rng.randint(4, 12), rng.randint(2, 4), rng.randint(2, 10)
    parent_age = age * times
    sum_now = age + parent_age
    total = sum_now + 2 * years
    question = (f"{name} is {age} years old. {name}'s aunt is {times} times as old as {name}. In {years} "
                f"years, what will be the sum of their ages?")
    lines = [f"The aunt is {age} * {times} = <<{age}*{times}={parent_age}>>{parent_age} years old.",
             f"Now their ages add up to {age} + {parent_age} = <<{age}+{parent_age}={sum_now}>>{sum_now} years.",
             f"In {years} years each is {years} years older, so the sum is {sum_now} + 2 * {years} = "
             f"<<{sum_now}+2*{years}={total}>>{total}."]
    return question, lines, total


def cookies(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    boxes, per_box = rng.randint(3, 8), rng.randint(4, 10)
    batch_size = rng.choice([6, 8, 10, 12])
    eaten = batch_size - (boxes * per_box) % batch_size  # 1..batch_size: the batches come out even
    baked = boxes * per_box + eaten
    batches = baked // batch_size
    packed = baked - eaten
    question = (f"{name} bakes {batches} batches of cookies with {batch_size} cookies in each batch. {name} eats "
                f"{eaten} of them and packs the rest equally into {boxes} boxes. How many cookies are in each box?")
    lines = [f"{name} bakes {batches} * {batch_size} = <<{batches}*{batch_size}={baked}>>{baked} cookies.",
             f"After eating some, {baked} - {eaten} = <<{baked}-{eaten}={packed}>>{packed} cookies are left.",
             f"Each box gets {packed} / {boxes} = <<{packed}/{boxes}={per_box}>>{per_box} cookies."]
    return question, lines, per_box


def company_revenue(rng: random.Random) -> Problem:
    daily = rng.randint(11, 60) * 50
    days = rng.randint(5, 20)
    costs = rng.randint(2, 9) * 500
    revenue = daily * days
    profit = revenue - costs
    question = (f"A bakery earns {_money(daily)} per day. Over {days} days it pays {_money(costs)} in rent and "
                f"supplies. What is the bakery's profit, in dollars, over those {days} days?")
    lines = [f"The bakery earns {daily} * {days} = <<{daily}*{days}={revenue}>>{revenue} dollars.",
             f"Its profit is {revenue} - {costs} = <<{revenue}-{costs}={profit}>>{profit} dollars."]
    return question, lines, profit


TEMPLATES: list[Callable[[random.Random], Problem]] = [
    shopping, marbles, train_trip, discount, savings, ages, cookies, company_revenue]


def make_problems(num: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[dict[str, str]]:
    """`num` problems cycling through the templates, none with a question in `exclude`; the same
    (num, seed, exclude) always gives the same list."""
    rng = random.Random(seed)
    problems, index = [], 0
    while len(problems) < num:
        question, lines, final = TEMPLATES[index % len(TEMPLATES)](rng)
        index += 1
        if question not in exclude:
            problems.append({"question": question, "answer": "\n".join(lines) + f"\n#### {final}"})
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=64, help="number of problems")
    parser.add_argument("--seed", type=int, default=1234, help="random seed")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                         "gsm8k_sample.jsonl"), help="output JSONL file")
    parser.add_argument("--exclude", default=None, help="JSONL whose questions must not appear (the train split)")
    args = parser.parse_args()
    exclude = frozenset()
    if args.exclude:
        with open(args.exclude, encoding="utf-8") as f:
            exclude = frozenset(json.loads(line)["question"] for line in f if line.strip())
    with open(args.output, "w", encoding="utf-8") as f:
        for problem in make_problems(args.num, args.seed, exclude):
            f.write(json.dumps(problem, ensure_ascii=False) + "\n")
    print(f"wrote {args.num} problems to {args.output}")


if __name__ == "__main__":
    main()
