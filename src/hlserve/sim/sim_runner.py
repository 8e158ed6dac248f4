"""The simulated runner: the predicted time of each batch on a hardware profile, no tensors.

``SimRunner`` plugs into the same :class:`~hlserve.engine.llm_engine.Engine`, scheduler and KV
cache manager as the real runner; only ``execute`` differs. With the engine's
``VirtualClock`` the clock advances by each step's predicted time, so TTFT, TPOT, throughput,
retraction and backpressure come out as they would on the simulated machine.

Tokens are synthetic and deterministic: a hash of the request's last prompt token and the
position, never an end-of-sequence id unless ``eos_rate`` asks for one (then a
deterministic ``eos_rate`` share of positions yields EOS).

The KV pool is what one device holds after its share of the weights, a fixed reserve and the
activations of the largest iteration the config allows (``CostModel.kv_pool_tokens``), so
that a run hits KV pressure where the real machine would. ``num_pages`` in the engine config
overrides it; a calibrated CPU profile (no device memory) sizes the pool from
``kv_cache_gb`` as the real runner does.
"""

from __future__ import annotations

from hlserve.config import EngineConfig
from hlserve.engine.batch import Batch, Runner, StepResult
from hlserve.sim.cost import CostModel, shape_of
from hlserve.sim.hardware import GIB, Hardware, get_hardware
from hlserve.sim.model_specs import resolve_model_spec


def max_tokens_per_iteration(config: EngineConfig, max_model_len: int) -> int:
    """The largest iteration the caps allow: what activation memory must be reserved for."""
    if config.token_budget is not None and config.budget_controller == "fixed":
        return config.token_budget
    if config.chunk_size is not None:  # several requests' chunks, up to the prefill cap
        per_prefill = max(config.chunk_size, config.max_prefill_tokens or 0)
    else:  # a whole prompt in one pass
        per_prefill = max_model_len
    return per_prefill + config.max_num_seqs


class SimRunner(Runner):
    supports_speculation = True  # with sim/acceptance_profile.py's ProfileSpeculator

    def __init__(
        self,
        config: EngineConfig,
        hardware: str | Hardware,
        tp: int = 1,
        model: str | None = None,
        *,
        mem_util: float = 0.9,
        reserve_gib: float = 2.0,
        eos_rate: float = 0.0,
    ) -> None:
        self.hardware = get_hardware(hardware)
        self.model_name, self.model_config = resolve_model_spec(model or config.model)
        self.tp = tp
        self.cost = CostModel(self.model_config, self.hardware, tp)
        self.page_size = config.page_size
        max_len = config.max_model_len or self.model_config.max_position_embeddings
        if config.num_pages is not None:
            self.num_pages = config.num_pages
        elif self.hardware.mem_gib > 0:
            tokens = self.cost.kv_pool_tokens(max_tokens_per_iteration(config, max_len),
                                              config.max_num_seqs, mem_util, reserve_gib)
            if tokens < max_len:
                raise ValueError(
                    f"{self.model_name} on {tp}x{self.hardware.name}: the KV pool would hold "
                    f"{tokens} tokens, fewer than one {max_len}-token sequence")
            self.num_pages = tokens // self.page_size
        else:  # a calibrated host profile: size the pool as TorchRunner does
            per_page = self.cost.kv_bytes_per_token * self.page_size
            self.num_pages = max(1, int(config.kv_cache_gb * GIB) // per_page)
        self.vocab = self.model_config.vocab_size
        self.eos = tuple(self.model_config.eos_token_ids)
        self._eos_set = frozenset(self.eos)
        self.eos_threshold = int(eos_rate * (1 << 32))
        # counters for reports
        self.busy_time = 0.0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.mixed_steps = 0

    def token_at(self, last_prompt: int, pos: int) -> int:
        """The token this runner produces at position ``pos`` of a request whose prompt ends
        with ``last_prompt``."""
        h = (last_prompt * 0x9E3779B1 + pos * 0x85EBCA77 + 0x27D4EB2F) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
        h ^= h >> 12
        if self.eos_threshold and self.eos and h < self.eos_threshold:
            return self.eos[0]
        tok = h % self.vocab
        while tok in self._eos_set:
            tok = (tok + 1) % self.vocab
        return tok

    def execute(self, batch: Batch) -> StepResult:
        sampled: list = []
        shape = shape_of(batch, sampled)  # the shape calibration fits to, not a copy of it
        tokens: dict[str, int] = {}
        accepted: dict[str, list[int]] = {}
        for s in sampled:
            rid, last = s.request.request_id, s.request.prompt_token_ids[-1]
            if s.draft:
                accepted[rid], tokens[rid] = self._verify(last, s.end - len(s.draft), s.draft)
            else:
                tokens[rid] = self.token_at(last, s.end)
        elapsed, _ = self.cost.iteration(shape)
        self.busy_time += elapsed
        self.decode_tokens += shape.num_decodes
        self.prefill_tokens += shape.num_tokens - shape.num_decodes
        if shape.prefill and shape.num_decodes:
            self.mixed_steps += 1
        return StepResult(tokens=tokens, elapsed=elapsed, accepted=accepted)

    def _verify(self, last: int, pos: int, draft: list[int]) -> tuple[list[int], int]:
        """Greedy verification, as the real runner's: the draft's prefix that equals this
        runner's tokens from position ``pos`` on, then its own token after that prefix."""
        n = 0
        while n < len(draft) and draft[n] == self.token_at(last, pos + n):
            n += 1
        return draft[:n], self.token_at(last, pos + n)

    def describe(self) -> str:
        hw = self.hardware
        return (f"{self.model_name} on {self.tp}x{hw.name}: weights {self.cost.weight_bytes / GIB:.1f} "
                f"GiB/device, KV {self.cost.kv_bytes_per_token / 1024:.0f} KiB/token/device, pool "
                f"{self.num_pages} pages x {self.page_size} = {self.num_pages * self.page_size} tokens")
