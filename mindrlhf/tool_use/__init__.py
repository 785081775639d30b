"""Tools a policy calls in the middle of a response (#67): their JSON schemas from type hints and Google-style
docstrings (`schema`), the calls read from the model's text (`calls`) and the built-in `calculator`
(`calculator`). Framework-free."""
from mindrlhf.tool_use.calculator import calculator, evaluate_arithmetic
from mindrlhf.tool_use.calls import ToolCall, parse_tool_calls
from mindrlhf.tool_use.schema import ToolDefinitionError, function_schema

__all__ = ["ToolCall", "ToolDefinitionError", "calculator", "evaluate_arithmetic", "function_schema",
           "parse_tool_calls"]
