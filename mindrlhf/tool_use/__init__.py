"""Tools a policy calls in the middle of a response (#67): their JSON schemas from type hints and Google-style
docstrings (`schema`), the calls read from the model's text (`calls`), the built-in `calculator` (`calculator`) and
`python` (`python_tool`), the job's tools loaded and their calls run with timeouts (`runner`), their answers as tool
turns (`turns`), shared by a tensor-parallel group (`group`). Framework-free (`group` sums through the
collectives it is given)."""
from mindrlhf.tool_use.calculator import calculator, evaluate_arithmetic
from mindrlhf.tool_use.calls import ToolCall, parse_tool_calls
from mindrlhf.tool_use.group import GroupToolTurns
from mindrlhf.tool_use.runner import Tool, ToolResult, ToolRunner, load_tools
from mindrlhf.tool_use.schema import ToolDefinitionError, function_schema
from mindrlhf.tool_use.turns import ToolTurn, ToolTurns

__all__ = ["GroupToolTurns", "Tool", "ToolCall", "ToolDefinitionError", "ToolResult", "ToolRunner", "ToolTurn",
           "ToolTurns", "calculator", "evaluate_arithmetic", "function_schema", "load_tools", "parse_tool_calls"]
