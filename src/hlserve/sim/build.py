"""An Engine on a simulated machine: the real Scheduler and KV cache, a SimRunner, virtual time."""

from __future__ import annotations

from typing import Any

from hlserve.config import EngineConfig
from hlserve.engine.engine import Engine, VirtualClock
from hlserve.engine.presets import DeviceInfo, resolve_options
from hlserve.sim.hardware import Hardware, get_hardware
from hlserve.sim.runner import SimRunner

RUNNER_OPTIONS = ("mem_util", "reserve_gib", "eos_rate")


def device_info(hw: Hardware) -> DeviceInfo:
    """What the presets key their defaults on (SGLang's chunk size by memory, vLLM's budget by
    GPU class), for a simulated device."""
    if hw.arch == "cpu" or hw.mem_gib <= 0:
        return DeviceInfo("cpu")
    return DeviceInfo("cuda", float(hw.mem_gib), hopper_class=hw.arch == "hopper")


def sim_config(model: str, hardware: str | Hardware, **engine_options: Any) -> EngineConfig:
    hw = get_hardware(hardware)
    known = EngineConfig.field_names() | {"mode", "preset"}
    unknown = set(engine_options) - known
    if unknown:
        raise TypeError(f"unknown engine option(s) {sorted(unknown)}")
    return EngineConfig(model=model, **resolve_options(engine_options, device_info(hw)))


def build_sim_engine(model: str, hardware: str | Hardware = "H20", tp: int = 1,
                     **options: Any) -> Engine:
    """``build_sim_engine("Qwen2.5-32B", "H20", tp=8, mode="throughput")``: engine options as
    for :func:`hlserve.llm.build_engine` (``mode``/``preset`` expanded for the simulated
    device), plus the SimRunner's ``mem_util``, ``reserve_gib``, ``eos_rate``."""
    runner_opts = {k: options.pop(k) for k in RUNNER_OPTIONS if k in options}
    hw = get_hardware(hardware)
    config = sim_config(model, hw, **options)
    runner = SimRunner(config, hw, tp, **runner_opts)
    return Engine(config, runner, tokenizer=None, clock=VirtualClock())
