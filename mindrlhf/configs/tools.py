"""`ToolsConfig`: the tools a policy may call in a multi-turn rollout (#67). How many tool turns a response takes and
how long each may be are generation fields (`max_tool_calling_iterations`, `max_tool_response_tokens`): they fix the
rollout's shapes."""
from __future__ import annotations

import math
from dataclasses import dataclass

from mindrlhf.configs.base import ConfigError, Validated, help_field


@dataclass(frozen=True)
class ToolsConfig(Validated):
    """The tools of a job and the limits of their calls."""

    tools: list[str] = help_field(
        [], "Tools the policy may call (TRL's GRPOTrainer(tools=...)): the built-ins 'calculator' (arithmetic, no "
            "eval) and 'python' (code in a child process with CPU, memory, output and time limits), or "
            "'package.module:function' (type hints and a Google-style docstring give its JSON schema, as "
            "transformers' get_json_schema; sync or async). They reach the prompt through the tokenizer's chat "
            "template (tools=); needs generation.max_tool_calling_iterations > 0. Empty: single-turn responses.")
    tool_timeout: float = help_field(
        10.0, "Seconds the calls of one rollout step's tool turn may take together (they run in parallel); a call "
              "past it answers the model with an error and counts in tool/timeouts.")
    max_tool_result_chars: int = help_field(
        10000, "A tool's answer is cut at this many characters (counted as truncated) before the tool turn is fit "
               "to generation.max_tool_response_tokens.")
    tool_workers: int = help_field(8, "Threads running one step's calls in parallel on a rank.")

    def validate(self) -> None:
        if not isinstance(self.tools, (list, tuple)) or not all(isinstance(t, str) and t for t in self.tools):
            raise ConfigError(f"tools.tools must be a list of tool names or package.module:function paths, got "
                              f"{self.tools!r}")
        if not (isinstance(self.tool_timeout, (int, float)) and math.isfinite(self.tool_timeout)
                and self.tool_timeout > 0):
            raise ConfigError(f"tools.tool_timeout must be a number of seconds > 0, got {self.tool_timeout!r}")
        for name in ("max_tool_result_chars", "tool_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"tools.{name} must be an integer >= 1, got {value!r}")
