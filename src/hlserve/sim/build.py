"""An Engine on a simulated machine: the real Scheduler and KV cache, a SimRunner, virtual time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hlserve.engine import factory
from hlserve.engine.args import make_config
from hlserve.engine.engine import Engine, VirtualClock
from hlserve.engine.presets import DeviceInfo
from hlserve.sim.acceptance_profile import AcceptanceProfile, ProfileSpeculator
from hlserve.sim.hardware import Hardware, get_hardware
from hlserve.sim.sim_runner import SimRunner


@dataclass(frozen=True)
class SimOptions:
    """The simulation's own options (not engine knobs): share of device memory usable, GiB
    kept back from the KV pool, the share of positions that yield EOS (0: never), and, for an
    engine with ``speculative_config``, the acceptance profile its drafts follow (required
    then: the simulated tokens give a real speculator nothing to copy; sim/acceptance_profile.py)."""

    mem_util: float = 0.9
    reserve_gib: float = 2.0
    eos_rate: float = 0.0
    acceptance: AcceptanceProfile | None = None

    def runner_options(self) -> dict[str, float]:
        return {"mem_util": self.mem_util, "reserve_gib": self.reserve_gib,
                "eos_rate": self.eos_rate}


def device_info(hw: Hardware) -> DeviceInfo:
    """What the presets key their defaults on (SGLang's chunk size by memory, vLLM's budget by
    GPU class), for a simulated device."""
    if hw.arch == "cpu" or hw.mem_gib <= 0:
        return DeviceInfo("cpu")
    return DeviceInfo("cuda", float(hw.mem_gib), hopper_class=hw.arch == "hopper")


def build_sim_engine(model: str, hardware: str | Hardware = "H20", tp: int = 1,
                     sim: SimOptions = SimOptions(), **options: Any) -> Engine:
    """``build_sim_engine("Qwen2.5-32B", "H20", tp=8, mode="throughput")``: engine options as
    for :func:`hlserve.llm.build_engine` (``mode``/``preset`` expanded for the simulated
    device); the SimRunner's own options in ``sim``."""
    hw = get_hardware(hardware)
    engine = factory.build_engine(
        make_config(model, device_info=device_info(hw), **options),
        lambda c: SimRunner(c, hw, tp, **sim.runner_options()), clock=VirtualClock())
    if engine.spec is not None:
        if sim.acceptance is None:
            raise ValueError("a simulated engine with speculative_config needs an acceptance "
                             "profile (SimOptions.acceptance): simulated tokens have nothing "
                             "for a speculator to copy")
        runner = engine.runner
        assert isinstance(runner, SimRunner)
        engine.spec.speculator = ProfileSpeculator(sim.acceptance, runner.token_at, runner.vocab)
    return engine
