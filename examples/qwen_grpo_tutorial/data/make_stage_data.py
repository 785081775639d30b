"""Writes GSM8K-style problems as data for the stages before RL (chat `messages` JSONL), in the R1 form the bundled
policy answers in (`<think>steps</think><answer>N</answer>`, what the `format` and `accuracy` rewards check):

    --kind sft       a conversation per problem: the R1 system prompt, the question, the worked solution (with
                     --direct_fraction F, a seeded share F of the problems answered without the working)
    --kind pairwise  a preference pair per problem on the same prompt: the worked solution (chosen) against a wrong
                     one (rejected; seeded: a share --worked_wrong_share of them, half by default, with the working
                     and the last step's result off by 1-3, the others a wrong answer given without working, the
                     bundled policy's own failure); --pairs_per_problem N: N pairs a problem, each wrong answer
                     different
    --kind tool_sft  a tool-use demonstration per problem (the cold start of a policy with a calculator): the
                     question, a calculator call a step, the calculator's answer as the tool turn, then
                     <answer>N</answer>; the record's `tools` field (TRL's) holds the calculator's schema
                     (--direct_fraction: a seeded share answered without a call)

    python examples/qwen_grpo_tutorial/data/make_stage_data.py --kind pairwise --input arithmetic_train.jsonl \\
        --output pairs.jsonl

Then `rlhf_data.py --kind sft | pairwise` tokenises them through the tokenizer's chat template (run_grpo.sh's
ALGORITHM=sft | reward | dpo do both).
"""
from __future__ import annotations

import argparse
import json
import random
import sys

from mindrlhf.data.answers import r1_completion
from mindrlhf.data.mindrecord import read_problems
from mindrlhf.data.sources import DataError
from mindrlhf.data.templates import R1_THINK_SYSTEM_PROMPT
from mindrlhf.tool_use import calculator, function_schema
from mindrlhf.utils.atomic import atomic_output


def prompt(question: str) -> list[dict]:
    return [{"role": "system", "content": R1_THINK_SYSTEM_PROMPT}, {"role": "user", "content": question}]


def conversation(question: str, answer: str, direct: bool = False) -> dict:
    """One problem as an SFT record of chat messages (`direct`: the answer without the working)."""
    return {"messages": prompt(question) + [{"role": "assistant", "content": r1_completion(answer, direct=direct)}]}


def tool_demonstration(question: str, answer: str, direct: bool = False) -> dict:
    """One problem solved with the calculator, a call a worked step (`direct`: answered without a call)."""
    steps, _, number = answer.rpartition("####")
    messages = [{"role": "user", "content": question}]
    for step in ([] if direct else steps.strip().splitlines()):
        expression, _, result = step.rpartition("=")
        call = {"name": "calculator", "arguments": {"expression": expression.strip()}}
        messages += [{"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                     {"role": "tool", "content": result.strip()}]
    messages.append({"role": "assistant", "content": f"<answer>{number.strip()}</answer>"})
    return {"messages": messages, "tools": [function_schema(calculator)]}


def wrong_completion(answer: str, rng: random.Random, worked_share: float = 0.5) -> str:
    """A wrong R1 completion of `answer` (`steps #### N`): with probability `worked_share` the last step's result and N
    off by 1-3, else a wrong N given without the steps."""
    steps, _, number = answer.rpartition("####")
    wrong = int(number.strip()) + rng.choice([-3, -2, -1, 1, 2, 3])
    if rng.random() < 1.0 - worked_share:
        return r1_completion(f"#### {wrong}", direct=True)
    lines = steps.strip().splitlines()
    lines[-1] = lines[-1].rpartition("=")[0] + f"= {wrong}"
    return r1_completion("\n".join(lines) + f"\n#### {wrong}")


def pair(question: str, answer: str, rng: random.Random, worked_share: float = 0.5) -> dict:
    """One problem as a preference pair (TRL's prompt / chosen / rejected, in messages)."""
    return {"prompt": prompt(question),
            "chosen": [{"role": "assistant", "content": r1_completion(answer)}],
            "rejected": [{"role": "assistant", "content": wrong_completion(answer, rng, worked_share)}]}


def pairs(question: str, answer: str, count: int, rng: random.Random, worked_share: float = 0.5) -> list[dict]:
    """`count` pairs of one problem, each against another wrong answer (while the draws allow: 12 a problem)."""
    found: dict[str, dict] = {}
    for _ in range(20 * count):
        record = pair(question, answer, rng, worked_share)
        found.setdefault(record["rejected"][0]["content"], record)
        if len(found) == count:
            break
    return list(found.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("sft", "pairwise", "tool_sft"), required=True)
    parser.add_argument("--input", required=True, help="GSM8K-style JSON/JSONL/Parquet problems (question, answer)")
    parser.add_argument("--output", required=True, help="the JSONL to write")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the wrong answers (pairwise) or of the problems answered directly (sft)")
    parser.add_argument("--pairs_per_problem", type=int, default=1,
                        help="pairwise: this many pairs of each problem, each against a wrong answer of its own")
    parser.add_argument("--worked_wrong_share", type=float, default=0.5,
                        help="pairwise: the share of the wrong answers that show the working with the last step "
                             "off by 1-3 (the others: a wrong answer without working)")
    parser.add_argument("--direct_fraction", type=float, default=0.0,
                        help="sft, tool_sft: the share of the problems (a seeded choice) answered without the "
                             "working (without a call)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    try:
        problems = list(read_problems(args.input))
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.pairs_per_problem < 1:
        print(f"error: --pairs_per_problem must be >= 1, got {args.pairs_per_problem}", file=sys.stderr)
        return 2
    if not 0.0 <= args.worked_wrong_share <= 1.0:
        print(f"error: --worked_wrong_share must be in [0, 1], got {args.worked_wrong_share}", file=sys.stderr)
        return 2
    if not 0.0 <= args.direct_fraction <= 1.0:
        print(f"error: --direct_fraction must be in [0, 1], got {args.direct_fraction}", file=sys.stderr)
        return 2
    if args.kind == "pairwise":
        records = [record for p in problems
                   for record in pairs(p.question, p.answer, args.pairs_per_problem, rng, args.worked_wrong_share)]
    else:
        make = conversation if args.kind == "sft" else tool_demonstration
        records = [make(p.question, p.answer, rng.random() < args.direct_fraction) for p in problems]
    with atomic_output(args.output, ".jsonl") as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(record) + "\n" for record in records))
    print(f"{len(records)} {'pairs' if args.kind == 'pairwise' else 'conversations'} -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
