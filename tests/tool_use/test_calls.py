"""Tool calls read from the model's text (Hermes / Qwen2.5 convention, and SmolLM2's list): good, several, malformed."""
from mindrlhf.tool_use import ToolCall, parse_tool_calls


def test_one_call_between_its_tags():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 12"}}\n</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "37 * 12"})]


def test_several_calls_in_order_and_arguments_as_a_json_string():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2, 3]}"}</tool_call>'
            '<tool_call>{"name": "c"}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [2, 3]}), ToolCall("c", {})]


def test_text_without_calls_has_none():
    assert parse_tool_calls("<think>\n3 + 4 = 7\n</think>\n<answer>7</answer>") == []


def test_malformed_calls_are_kept_as_errors_for_the_model():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+"</tool_call>'
            '<tool_call>["calculator"]</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
            '<tool_call>{"name": "calc')
    calls = parse_tool_calls(text)
    assert [c.error for c in calls] == [
        "the tool call is not JSON (Expecting ',' delimiter at character 55)",
        'the tool call is not an object with a "name" string',
        'the "arguments" of calculator are not an object',
        None,
        "the tool call is not closed with </tool_call>",
    ]
    assert calls[3] == ToolCall("calculator", {"expression": "2*3"})


def test_a_list_of_calls_in_one_block_is_smollm2s_form():
    calls = parse_tool_calls('<tool_call>[{"name": "calculator", "arguments": {"expression": "2 * 3"}}, '
                             '{"name": "python", "arguments": {"code": "print(1)"}}, 7]</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls[:2]] == [
        ("calculator", {"expression": "2 * 3"}, None), ("python", {"code": "print(1)"}, None)]
    assert calls[2].error == 'the tool call is not an object with a "name" string'
    (empty,) = parse_tool_calls("<tool_call>[]</tool_call>")
    assert empty.error == 'the tool call is not an object with a "name" string'
