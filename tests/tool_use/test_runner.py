"""The job's tools loaded from their specs, and their calls run: good, raising, hanging, non-string, huge, unknown,
malformed; each answered with text and counted, none stopping the caller."""
import asyncio
import sys
import threading
import time
import types

import pytest

from mindrlhf.tool_use import ToolCall, ToolDefinitionError, ToolRunner, calculator, load_tools


def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: The first.
        b: The second.
    """
    return str(a + b)


async def slow_echo(text: str, seconds: float = 0.0) -> str:
    """Echoes text after a pause.

    Args:
        text: What to echo.
        seconds: How long to wait first.
    """
    await asyncio.sleep(seconds)
    return text


RELEASE = threading.Event()


def hang(x: int) -> str:
    """Never answers in time.

    Args:
        x: Anything.
    """
    RELEASE.wait(30)
    return "late"


def broken(x: int) -> str:
    """Raises.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"no luck with {x}")


def number(x: int) -> int:
    """Returns a number, not text.

    Args:
        x: Anything.
    """
    return x


def huge(n: int) -> str:
    """Returns n characters.

    Args:
        n: How many.
    """
    return "x" * n


@pytest.fixture
def user_module(monkeypatch):
    module = types.ModuleType("user_tools")
    for fn in (add, slow_echo, hang, broken, number, huge):
        setattr(module, fn.__name__, fn)
    monkeypatch.setitem(sys.modules, "user_tools", module)
    return module


def test_tools_load_from_specs_and_built_in_names(user_module):
    tools = load_tools(["calculator", "user_tools:add", "user_tools:slow_echo"])
    assert [t.name for t in tools] == ["calculator", "add", "slow_echo"]
    assert tools[0].function is calculator and tools[1].function is add
    assert tools[1].schema["function"]["parameters"]["required"] == ["a", "b"]


def test_bad_tool_specs_are_refused_in_one_line(user_module):
    cases = {"abacus": "tools: 'abacus' is no built-in tool (calculator, python) and not of the form "
                       "package.module:function",
             "no_such_module_xyz:f": "tools: no_such_module_xyz:f: module 'no_such_module_xyz' does not import: "
                                     "ModuleNotFoundError",
             "user_tools:missing": "tools: user_tools:missing: user_tools has no function 'missing'"}
    for spec, message in cases.items():
        with pytest.raises(ToolDefinitionError) as err:
            load_tools([spec])
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
    with pytest.raises(ToolDefinitionError, match="two tools are named 'add'"):
        load_tools(["user_tools:add", "user_tools:add"])


def test_each_call_is_answered_with_text_and_counted(user_module):
    runner = ToolRunner(load_tools(["calculator", "user_tools:add", "user_tools:slow_echo", "user_tools:broken",
                                    "user_tools:number", "user_tools:huge"]), timeout=5, max_chars=100)
    calls = [ToolCall("calculator", {"expression": "1234 * 5678"}), ToolCall("add", {"a": 2, "b": 3}),
             ToolCall("slow_echo", {"text": "hi", "seconds": 0.01}), ToolCall("broken", {"x": 7}),
             ToolCall("number", {"x": 7}), ToolCall("huge", {"n": 1000}), ToolCall("add", {"a": 1}),
             ToolCall("abacus", {}), ToolCall("", {}, "the tool call is not JSON (x)")]
    results = runner.run(calls)
    assert [r.text for r in results[:3]] == ["7006652", "5", "hi"]
    assert results[3].text == "error: broken raised RuntimeError: no luck with 7"
    assert results[4].text == "error: number returned int, not text"
    assert results[5].text == "x" * 100 + "\n... (cut at 100 characters)" and results[5].status == "truncated"
    assert results[6].text.startswith("error: add raised TypeError: ")
    assert results[7].text == ("error: no tool is named 'abacus' (the tools: add, broken, calculator, huge, number, "
                               "slow_echo)")
    assert results[8].text == "error: the tool call is not JSON (x)"
    assert dict(runner.counts) == {"ok": 3, "error": 5, "truncated": 1}
    runner.close()


def test_calls_that_hang_time_out_together_and_the_runner_goes_on(user_module):
    runner = ToolRunner(load_tools(["user_tools:hang", "user_tools:add"]), timeout=0.5)
    started = time.monotonic()
    results = runner.run([ToolCall("hang", {"x": 1}), ToolCall("hang", {"x": 2}), ToolCall("add", {"a": 1, "b": 1})])
    elapsed = time.monotonic() - started
    assert [r.status for r in results] == ["timeout", "timeout", "ok"]
    assert results[0].text == "error: hang did not answer within 0.5 s" and results[2].text == "2"
    assert elapsed < 0.9  # one timeout for the turn's calls, not one after the other
    assert runner.run([ToolCall("add", {"a": 2, "b": 2})])[0].text == "4"
    assert dict(runner.counts) == {"timeout": 2, "ok": 2}
    RELEASE.set()
    runner.close()
