"""A JSON schema's omitted ``additionalProperties`` means false, as vLLM's default backend
(xgrammar, strict) reads it, at every depth of the schema; ``--structured-outputs-config``
gives JSON Schema's permissive reading with vLLM's keys. Checked on the compiled grammar
itself: the matcher takes, or refuses, a given text."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import llguidance
import pytest

from hlserve.engine.args import make_config, parse_engine_args
from hlserve.models.tiny_tokenizer import TOKENIZER_VOCAB_SIZE, trained_tokenizer_json
from hlserve.server.tools.constraints import request_constraint
from hlserve.server.tools.parsers import ToolPlan
from hlserve.structured.grammar import GrammarCompiler
from hlserve.structured.params import StructuredOutputsParams
from hlserve.structured.strict import StructuredOutputsConfig, close_objects

TOK = llguidance.LLTokenizer(trained_tokenizer_json(), n_vocab=TOKENIZER_VOCAB_SIZE,
                             eos_token=[1])
STRICT = GrammarCompiler(trained_tokenizer_json(), TOKENIZER_VOCAB_SIZE, [1])
LOOSE = GrammarCompiler(trained_tokenizer_json(), TOKENIZER_VOCAB_SIZE, [1], close_objects=False)
INT = {"type": "integer"}


def takes(g: GrammarCompiler, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether the spec's grammar matches exactly ``text``."""
    m = g.compile(spec)
    tokens = TOK.tokenize_str(text)
    return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()


def obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props)}


# (schema, a text it declares, the same with an undeclared key at the depth under test)
CASES = {
    "top": (obj(a=INT), '{"a":1}', '{"a":1,"c":2}'),
    "empty key": (obj(a=INT), '{"a":1}', '{"a":1,"":-5.7E5}'),
    "nested property": (obj(p=obj(a=INT)), '{"p":{"a":1}}', '{"p":{"a":1,"c":2}}'),
    "array items": ({"type": "array", "items": obj(a=INT)}, '[{"a":1}]', '[{"a":1,"c":2}]'),
    "$defs via $ref": ({"$defs": {"A": obj(a=INT)}, "$ref": "#/$defs/A"}, '{"a":1}',
                       '{"a":1,"c":2}'),
    "anyOf": ({"anyOf": [obj(a=INT), obj(b=INT)]}, '{"b":1}', '{"b":1,"c":2}'),
    "oneOf in a property": (obj(p={"oneOf": [obj(a=INT), {"type": "string"}]}),
                            '{"p":{"a":1}}', '{"p":{"a":1,"c":2}}'),
    "allOf": ({"allOf": [obj(a=INT)]}, '{"a":1}', '{"a":1,"c":2}'),
    "prefixItems": ({"type": "array", "prefixItems": [obj(a=INT)], "items": False},
                    '[{"a":1}]', '[{"a":1,"c":2}]'),
    "additionalProperties' own schema": (
        {"type": "object", "additionalProperties": obj(a=INT)}, '{"k":{"a":1}}',
        '{"k":{"a":1,"c":2}}'),
}


@pytest.mark.parametrize("case", CASES)
def test_undeclared_keys_refused_at_every_depth(case: str) -> None:
    schema, declared, extra = CASES[case]
    spec = StructuredOutputsParams(json=schema)
    assert takes(STRICT, spec, declared)
    assert not takes(STRICT, spec, extra), f"{case}: {extra} taken"
    assert takes(LOOSE, spec, extra)  # JSON Schema's reading (backend guidance) takes it


def test_explicit_additional_properties_kept() -> None:
    open_ = {**obj(a=INT), "additionalProperties": True}
    typed = {**obj(a=INT), "additionalProperties": INT}
    assert takes(STRICT, StructuredOutputsParams(json=open_), '{"a":1,"c":2}')
    assert takes(STRICT, StructuredOutputsParams(json=typed), '{"a":1,"c":2}')
    assert not takes(STRICT, StructuredOutputsParams(json=typed), '{"a":1,"c":"x"}')
    assert close_objects(typed) == typed and close_objects(open_) == open_


def test_json_object_stays_any_object() -> None:
    """JSON mode and a schema declaring no properties are any object, as in vLLM."""
    for spec in (StructuredOutputsParams(json_object=True),
                 StructuredOutputsParams(json={"type": "object"})):
        assert takes(STRICT, spec, '{"x":[1,{"y":null}]}')


def test_per_request_switch_closes_objects_on_a_permissive_server() -> None:
    spec = StructuredOutputsParams(json=obj(a=INT), disable_additional_properties=True)
    assert not takes(LOOSE, spec, '{"a":1,"c":2}')
    assert takes(LOOSE, spec, '{"a":1}')


def test_wire_fields_reach_the_switch() -> None:
    req = SimpleNamespace(structured_outputs={"json": obj(a=INT),
                                              "disable_additional_properties": True})
    spec = request_constraint(req)
    assert spec is not None and spec.disable_additional_properties
    assert not takes(LOOSE, spec, '{"a":1,"c":2}')


def test_required_tool_choice_closes_each_tools_parameters() -> None:
    """tool_choice required wraps the tools' schemas in an array of calls: the parameters of
    each, and what they nest, are closed too."""
    tools = {"add": obj(a=INT, b=INT), "neg": obj(x=obj(v=INT))}
    for mode, name in (("required", None), ("named", "add")):
        spec = ToolPlan(mode=mode, name=name).constraint(tools)
        assert spec is not None
        good = '{"a":1,"b":2}' if mode == "named" else \
            '[{"name":"add","parameters":{"a":1,"b":2}}]'
        bad = '{"a":1,"b":2,"c":3}' if mode == "named" else \
            '[{"name":"add","parameters":{"a":1,"b":2,"c":3}}]'
        assert takes(STRICT, spec, good) and not takes(STRICT, spec, bad)
    spec = ToolPlan(mode="required").constraint(tools)
    assert not takes(STRICT, spec, '[{"name":"neg","parameters":{"x":{"v":1,"w":2}}}]')


def test_the_cache_keeps_the_two_readings_apart() -> None:
    g = GrammarCompiler(trained_tokenizer_json(), TOKENIZER_VOCAB_SIZE, [1], close_objects=False)
    schema = json.dumps(obj(a=INT))
    assert takes(g, StructuredOutputsParams(json=schema), '{"a":1,"c":2}')
    closed = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    assert not takes(g, closed, '{"a":1,"c":2}')


# ---- --structured-outputs-config -------------------------------------------------------


@pytest.mark.parametrize("text, closes", [
    (None, True),
    ('{"backend": "auto"}', True),
    ('{"backend": "guidance"}', False),
    ('{"backend": "guidance", "disable_additional_properties": true}', True),
    ('{"backend": "guidance", "disable_fallback": true, "disable_any_whitespace": false, '
     '"reasoning_parser": ""}', False),
])
def test_config_has_vllms_meaning(text: str | None, closes: bool) -> None:
    argv = [] if text is None else ["--structured-outputs-config", text]
    config = make_config("m", device="cpu", **parse_engine_args(argv))
    assert config.structured_outputs_config.closes_objects is closes
    if text is not None:  # Python keywords take the same JSON text or a dict
        again = make_config("m", device="cpu", structured_outputs_config=json.loads(text))
        assert again.structured_outputs_config == config.structured_outputs_config


@pytest.mark.parametrize("text, words", [
    ('{"backend": "xgrammar"}', "hlserve runs llguidance"),
    ('{"backend": "nope"}', "backend must be one of"),
    ('{"disable_additional_properties": true}', "only supported for the guidance backend"),
    ('{"backend": "guidance", "disable_any_whitespace": true}', "disable_any_whitespace is not"),
    ('{"reasoning_parser": "qwen3"}', "reasoning_parser is not supported"),
    ('{"whatever": 1}', "fields not supported"),
    ('{"backend": "guidance", "disable_additional_properties": "yes"}', "true or false"),
    ("[1]", "must be a JSON object"),
    ("{", "not valid JSON"),
])
def test_config_refuses_what_is_not_implemented(text: str, words: str) -> None:
    with pytest.raises(SystemExit):
        parse_engine_args(["--structured-outputs-config", text])
    with pytest.raises(ValueError, match=words):
        make_config("m", device="cpu", structured_outputs_config=text)


def test_config_type_checked() -> None:
    with pytest.raises(TypeError):
        make_config("m", device="cpu").replace(structured_outputs_config="{}")
    assert StructuredOutputsConfig().closes_objects
