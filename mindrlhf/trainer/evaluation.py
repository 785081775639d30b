"""Held-out evaluation shared by the GRPO trainer and the SFT tool: greedy answers scored by the accuracy rule."""
from __future__ import annotations

from collections.abc import Sequence


def count_correct(generator, tokenizer, prompts: Sequence[Sequence[int]], solutions: Sequence[str],
                  batch_size: int, progress: bool = False) -> float:
    """Sum of the accuracy reward of `generator`'s answers to `prompts` (generated `batch_size` at a time).

    Every batch is padded to `batch_size` rows with copies of its first prompt so one compiled shape serves
    all of them; the copies are not scored.
    """
    from mindrlhf.reward.rules import accuracy_reward

    correct = 0.0
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start:start + batch_size])
        rows = len(batch)
        batch += [batch[0]] * (batch_size - rows)
        out = generator.generate(batch, progress=progress)
        completions = tokenizer.decode_masked(out.response_ids[:rows], out.response_mask[:rows],
                                              skip_special_tokens=True)
        correct += sum(accuracy_reward(completions, list(solutions[start:start + rows])))
    return correct
