"""Structured outputs: constrained decoding with a grammar engine (llguidance), so that a
request's output matches a JSON schema, a regex, a list of choices or a grammar."""

from hlserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
