"""Structured output (docs/behaviour.md#structured-output): the reply's GenerateStructuredOutput tool,
whose input, valid against the required schema, is the reply's output."""

from __future__ import annotations

import copy
from typing import Any

from agentmw.data import ToolDescriptor
from agentmw.data.state import AgentState
from agentmw.tools import Tool

STRUCTURED_OUTPUT_TOOL = "GenerateStructuredOutput"
STRUCTURED_OUTPUT_GRACE_ITERS = 5  # extra rounds a reply owing a structured output may take
STRUCTURED_OUTPUT_SOURCE = '{"label": "System", "sublabel": "Structured Output Requirement"}'
STRUCTURED_OUTPUT_DESCRIPTION = (
    "Generate the required structured output by this tool. Its input schema is the required output. "
    "You MUST end your response by calling it, once you have what you need; its input is sent to the user."
)


class StructuredOutputTool(Tool):
    """The reply's GenerateStructuredOutput tool: its input, valid against the schema, is the output."""

    def __init__(self, schema: dict, state: AgentState) -> None:
        super().__init__(
            ToolDescriptor(name=STRUCTURED_OUTPUT_TOOL, description=STRUCTURED_OUTPUT_DESCRIPTION, input_schema=schema)
        )
        self.state = state

    async def call(self, tool_input: dict[str, Any], state: Any = None) -> str:
        self.state.reply_context.structured_output = copy.deepcopy(tool_input)
        self.state.version += 1
        return "The structured output is generated."
