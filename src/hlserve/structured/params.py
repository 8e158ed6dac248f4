"""What a request constrains its output to: vLLM's ``StructuredOutputsParams``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hlserve.errors import InvalidRequestError

# llguidance's Earley rows hold at most 2,000 items and a choice of k strings opens a row of
# k + 1, so a longer choice can never match: refused before a compile of up to seconds
MAX_CHOICES = 1999
# a GBNF grammar is converted to Lark by llguidance's pure-Python converter, whose time grows
# with the square of its rules (a chain of 1,000: 1.5 s; 5,000: 40 s; 20,000: over 5 min of
# a compile thread); grammars written by hand or generated from a schema have tens to hundreds
MAX_GBNF_RULES = 1000
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar: compiled per distinct text, so bounded


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint, named as in vLLM: ``json`` (a JSON schema, as a dict or its
    text), ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (Lark or
    GBNF/EBNF) or ``json_object`` (any JSON object).

    ``disable_any_whitespace`` (vLLM's name) defaults to True here, unlike vLLM: free
    whitespace in JSON lets a model whose weights favour it emit spaces until ``max_tokens``
    and never finish. The output is still JSON, only compact.

    ``disable_additional_properties`` (vLLM's name): True closes this request's objects
    (an omitted ``additionalProperties`` means false) whatever the server's reading; False,
    the default, leaves the server's (``--structured-outputs-config``; closed by default,
    as vLLM's default backend)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            if isinstance(self.choice, str) or not hasattr(self.choice, "__iter__"):
                raise InvalidRequestError("structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    def validate(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {set_ or 'none'}")
        if self.choice is not None and (
                not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(
                "structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise InvalidRequestError(
                f"invalid choice for structured output: {len(self.choice)} strings; at most "
                f"{MAX_CHOICES} (the grammar engine's Earley rows hold 2,000 items)")
        if isinstance(self.grammar, str) and self.grammar.count("::=") > MAX_GBNF_RULES:
            raise InvalidRequestError(
                f"invalid grammar for structured output: a GBNF grammar of "
                f"{self.grammar.count('::=')} rules; at most {MAX_GBNF_RULES} (its conversion "
                "takes time quadratic in its rules; a Lark grammar has no such limit)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string")
        if not isinstance(self.disable_additional_properties, bool):
            raise InvalidRequestError("structured_outputs.disable_additional_properties must be "
                                      "true or false")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError("structured_outputs.json must be a JSON schema (an object "
                                      "or its text)")
        if len(self.key()[1]) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"the structured output spec is over {MAX_SPEC_CHARS} "
                                      "characters")

    def key(self) -> tuple[str, str, bool, bool]:
        """(kind, text, compact, closed): what the compiled grammar is cached under."""
        kind, text = self._spec()
        return kind, text, self.disable_any_whitespace, self.disable_additional_properties

    def _spec(self) -> tuple[str, str]:
        if self.json is not None:
            # not sort_keys: the schema's property order is the output's order
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json", '{"type": "object"}'
