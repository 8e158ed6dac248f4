"""No cap is None inside and one parser outside (``config.parse_cap``): an explicit "no cap"
C and B on top of a preset, the same on the command line (``hlserve serve``, ``hlserve sweep
--engine-args``, ``--chunk-sizes``) and in Python (``LLM(..., chunk_size=None)``): the config
says no cap, and a real engine prefills a prompt longer than the preset's budget in one step;
and the one config the command line builds is the one the engine runs on."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from hlserve.bench.sweep import parse_sizes
from hlserve.cli import main as cli_main
from hlserve.cli.commands import build_parser
from hlserve.config import EngineConfig, parse_cap
from hlserve.engine import factory
from hlserve.engine.args import engine_options, make_config
from hlserve.engine.presets import DeviceInfo
from hlserve.llm import LLM
from hlserve.request import SamplingParams

CPU = DeviceInfo("cpu")  # vllm's budget on a CPU (and on GPUs below Hopper): 2048
UNCAPPED = "--preset vllm --chunk-size none --token-budget none"
LONG = 2500  # prompt tokens: more than the preset's budget, so it would be chunked


def serve_options(model: str, flags: str) -> dict:
    """The engine options ``hlserve serve MODEL FLAGS`` takes from its flags."""
    return engine_options(build_parser().parse_args(["serve", model, *shlex.split(flags)]))


def serve_config(model: str, flags: str) -> EngineConfig:
    """What ``hlserve serve MODEL FLAGS`` would build its engine from."""
    return make_config(model, device_info=CPU, **serve_options(model, flags))


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


def test_only_the_flags_given_are_options_and_none_is_none() -> None:
    assert serve_options("m", "") == {}  # a flag not given is absent, not None
    assert serve_options("m", "--chunk-size none --seed 3") == {"chunk_size": None, "seed": 3}
    # every cap reads "none", not only C and B
    opts = serve_options("m", "--interactive-chunk-size off --max-prefill-tokens inf "
                              "--prefill-delay none --lpm-fcfs-fallback unlimited")
    assert opts == dict.fromkeys(["interactive_chunk_size", "max_prefill_tokens",
                                  "prefill_delay", "lpm_fcfs_fallback"])
    assert serve_config("m", "--interactive-chunk-size none").interactive_chunk_size is None
    assert serve_config("m", "").interactive_chunk_size == 512  # the default stays


def test_llm_unlimited_over_a_preset_prefills_in_one_step(tiny_llama: Path) -> None:
    capped = LLM(str(tiny_llama), preset="vllm", device="cpu", num_pages=256)
    assert capped.engine.config.token_budget == 2048
    assert not first_step_prefills_whole_prompt(capped)  # chunked by the preset's budget
    llm = LLM(str(tiny_llama), preset="vllm", device="cpu", num_pages=256,
              chunk_size=None, token_budget=None)
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
    assert parse_cap(raw) == want


@pytest.mark.parametrize("raw", ["0", 0, -3, "abc", "", True, "1.5"])
def test_parse_cap_refuses_what_is_not_a_size(raw):
    with pytest.raises(ValueError, match="positive integer"):
        parse_cap(raw)


def test_chunk_sizes_are_read_by_parse_cap() -> None:
    assert parse_sizes("64, none,INF,,off,2048") == [64, None, None, None, 2048]
    with pytest.raises(ValueError, match="positive integer"):
        parse_sizes("64,0")  # the old parser took 0 for a chunk size


@pytest.mark.parametrize("argv", [
    ["serve", "m", "--chunk-size", "0"],
    ["generate", "m", "--prompt", "x", "--token-budget", "-1"],
    ["sweep", "--model", "m", "--chunk-sizes", "64,zero"],
    ["cost", "--model", "Qwen2.5-32B", "--prefill", "10", "--chunk-size", "0"],
])
def test_every_command_line_refuses_a_bad_cap_with_one_message(argv, capsys) -> None:
    try:
        rc = cli_main(argv)
    except SystemExit as e:  # argparse's refusal
        rc = e.code
    assert rc == 2
    assert "expected a positive integer or one of none, unlimited, inf, off" in \
        capsys.readouterr().err


def test_factory_runs_the_config_it_is_given() -> None:
    from hlserve.sim.build import device_info
    from hlserve.sim.hardware import get_hardware
    from hlserve.sim.sim_runner import SimRunner

    hw = get_hardware("H100")
    config = make_config("Qwen2.5-7B", device_info=device_info(hw), preset="sarathi",
                         chunk_size=None, num_pages=2000)
    engine = factory.build_engine(config, lambda c: SimRunner(c, hw, 1))
    assert engine.config is config  # built once, by make_config, and not rebuilt below
    assert engine.config.chunk_size is None and engine.config.token_budget == 512


def test_llm_from_config_runs_that_config(tiny_llama: Path) -> None:
    config = make_config(str(tiny_llama), device="cpu", num_pages=64, preset="vllm",
                         token_budget=None)
    llm = LLM.from_config(config)
    assert llm.engine.config is config and not llm.instruct
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 3
