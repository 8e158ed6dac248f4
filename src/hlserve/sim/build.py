"""An Engine on a simulated machine: the real Scheduler and KV cache, a SimRunner, virtual time,
built by the one engine factory (``engine/factory.py:build_engine``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hlserve.config import EngineConfig
from hlserve.engine.args import make_config
from hlserve.engine.factory import build_engine
from hlserve.engine.llm_engine import Engine, VirtualClock
from hlserve.engine.presets import DeviceInfo
from hlserve.engine.speculation import Speculator
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

    def speculator(self, config: EngineConfig, runner: SimRunner) -> Speculator | None:
        """The drafts' proposer of an engine on ``runner``: None without speculative_config,
        else one that follows the acceptance profile over the runner's simulated tokens."""
        if config.speculative_config is None:
            return None
        if self.acceptance is None:
            raise ValueError("a simulated engine with speculative_config needs an acceptance "
                             "profile (SimOptions.acceptance): simulated tokens have nothing "
                             "for a speculator to copy")
        return ProfileSpeculator(self.acceptance, runner.token_at, runner.vocab)


def device_info(hw: Hardware) -> DeviceInfo:
    """What the presets key their defaults on (SGLang's chunk size by memory, vLLM's budget by
    GPU class), for a simulated device."""
    if hw.arch == "cpu" or hw.mem_gib <= 0:
        return DeviceInfo("cpu")
    return DeviceInfo("cuda", float(hw.mem_gib), hopper_class=hw.arch == "hopper")


def build_sim_engine(model: str, hardware: str | Hardware = "H20", tp: int = 1,
                     sim: SimOptions = SimOptions(), **options: Any) -> Engine:
    """``build_sim_engine("Qwen2.5-32B", "H20", tp=8, mode="throughput")``: engine options as
    ``engine/args.py:make_config`` takes them (``mode``/``preset`` expanded for the simulated
    device); the SimRunner's own options in ``sim``. A caller that reads the runner's own
    counters builds the same three parts itself (study/core.py)."""
    hw = get_hardware(hardware)
    config = make_config(model, device_info=device_info(hw), **options)
    runner = SimRunner(config, hw, tp, **sim.runner_options())
    return build_engine(config, runner, clock=VirtualClock(),
                        speculator=sim.speculator(config, runner))
