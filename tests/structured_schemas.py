"""JSON schemas for the structured-output tests: nested objects, arrays, enums, numbers and
strings with patterns. Every one bounds its output (maxLength, maxItems, enums, integer
ranges), so that a random-weight model finishes within the tests' max_tokens whatever it
prefers: an unbounded string could run to max_tokens and end incomplete ("length")."""

from __future__ import annotations

from typing import Any


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


S = {"type": "string", "maxLength": 6}
INT = {"type": "integer", "minimum": -50, "maximum": 50}

SCHEMAS: dict[str, dict[str, Any]] = {
    "one-string": obj({"name": S}),
    "one-int": obj({"count": INT}),
    "bool": obj({"ok": {"type": "boolean"}}),
    "null": obj({"nothing": {"type": "null"}}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "const": obj({"kind": {"const": "event"}, "id": INT}),
    # a number's digits are unbounded unless multipleOf fixes its precision
    "number": obj({"x": {"type": "number", "minimum": 0, "maximum": 4, "multipleOf": 0.25}}),
    "pattern-date": obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    "pattern-code": obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}),
    "string-bounds": obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}),
    "int-array": obj({"xs": {"type": "array", "items": INT, "maxItems": 4}}),
    "enum-array": obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                "minItems": 1, "maxItems": 3}}),
    "nested": obj({"user": obj({"id": INT, "name": S}), "active": {"type": "boolean"}}),
    "deep": obj({"a": obj({"b": obj({"c": obj({"d": INT})})})}),
    "array-of-objects": obj({"items": {"type": "array", "maxItems": 2,
                                       "items": obj({"k": {"enum": ["p", "q"]}, "v": INT})}}),
    "optional": obj({"req": INT, "opt": S}, required=["req"]),
    "any-of": obj({"v": {"anyOf": [INT, {"enum": ["none"]}]}}),
    "nullable": obj({"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    "tuple": obj({"pair": {"type": "array", "prefixItems": [INT, {"enum": ["u", "v"]}],
                           "items": False, "minItems": 2}}),
    "mixed": obj({"id": {"type": "string", "pattern": "^id-[0-9]{2}$"},
                  "score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.5},
                  "labels": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
                  "meta": obj({"ok": {"type": "boolean"}})}),
    "ref": {"$defs": {"pt": obj({"x": INT, "y": INT})},
            **obj({"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}})},
    "top-level-array": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1,
                        "maxItems": 3},
    "top-level-enum": {"enum": ["yes", "no", "maybe"]},
}

# tool definitions for tool_choice required / named: their parameters are schemas above
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": obj({"city": S, "unit": {
                                          "enum": ["c", "f"]}})}},
    {"type": "function", "function": {"name": "add", "description": "Add integers",
                                      "parameters": obj({"a": INT, "b": INT})}},
    {"type": "function", "function": {"name": "tag", "parameters": SCHEMAS["enum-array"]}},
    {"type": "function", "function": {"name": "move", "parameters": SCHEMAS["ref"]}},
]
