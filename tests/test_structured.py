"""Structured outputs in the engine: constrained decoding through the offline API on the
random-weight tiny model, under greedy and seeded sampling, retraction and bad specs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from hlserve.errors import InvalidRequestError
from hlserve.llm import LLM
from hlserve.request import SamplingParams
from hlserve.structured import StructuredOutputsParams
from structured_schemas import SCHEMAS

MAX_TOKENS = 96


@pytest.fixture(scope="module")
def llm(tiny_model_dirs) -> LLM:
    return LLM(str(tiny_model_dirs["qwen2"]), dtype="float32", check_invariants=True)


def params(spec: StructuredOutputsParams, temperature: float = 0.0, seed: int | None = None,
           max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=spec)


def test_every_schema_validates_greedy_and_sampled(llm: LLM) -> None:
    names = list(SCHEMAS)
    prompts, plist = [], []
    for i, name in enumerate(names):
        spec = StructuredOutputsParams(json=SCHEMAS[name])
        prompts += [f"Request {i}: {name}", f"JSON for {name}"]
        plist += [params(spec), params(spec, temperature=1.0, seed=i)]
    outs = llm.generate(prompts, plist, use_tqdm=False)
    for j, out in enumerate(outs):
        name = names[j // 2]
        assert out.finish_reason == "stop", (name, out.text)  # the grammar ended it
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    assert llm.engine.kv.num_used == 0


def test_unconstrained_output_does_not_validate(llm: LLM) -> None:
    """The same prompts without a grammar: the random model does not write the JSON itself
    (so the test above fails without the mask)."""
    out = llm.generate(["Request 0: one-string"], SamplingParams(max_tokens=32, temperature=0),
                       use_tqdm=False)[0]
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(out.text), SCHEMAS["one-string"])


def test_regex_choice_grammar_json_object(llm: LLM) -> None:
    specs = {
        "regex": StructuredOutputsParams(regex=r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"),
        "choice": StructuredOutputsParams(choice=["alpha", "beta gamma", "δ"]),
        "grammar": StructuredOutputsParams(grammar='start: "x" ("," "y"){0,3}'),
        "json_object": StructuredOutputsParams(json_object=True),
    }
    outs = llm.generate(["a"] * 8, [params(s, t, seed=3) for s in specs.values()
                                    for t in (0.0, 1.0)], use_tqdm=False)
    by = dict(zip([k for k in specs for _ in (0, 1)], outs, strict=False))
    for o in outs[0:2]:
        assert re.fullmatch(r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)", o.text), o.text
    for o in outs[2:4]:
        assert o.text in ("alpha", "beta gamma", "δ")
    for o in outs[4:6]:
        assert re.fullmatch(r"x(,y){0,3}", o.text), o.text
    for o in outs[6:8]:  # unbounded: "stop" means complete; "length" may be cut (as vLLM)
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.text.startswith("{")
    assert by["choice"].finish_reason == "stop"


def test_retracted_requests_resume_their_grammar(tiny_model_dirs) -> None:
    """A pool too small for every request: retracted ones recompute their prompt and
    output, and their grammar continues from the tokens they kept."""
    llm = LLM(str(tiny_model_dirs["qwen2"]), dtype="float32", num_pages=12, page_size=16,
              chunk_size=64, check_invariants=True)
    schema = SCHEMAS["array-of-objects"]
    spec = StructuredOutputsParams(json=schema)
    prompts = [" ".join(["word"] * (30 + 7 * i)) for i in range(8)]
    outs = llm.generate(prompts, [params(spec, 1.0, seed=i, max_tokens=60) for i in range(8)],
                        use_tqdm=False)
    assert llm.engine.scheduler.num_retractions > 0, "the pool was meant to force retraction"
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)


def test_rebuilt_matcher_matches_the_output(llm: LLM) -> None:
    """A matcher that fell behind the output (tokens appended without it) is rebuilt from
    the output before the next mask, so the next token still follows the grammar."""
    spec = StructuredOutputsParams(json=SCHEMAS["nested"])
    state = llm.engine.grammars.state(spec)
    ids = llm.engine.tokenizer.encode('{"user":{"id":', add_special_tokens=False)
    state.sync(ids)
    assert state.accepted == len(ids) and not state.matcher.is_error()
    state.sync(ids[:2])  # taken back: replayed from scratch
    assert state.accepted == 2 and not state.matcher.is_error()


@pytest.mark.parametrize("spec, words", [
    (lambda: StructuredOutputsParams(json={"type": "nonsense"}), "invalid json"),
    (lambda: StructuredOutputsParams(json="{not json"), "invalid json"),
    (lambda: StructuredOutputsParams(regex="(["), "invalid regex"),
    (lambda: StructuredOutputsParams(grammar="start: ???"), "invalid grammar"),
    (lambda: StructuredOutputsParams(), "exactly one"),
    (lambda: StructuredOutputsParams(regex="a", choice=["b"]), "exactly one"),
    (lambda: StructuredOutputsParams(choice=[]), "non-empty"),
])
def test_bad_specs_are_refused(llm: LLM, spec, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        llm.generate(["x"], params(spec()), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_compiled_grammars_are_cached(llm: LLM) -> None:
    g = llm.engine.grammars
    schema = {"enum": ["only-in-this-test"]}
    before = g.cached
    a, b = (g.state(StructuredOutputsParams(json=schema)),
            g.state(StructuredOutputsParams(json=dict(schema))))
    assert g.cached == before + 1  # one compile for equal schema text
    assert a.matcher is not b.matcher  # each request its own matcher state
