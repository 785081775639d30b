"""The data of a tool job (#67): prompts that offer the tools through the tokenizer's chat template
(`rlhf_data.py --tools`), tool-use demonstrations for a cold start (`make_stage_data.py --kind tool_sft`, the record's
`tools` rendered, only the model's turns trained), and the bundled tool-using policy's tokenizer
(tools/tool_tokenizer.py: the arithmetic policy's ids, a template that renders tools as transformers renders it)."""
import importlib.util
import json

import pytest
from support.paths import ARITH, MODEL_CONFIGS, TUTORIAL_DATA

from mindrlhf.cli import prepare_data
from mindrlhf.data.reader import read_prompt_records
from mindrlhf.data.templates import build_prompt
from mindrlhf.models.tokenizer import HFTokenizer, load_tokenizer
from mindrlhf.tool_use import calculator, function_schema, parse_tool_calls

transformers = pytest.importorskip("transformers")
TOOLS_POLICY = MODEL_CONFIGS / "arith_tools" / "policy"
PROBLEMS = TUTORIAL_DATA / "tool_arithmetic_heldout.jsonl"


def make_stage_data():
    spec = importlib.util.spec_from_file_location("make_stage_data", TUTORIAL_DATA / "make_stage_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tool_policys_tokenizer_reads_as_the_arithmetic_policys_and_renders_tools_as_transformers():
    ours, old = HFTokenizer(TOOLS_POLICY), load_tokenizer(str(ARITH / "policy"))
    reference = transformers.AutoTokenizer.from_pretrained(str(TOOLS_POLICY))
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347 * 826"}}}
    messages = [{"role": "user", "content": "Ana has 347 boxes with 826 stickers in each. How many?"},
                {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "286622"},
                {"role": "assistant", "content": "<answer>286622</answer>"}]
    text = ours.apply_chat_template(messages, tools=[function_schema(calculator)])
    assert text == reference.apply_chat_template(messages, tools=[calculator], tokenize=False,
                                                 add_generation_prompt=True)
    assert ours.encode(text) == old.encode(text) == reference.encode(text, add_special_tokens=False)
    assert ours.supports_tools and (ours.eos_token_id, ours.pad_token_id) == (old.eos_token_id, old.pad_token_id)
    assert "calculator(expression): Evaluates an arithmetic expression" in text
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 826"}}</tool_call>' in text


def test_prompts_offer_the_tools_through_the_chat_template(tmp_path):
    out = tmp_path / "prompts.mindrecord"
    code = prepare_data.main(["--tokenizer_dir", str(TOOLS_POLICY), "--file_path", str(PROBLEMS), "--output_path",
                              str(out), "--template", "chat", "--tools", "calculator", "--max_prompt_length", "176"])
    assert code == 0
    ids, solutions = read_prompt_records(str(out))
    tokenizer = HFTokenizer(TOOLS_POLICY)
    first = json.loads(PROBLEMS.read_text().splitlines()[0])
    expected = tokenizer.apply_chat_template([{"role": "user", "content": first["question"]}],
                                             tools=[function_schema(calculator)])
    assert tokenizer.decode(ids[0].tolist()) == expected and len(solutions) == 200
    with pytest.raises(ValueError, match="prompt template 'qwen_chat' renders no tools"):
        build_prompt("q", "qwen_chat", tokenizer.apply_chat_template, tools=[function_schema(calculator)])
    code = prepare_data.main(["--tokenizer_dir", str(TOOLS_POLICY), "--file_path", str(PROBLEMS), "--output_path",
                              str(tmp_path / "x.mindrecord"), "--template", "chat", "--tools", "abacus"])
    assert code == 2 and not (tmp_path / "x.mindrecord").exists()


def test_tool_demonstrations_call_the_calculator_a_step_and_train_the_models_turns_only(tmp_path):
    from mindspore.mindrecord import FileReader

    demos = tmp_path / "demos.jsonl"
    assert make_stage_data().main(["--kind", "tool_sft", "--input", str(PROBLEMS), "--output", str(demos),
                                   "--direct_fraction", "0.25", "--seed", "3"]) == 0
    records = [json.loads(line) for line in demos.read_text().splitlines()]
    direct = 0
    for record, line in zip(records, PROBLEMS.read_text().splitlines()):
        answer = json.loads(line)["answer"].rpartition("####")[2].strip()
        messages = record["messages"]
        assert messages[-1] == {"role": "assistant", "content": f"<answer>{answer}</answer>"}
        assert record["tools"] == [function_schema(calculator)]
        if len(messages) == 2:
            direct += 1
            continue
        (call,) = parse_tool_calls(messages[1]["content"])
        assert messages[2] == {"role": "tool", "content": calculator(**call.arguments)}
        assert messages[2]["content"] == answer
    assert 0.15 < direct / len(records) < 0.35
    out = tmp_path / "demos.mindrecord"
    assert prepare_data.main(["--kind", "sft", "--tokenizer_dir", str(TOOLS_POLICY), "--file_path", str(demos),
                              "--output_path", str(out)]) == 0
    tokenizer = HFTokenizer(TOOLS_POLICY)
    row = next(FileReader(str(out)).get_next())
    trained = tokenizer.decode(row["input_ids"][row["loss_mask"] == 1].tolist())
    text = tokenizer.decode(row["input_ids"].tolist())
    assert text == tokenizer.apply_chat_template(records[0]["messages"], add_generation_prompt=False,
                                                 tools=records[0]["tools"])
    assert "Tools:\ncalculator(expression)" in text and "<tool_response>" not in trained
    assert trained.endswith("</answer><|im_end|>") and trained.count("<|im_end|>") == len(
        [m for m in records[0]["messages"] if m["role"] == "assistant"])
