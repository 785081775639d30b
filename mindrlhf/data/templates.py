"""Prompt templates: how a dataset question becomes the text the policy model is prompted with."""
from __future__ import annotations

import functools
from collections.abc import Callable

from mindrlhf.models.qwen2.tokenizer import render_qwen_chat

# R1-Zero style instruction: reason inside <think>, answer inside <answer> (what the `format` reward checks).
R1_THINK_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The User asks a question and the Assistant solves it. "
    "The Assistant first thinks through the reasoning process step by step and then gives the final answer. "
    "The reasoning is written inside <think> </think> tags and the final answer inside <answer> </answer> "
    "tags, i.e. <think> reasoning here </think><answer> answer here </answer>."
)

TEMPLATE_NAMES = ("chat", "qwen_chat", "r1_think", "raw")

ChatRenderer = Callable[[list[dict]], str]


# verl's GSM8K instruction: the model writes its steps and ends with GSM8K's answer line (the `hash_format` reward).
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def build_prompt(question: str, template: str, render_chat: ChatRenderer | None = None,
                 instruction: str = "", tools: list[dict] | None = None) -> str:
    """The prompt text for `question` (followed by `instruction`, if any, after a space) under `template`.

    - `chat`: the tokenizer's chat template (`render_chat`, e.g. a tokenizer's `apply_chat_template`), the
      question as the user message, ending with the assistant generation prompt;
    - `qwen_chat`: the Qwen2.5 chat template (default Qwen system prompt), whatever the tokenizer;
    - `r1_think`: the chat template with `R1_THINK_SYSTEM_PROMPT` as the system message;
    - `raw`: the question text unchanged.

    `render_chat` defaults to the Qwen2.5 template. `tools` (JSON schemas) go to the tokenizer's template
    (`chat`, `r1_think`), which offers them to the model.
    """
    if tools:
        if template not in ("chat", "r1_think") or render_chat is None:
            raise ValueError(f"prompt template {template!r} renders no tools: use 'chat' or 'r1_think' (the "
                             "tokenizer's own chat template)")
        render_chat = functools.partial(render_chat, tools=tools)
    render_chat = render_chat or render_qwen_chat
    if instruction:
        question = f"{question} {instruction}"
    user = {"role": "user", "content": question}
    if template == "chat":
        return render_chat([user])
    if template == "qwen_chat":
        return render_qwen_chat([user], add_generation_prompt=True)
    if template == "r1_think":
        return render_chat([{"role": "system", "content": R1_THINK_SYSTEM_PROMPT}, user])
    if template == "raw":
        return question
    raise ValueError(f"unknown prompt template {template!r}, expected one of {TEMPLATE_NAMES}")
