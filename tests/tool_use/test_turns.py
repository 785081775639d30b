"""The tool turns of a rollout on the real Qwen2.5 chat template: the calls of each ended turn run, their results go
back as the template's tool turn (the text transformers renders for the same conversation), a turn without a call
ends the response, malformed calls and huge results are answered and counted, a template without tools refuses."""
import os

import pytest

from mindrlhf.models.tokenizer import HFTokenizer
from mindrlhf.tool_use import ToolDefinitionError, ToolRunner, load_tools
from mindrlhf.tool_use.turns import ToolTurns

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTION = [{"role": "user", "content": "What is 1234 * 5678?"}]


def flood(n: int) -> str:
    """Writes n lines.

    Args:
        n: How many.
    """
    return "\n".join(f"line {i} of the answer" for i in range(n))


@pytest.fixture(scope="module")
def tokenizers(qwen_dir):
    return HFTokenizer(qwen_dir), transformers.AutoTokenizer.from_pretrained(qwen_dir)


def turns_of(tokenizer, max_tokens=64) -> ToolTurns:
    tools = load_tools(["calculator", f"{__name__}:flood"])
    return ToolTurns(ToolRunner(tools, timeout=5.0), tokenizer, max_tokens)


def model_turn(tokenizer, text: str) -> list[int]:
    """A model's turn: its text and the end-of-turn token that ends it."""
    return tokenizer.encode(text) + [tokenizer.eos_token_id]


def test_a_turn_with_calls_gets_the_template_tool_turn_transformers_renders(tokenizers):
    """Prompt + the model's turn + the tool turn decode to transformers' rendering of the conversation with the
    tool's answers and the next assistant prompt; each call's record holds its result; no call: None."""
    ours, reference = tokenizers
    turns = turns_of(ours)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}\n</tool_call>'
    two_calls = call + "\n" + call.replace("1234 * 5678", "2 ** 10")
    prompt = ours.apply_chat_template(QUESTION)
    answers = turns.respond([model_turn(ours, call), model_turn(ours, "The answer is 7006652."),
                             model_turn(ours, two_calls)])
    assert answers[1] is None
    for answer, text, results in ((answers[0], call, ["7006652"]), (answers[2], two_calls, ["7006652", "1024"])):
        assert [record["result"] for record in answer.calls] == results
        assert {record["status"] for record in answer.calls} == {"ok"}
        conversation = QUESTION + [{"role": "assistant", "content": text}] + \
            [{"role": "tool", "content": result} for result in results]
        expected = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        read = prompt + ours.decode(model_turn(ours, text)) + ours.decode(answer.tokens)
        assert read == expected
        assert ours.decode(answer.tokens).startswith("\n<|im_start|>user\n<tool_response>\n")
    assert turns.counts()["ok"] == 3


def test_malformed_calls_unknown_tools_and_huge_results_are_answered_and_counted(tokenizers):
    ours, _ = tokenizers
    turns = turns_of(ours, max_tokens=48)
    malformed = '<tool_call>\n{"name": "calculator", "arguments": \n</tool_call>'
    unknown = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    huge = '<tool_call>\n{"name": "flood", "arguments": {"n": 500}}\n</tool_call>'
    bad, missing, cut = turns.respond([model_turn(ours, malformed), model_turn(ours, unknown), model_turn(ours, huge)])
    assert bad.calls[0]["status"] == "error" and "not JSON" in bad.calls[0]["result"]
    assert "not JSON" in ours.decode(bad.tokens)
    assert missing.calls[0]["status"] == "error" and "no tool is named 'search'" in missing.calls[0]["result"]
    assert cut.calls[0]["status"] == "truncated" and len(cut.tokens) <= 48
    text = ours.decode(cut.tokens)
    assert "line 0 of the answer" in text and "(cut)" in text and text.endswith("<|im_start|>assistant\n")
    assert +turns.counts() == {"error": 2, "truncated": 1}  # (+ drops the zero count of ok)


def test_a_template_without_tool_turns_refuses_in_one_line(qwen_dir):
    from support import paths

    from mindrlhf.models.tokenizer import load_tokenizer

    with pytest.raises(ToolDefinitionError, match="has no chat template that renders tools"):
        turns_of(load_tokenizer(str(paths.TOKENIZER)))
