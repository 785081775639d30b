"""Prompt templates: how a dataset question becomes the text the policy model is prompted with."""
from __future__ import annotations

from mindrlhf.models.qwen2.tokenizer import render_qwen_chat

# R1-Zero style instruction: reason inside <think>, answer inside <answer> (what the `format` reward checks).
R1_THINK_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The User asks a question and the Assistant solves it. "
    "The Assistant first thinks through the reasoning process step by step and then gives the final answer. "
    "The reasoning is written inside <think> </think> tags and the final answer inside <answer> </answer> "
    "tags, i.e. <think> reasoning here </think><answer> answer here </answer>."
)

TEMPLATE_NAMES = ("qwen_chat", "r1_think", "raw")


def build_prompt(question: str, template: str) -> str:
    """The prompt text for `question` under `template`.

    - `qwen_chat`: the Qwen2.5 chat template, question as the user message (default Qwen system prompt),
      ending with the assistant generation prompt;
    - `r1_think`: the same chat template with `R1_THINK_SYSTEM_PROMPT` as the system message;
    - `raw`: the question text unchanged.
    """
    if template == "qwen_chat":
        return render_qwen_chat([{"role": "user", "content": question}], add_generation_prompt=True)
    if template == "r1_think":
        return render_qwen_chat([{"role": "system", "content": R1_THINK_SYSTEM_PROMPT},
                                 {"role": "user", "content": question}], add_generation_prompt=True)
    if template == "raw":
        return question
    raise ValueError(f"unknown prompt template {template!r}, expected one of {TEMPLATE_NAMES}")
