"""`--log_completions` (TRL's name): each step's sampled responses as lines of `<output_dir>/completions.jsonl`, one
a response: its prompt and completion text, reward, each reward function's term and advantage (the mean over its
trained tokens: GRPO's is the same on every token); a multi-turn response also its `segments`, each turn's role and
text."""
from __future__ import annotations

import json
import os

import numpy as np

from mindrlhf.data.experience import Experience, trained_tokens
from mindrlhf.generation.trajectories import segments
from mindrlhf.trainer.metrics import append_lines, truncate_after_step
from mindrlhf.utils.output_owner import COMPLETIONS_FILE


def completion_records(step: int, exp: Experience, tokenizer) -> list[dict]:
    """One JSON-ready record per row of `exp`."""
    prompts = tokenizer.decode_masked(exp.prompt_ids, exp.prompt_mask, skip_special_tokens=False)
    completions = tokenizer.completions(exp.response_ids, exp.response_mask)
    multi_turn = "loss_mask" in exp
    mask = exp[trained_tokens(exp)].astype(np.float64)
    advantages = (exp.advantages * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1.0)
    terms = exp.reward_terms
    records = [{"step": step, "prompt": prompts[i], "completion": completions[i], "reward": float(exp.rewards[i]),
                **{f"reward/{name}": float(values[i]) for name, values in terms.items()},
                "advantage": float(advantages[i]), "response_length": int(mask[i].sum())}
               for i in range(exp.num_rows)]
    if multi_turn:
        turns = response_turns(tokenizer, exp.response_ids, exp.response_mask, exp.loss_mask)
        for record, messages in zip(records, turns):
            record["segments"] = [{"role": m["role"], "text": m["content"]} for m in messages]
    return records


def response_turns(tokenizer, response_ids, response_mask, loss_mask) -> list[list[dict]]:
    """Each response's turns as chat messages: {"role": "assistant" or "tool", "content": the text of its tokens}
    (special tokens skipped); the tool turns are the response tokens outside `loss_mask`."""
    tool_mask = response_mask * (1 - loss_mask)
    return [[{"role": role, "content": tokenizer.completion(ids[start:end])}
             for role, start, end in segments(mask, tools)]
            for ids, mask, tools in zip(response_ids, response_mask, tool_mask)]


class CompletionsLog:
    """Appends each step's records; only the rank that owns it writes, and a resumed run drops the lines after its
    checkpoint's step as metrics.jsonl does."""

    def __init__(self, output_dir: str, enabled: bool, resume_step: int = 0):
        self.path = os.path.join(output_dir, COMPLETIONS_FILE) if enabled else None
        if self.path:
            os.makedirs(output_dir, exist_ok=True)
            truncate_after_step(self.path, resume_step)

    def write(self, step: int, exp: Experience, tokenizer) -> None:
        if self.path:
            lines = "".join(json.dumps(r) + "\n" for r in completion_records(step, exp, tokenizer))
            append_lines(self.path, lines, "this step's completions")
