"""Loading the job's tools (`module:function` or a built-in name) and running a turn's calls: in parallel, each
within a timeout; a tool that raises, hangs, returns a non-string or too much text answers the model with an error
or truncated text, is counted, and never stops the job."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import importlib
import inspect
import time
from collections.abc import Callable, Sequence

from mindrlhf.tool_use.calculator import calculator
from mindrlhf.tool_use.calls import ToolCall, cut_answer
from mindrlhf.tool_use.python_tool import python
from mindrlhf.tool_use.schema import ToolDefinitionError, function_schema

BUILT_IN = {"calculator": calculator, "python": python}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable the model may call, by `name`, described to it by `schema` (the chat template's `tools=` entry)."""
    name: str
    function: Callable
    schema: dict


def load_tools(specs: Sequence[str]) -> list[Tool]:
    """The tools of `specs` (`package.module:function`, or a built-in: `calculator`, `python`); ToolDefinitionError
    naming the spec for one that does not import, cannot be described, or repeats a name."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        function = _resolve(spec)
        try:
            schema = function_schema(function)
        except ToolDefinitionError as err:
            raise ToolDefinitionError(f"tools: {spec}: {err}") from None
        name = schema["function"]["name"]
        if name in tools:
            raise ToolDefinitionError(f"tools: two tools are named {name!r} ({spec} and an earlier one)")
        tools[name] = Tool(name, function, schema)
    return list(tools.values())


def _resolve(spec: str) -> Callable:
    if ":" not in spec:
        if spec not in BUILT_IN:
            raise ToolDefinitionError(f"tools: {spec!r} is no built-in tool ({', '.join(sorted(BUILT_IN))}) and not "
                                      "of the form package.module:function")
        return BUILT_IN[spec]
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a user's module may fail in any way while it imports
        raise ToolDefinitionError(f"tools: {spec}: module {module_name!r} does not import: "
                                  f"{type(err).__name__}: {err}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ToolDefinitionError(f"tools: {spec}: {module_name} has no function {attribute!r}")
    return function


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What goes back to the model for one call, and how the call went: ok, error (malformed call, unknown tool, it
    raised or returned a non-string), timeout or truncated."""
    text: str
    status: str


class ToolRunner:
    """Runs calls of the job's `tools`, `timeout` seconds each, results cut at `max_chars`; `counts` adds up the
    statuses of every call run (for the step's `tool/*` metrics)."""

    def __init__(self, tools: Sequence[Tool], timeout: float = 10.0, max_chars: int = 10000, workers: int = 8):
        self.tools = {tool.name: tool for tool in tools}
        self.timeout, self.max_chars = timeout, max_chars
        self.counts: collections.Counter = collections.Counter()
        # a call that hangs keeps its thread: the pool outlives it instead of the job waiting on it
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool")

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """The results of `calls`, in their order; the calls run in parallel, all within one `timeout`."""
        refusals = [self._refusal(call) for call in calls]
        futures = [None if refusal else self._pool.submit(self._invoke, call) for call, refusal in zip(calls, refusals)]
        deadline = time.monotonic() + self.timeout
        results = []
        for call, refusal, future in zip(calls, refusals, futures):
            if future is None:
                result = ToolResult(refusal, "error")
            else:
                try:
                    result = future.result(timeout=max(0.0, deadline - time.monotonic()))
                except concurrent.futures.TimeoutError:
                    result = ToolResult(f"error: {call.name} did not answer within {self.timeout:g} s", "timeout")
            self.counts[result.status] += 1
            results.append(result)
        return results

    def _refusal(self, call: ToolCall) -> str | None:
        if call.error is not None:
            return f"error: {call.error}"
        if call.name not in self.tools:
            return f"error: no tool is named {call.name!r} (the tools: {', '.join(sorted(self.tools))})"
        return None

    def _invoke(self, call: ToolCall) -> ToolResult:
        function = self.tools[call.name].function
        try:
            value = function(**call.arguments)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
        except Exception as err:  # the tool's own failure is the model's answer
            return ToolResult(f"error: {call.name} raised {type(err).__name__}: {err}", "error")
        if not isinstance(value, str):
            return ToolResult(f"error: {call.name} returned {type(value).__name__}, not text", "error")
        cut = cut_answer(value, self.max_chars)
        return ToolResult(value, "ok") if cut is None else ToolResult(cut, "truncated")

    def close(self) -> None:
        """Stops taking calls; threads of calls that hang are left to end on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)


async def _awaited(awaitable):
    return await awaitable
