"""JSON schemas read as vLLM's default backend reads them: an object schema that declares
``properties`` (or ``patternProperties``) and says nothing of ``additionalProperties`` allows
no other keys. JSON Schema itself allows any other key there, and so does llguidance (it has
no switch for this), so a random or weak model writes ``{"a": 1, "": -5.7E5}`` for
``add(a)``. vLLM's default, xgrammar in strict mode, closes such objects; its ``guidance``
backend does so under ``disable_additional_properties``, by the same rewrite as here.

Also :class:`StructuredOutputsConfig`, vLLM's ``--structured-outputs-config``: which reading
the server gives (``backend`` ``auto`` closes objects, as vLLM's default; ``guidance`` is
JSON Schema's permissive reading unless ``disable_additional_properties`` is set)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hlserve.errors import InvalidRequestError

# keywords whose value maps names to subschemas, and those whose value is a subschema or a
# list of them: every place a nested object schema can sit
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains",
               "items", "prefixItems", "additionalItems", "unevaluatedItems", "not", "if",
               "then", "else", "allOf", "anyOf", "oneOf", "contentSchema")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` with ``"additionalProperties": false`` added to every object
    schema, at any depth, that declares properties and leaves ``additionalProperties`` out.
    An explicit ``additionalProperties`` (true, false or a schema) is kept as given; a schema
    with no declared properties (``{"type": "object"}``, JSON mode) stays any object."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = close_objects(out[key])
    declares = isinstance(out.get("properties"), dict) or isinstance(
        out.get("patternProperties"), dict)
    if declares and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def closed_schema_text(text: str) -> str:
    """The schema text with its objects closed (:func:`close_objects`); JSON errors raise
    :class:`json.JSONDecodeError` for the caller to report."""
    return json.dumps(close_objects(json.loads(text)))


BACKENDS = ("auto", "guidance")  # what hlserve runs: llguidance, vLLM's "guidance"
_VLLM_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")
# vLLM's keys hlserve does not implement, taken only at vLLM's defaults (a config copied
# from a vLLM deployment that leaves them there starts; one that sets them is refused)
_DEFAULT_ONLY = {"disable_any_whitespace": False, "reasoning_parser": "",
                 "reasoning_parser_plugin": "", "enable_in_reasoning": False}
_WHY_NOT = {
    "disable_any_whitespace": "JSON is generated compact by default here; per request, "
                              "structured_outputs.disable_any_whitespace",
    "reasoning_parser": "use --reasoning-parser",
    "reasoning_parser_plugin": "use --reasoning-parser",
    "enable_in_reasoning": "a grammar here starts after the reasoning",
}


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's ``StructuredOutputsConfig`` keys that hlserve implements, with vLLM's meaning:
    ``backend`` ``auto`` (the default) reads schemas as vLLM's default backend (xgrammar,
    strict) does, objects closed; ``guidance`` as vLLM's llguidance backend does, JSON
    Schema's permissive reading, unless ``disable_additional_properties`` is true (which
    vLLM takes for ``guidance`` only). ``disable_fallback``: there is one backend, never a
    fallback, so either value holds."""

    backend: str = "auto"
    disable_additional_properties: bool = False
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        if self.backend in _VLLM_BACKENDS:
            raise InvalidRequestError(
                f"backend {self.backend!r} is not available: hlserve runs llguidance, vLLM's "
                f"'guidance' backend; backend must be one of {BACKENDS}")
        if self.backend not in BACKENDS:
            raise InvalidRequestError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be true or false")
        if self.disable_additional_properties and self.backend != "guidance":
            raise InvalidRequestError(  # vLLM's own check, with why it changes nothing here
                "disable_additional_properties is only supported for the guidance backend "
                "(as in vLLM); backend 'auto' already closes objects that omit "
                "additionalProperties")

    @property
    def closes_objects(self) -> bool:
        """Whether a schema's omitted ``additionalProperties`` means false."""
        return self.backend == "auto" or self.disable_additional_properties

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any]) -> StructuredOutputsConfig:
        """From the flag's JSON text or a dict; a key hlserve does not implement is refused
        unless it is at vLLM's default, and one vLLM does not have is refused."""
        data = json.loads(spec) if isinstance(spec, str) else dict(spec)
        if not isinstance(data, dict):
            raise InvalidRequestError("structured outputs config must be a JSON object")
        for key, default in _DEFAULT_ONLY.items():
            if key in data and data.pop(key) != default:
                raise InvalidRequestError(f"{key} is not supported by hlserve ({_WHY_NOT[key]})")
        unknown = sorted(set(data) - {"backend", "disable_additional_properties",
                                      "disable_fallback"})
        if unknown:
            raise InvalidRequestError(f"structured outputs config fields not supported: "
                                      f"{unknown}")
        return cls(**data)
