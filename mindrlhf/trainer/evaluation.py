"""Held-out evaluation shared by the GRPO trainer and the SFT tool: greedy answers scored by rule rewards."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from mindrlhf.reward.rules import accuracy_reward


def score_greedy(generator, tokenizer, prompts: Sequence[Sequence[int]], solutions: Sequence[str], batch_size: int,
                 scorers: Mapping[str, Callable], progress: bool = False) -> dict[str, float]:
    """Per scorer `fn(completions, solutions)`, the sum of its values over `generator`'s answers to `prompts`
    (generated `batch_size` at a time; with tools, the model's own text: a tool's answer is none of the model's).

    Every batch is padded to `batch_size` rows with copies of its first prompt so one compiled shape serves
    all of them; the copies are not scored.
    """
    totals = dict.fromkeys(scorers, 0.0)
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start:start + batch_size])
        rows = len(batch)
        batch += [batch[0]] * (batch_size - rows)
        out = generator.generate(batch, progress=progress)
        completions = tokenizer.completions(out.response_ids[:rows], out.model_mask[:rows])
        for name, scorer in scorers.items():
            totals[name] += float(sum(scorer(completions, list(solutions[start:start + rows]))))
    return totals


def count_correct(generator, tokenizer, prompts: Sequence[Sequence[int]], solutions: Sequence[str],
                  batch_size: int, progress: bool = False) -> float:
    """Sum of the accuracy reward of `generator`'s greedy answers to `prompts` (see `score_greedy`)."""
    return score_greedy(generator, tokenizer, prompts, solutions, batch_size, {"accuracy": accuracy_reward},
                        progress)["accuracy"]
