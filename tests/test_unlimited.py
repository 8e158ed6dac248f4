"""An explicit "unlimited" C and B on top of a preset, the same on the command line
(``hlserve serve``, ``hlserve sweep --engine-args``) and in Python (``LLM(...)``): the config
says no cap, and a real engine prefills a prompt longer than the preset's budget in one step."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from hlserve.cli import build_parser
from hlserve.cli import main as cli_main
from hlserve.config import UNLIMITED, EngineConfig
from hlserve.engine.args import engine_options, make_config
from hlserve.engine.presets import DeviceInfo
from hlserve.llm import LLM
from hlserve.request import SamplingParams

CPU = DeviceInfo("cpu")  # vllm's budget on a CPU (and on GPUs below Hopper): 2048
UNCAPPED = "--preset vllm --chunk-size none --token-budget none"
LONG = 2500  # prompt tokens: more than the preset's budget, so it would be chunked


def serve_config(model: str, flags: str) -> EngineConfig:
    """What ``hlserve serve MODEL FLAGS`` would build its engine from."""
    args = build_parser().parse_args(["serve", model, *shlex.split(flags)])
    return make_config(model, device_info=CPU, **engine_options(args))


def first_step_prefills_whole_prompt(llm: LLM) -> bool:
    """One engine step on a long prompt: did it finish the prefill (a first token came)?"""
    engine = llm.engine
    req = engine.add_request(list(range(3, 3 + LONG)),
                             SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()
    done = len(req.output_token_ids) == 1 and req.num_computed >= LONG
    while engine.has_unfinished():
        engine.step()
    return done


def test_serve_flags_unlimited_over_a_preset() -> None:
    plain = serve_config("m", "--preset vllm")
    assert plain.chunk_size is None and plain.token_budget == 2048  # the preset's cap
    c = serve_config("m", UNCAPPED)
    assert c.chunk_size is None and c.token_budget is None
    assert (c.preset, c.mixing, c.retraction) == ("vllm", "always", "lifo")  # rest of the preset
    s = serve_config("m", "--preset sarathi --chunk-size none")
    assert s.chunk_size is None and s.token_budget == 512  # one knob lifted, the other kept
    for word in ("unlimited", "inf", "off", "NONE"):
        assert serve_config("m", f"--preset sarathi --token-budget {word}").token_budget is None
    with pytest.raises(SystemExit):
        serve_config("m", "--chunk-size lots")


@pytest.mark.parametrize("unlimited", [UNLIMITED, None])
def test_llm_unlimited_over_a_preset_prefills_in_one_step(tiny_llama: Path, unlimited) -> None:
    capped = LLM(str(tiny_llama), preset="vllm", device="cpu", num_pages=256)
    assert capped.engine.config.token_budget == 2048
    assert not first_step_prefills_whole_prompt(capped)  # chunked by the preset's budget
    llm = LLM(str(tiny_llama), preset="vllm", device="cpu", num_pages=256,
              chunk_size=unlimited, token_budget=unlimited)
    assert llm.engine.config.chunk_size is None and llm.engine.config.token_budget is None
    assert llm.engine.config.mixing == "always"
    assert first_step_prefills_whole_prompt(llm)


def test_sweep_engine_args_unlimited_over_a_preset(tiny_llama: Path, tmp_path: Path) -> None:
    # no grid points: one point with its own (harmless) flag, so the base --engine-args decide
    # C and B; a grid point would set its own
    rc = cli_main(["sweep", "--model", str(tiny_llama), "--chunk-sizes", "",
                   "--add-point", "uncapped=--seed 0",
                   "--engine-args", f"{UNCAPPED} --device cpu --num-pages 256",
                   "--sessions", "1", "--rounds", "1", "--system-prompt-len", str(LONG),
                   "--task-len", "8", "--tool-output-len", "8:8", "--output-len", "2:2",
                   "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    res = json.loads((tmp_path / "sweep.json").read_text())["points"][0]["metrics"]
    cfg = res["engine_config"]
    assert cfg["chunk_size"] is None and cfg["token_budget"] is None and cfg["preset"] == "vllm"
    assert res["engine_options"]["chunk_size"] is None  # recorded as null, not a Python object
    llm = LLM(str(tiny_llama), **{k: v for k, v in cfg.items() if k != "model"})
    assert first_step_prefills_whole_prompt(llm)


@pytest.mark.parametrize("raw,want", [(None, None), ("none", None), ("Unlimited", None),
                                      (" inf ", None), ("off", None), ("512", 512), (64, 64)])
def test_parse_cap_reads_every_spelling_of_no_cap(raw, want):
    from hlserve.config import parse_cap
    assert parse_cap(raw) == want


@pytest.mark.parametrize("raw", ["0", 0, -3, "abc", "", True, "1.5"])
def test_parse_cap_refuses_what_is_not_a_size(raw):
    from hlserve.config import parse_cap
    with pytest.raises(ValueError, match="positive integer"):
        parse_cap(raw)
