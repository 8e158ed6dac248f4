"""A request's output constraint from its wire fields: ``response_format``, vLLM's
``structured_outputs`` and the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` extras, as one :class:`StructuredOutputsParams` (or none)."""

from __future__ import annotations

from typing import Any

from hlserve.errors import InvalidRequestError
from hlserve.server.protocol import ApiError
from hlserve.structured import StructuredOutputsParams

GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
          ("guided_grammar", "grammar"))
STRUCTURED_KEYS = frozenset({"json", "regex", "choice", "grammar", "json_object",
                             "disable_any_whitespace", "disable_additional_properties"})
# vLLM's keys that change nothing here when left at their defaults
NEUTRAL_KEYS = {"disable_fallback": False, "whitespace_pattern": None, "structural_tag": None}


def _spec(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (InvalidRequestError, TypeError) as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None


def _structured_outputs(value: dict[str, Any]) -> StructuredOutputsParams:
    for key, neutral in NEUTRAL_KEYS.items():
        if value.get(key, neutral) != neutral:
            raise ApiError(400, f"structured_outputs.{key} is not supported by this server",
                           param=f"structured_outputs.{key}", code="unsupported_parameter")
    unknown = set(value) - STRUCTURED_KEYS - NEUTRAL_KEYS.keys()
    if unknown:
        raise ApiError(400, f"Unrecognized structured_outputs field(s): {sorted(unknown)}",
                       param="structured_outputs", code="unknown_parameter")
    return _spec("structured_outputs", **{k: v for k, v in value.items() if k in STRUCTURED_KEYS})


def _response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("response_format", json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs json_schema.schema, a JSON "
                           "schema object", param="response_format.json_schema",
                           code="invalid_value")
        return _spec("response_format", json=schema)
    raise ApiError(400, f"response_format type must be text, json_object or json_schema; got "
                   f"{kind!r}", param="response_format", code="invalid_value")


def request_constraint(req: Any) -> StructuredOutputsParams | None:
    """The one constraint a request asks for; 400 if it asks for several or a bad one."""
    named = named_constraint(req)
    return named[1] if named else None


def named_constraint(req: Any) -> tuple[str, StructuredOutputsParams] | None:
    """The one constraint a request asks for with the field it came in (what a compile
    error names as its param); 400 if it asks for several or a bad one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if (so := getattr(req, "structured_outputs", None)) is not None:
        found.append(("structured_outputs", _structured_outputs(so)))
    for name, key in GUIDED:
        if (value := getattr(req, name, None)) is not None:
            found.append((name, _spec(name, **{key: value})))
    if (rf := getattr(req, "response_format", None)) and (spec := _response_format(rf)):
        found.append(("response_format", spec))
    if len(found) > 1:
        raise ApiError(400, f"only one output constraint may be given; got "
                       f"{', '.join(n for n, _ in found)}", param=found[1][0],
                       code="invalid_value")
    return found[0] if found else None
