"""Tool calls, reasoning and output constraints, per request: the model's tool-call text
parsed into OpenAI ``tool_calls`` (``parsers``, with the formats of ``formats`` and the
streamed deltas of ``streamed_calls``), reasoning split from the answer (``reasoning``), a
request's output constraint from its wire fields (``constraints``), and what agents send
checked at the API edge (``agent_checks``)."""

from hlserve.server.tools.constraints import request_constraint
from hlserve.server.tools.parsers import PARSERS, ToolPlan, ToolStream, tool_plan
from hlserve.server.tools.reasoning import REASONING_PARSERS, ReasoningParser, reasoning_for

__all__ = ["PARSERS", "REASONING_PARSERS", "ReasoningParser", "ToolPlan", "ToolStream",
           "reasoning_for", "request_constraint", "tool_plan"]
