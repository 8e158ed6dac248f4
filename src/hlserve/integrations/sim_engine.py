"""Another engine's scheduler as the closed-loop driver's engine, on the simulated runner.

hlserve's study runs its own scheduler against a ``SimRunner``: each step's batch priced by
the ``CostModel`` of a GPU, a virtual clock advanced by that price. ``ForeignSimEngine`` gives
vLLM's and SGLang's own scheduling code (``integrations/vllm/sim_vllm.py``,
``integrations/sglang/sim_sglang.py``) the same runner and clock, behind the surface the
closed-loop driver (``driver/closed_loop.py``) reads of an ``Engine``: ``add_request``,
``step_requests``, ``has_unfinished``, ``clock``, ``skip_time``, ``requests``. The driver,
the workloads and the records are hlserve's, so a point of vLLM's scheduler is comparable to
a point of hlserve's field by field.

Each request the driver sends is mirrored by an hlserve ``Request`` that only records what
the other scheduler did with it (its tokens, their times, its cached prompt, its finish);
the other scheduler keeps its own request object and decides everything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from hlserve.request import FinishReason, Request, RequestStatus, SamplingParams
from hlserve.sim.cost import CostModel, shape_from
from hlserve.sim.hardware import get_hardware
from hlserve.sim.model_specs import resolve_model_spec


@dataclass
class StepCounters:
    """What the study records of each engine's steps (the names of ``run_point``'s metrics)."""

    iterations: int = 0
    mixed_iterations: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens_computed: int = 0
    retractions: int = 0  # vLLM's preemptions, SGLang's retractions
    busy_s: float = 0.0


class StepPricer:
    """A step's seconds on the simulated GPU: the ``CostModel`` of ``model`` on ``tp`` x
    ``hardware``, fed the step's segments as :func:`hlserve.sim.cost.shape_from` reads them."""

    def __init__(self, model: str, hardware: str, tp: int) -> None:
        _, self.model_config = resolve_model_spec(model)
        self.cost = CostModel(self.model_config, get_hardware(hardware), tp)
        self.counters = StepCounters()

    def price(self, segments: list[tuple[int, int, bool]]) -> float:
        shape = shape_from(segments)
        elapsed, _ = self.cost.iteration(shape)
        c = self.counters
        c.iterations += 1
        c.decode_tokens_computed += shape.num_decodes
        c.prefill_tokens_computed += shape.num_tokens - shape.num_decodes
        c.mixed_iterations += bool(shape.prefill and shape.num_decodes)
        c.busy_s += elapsed
        return elapsed

    def pool_tokens(self, max_tokens_per_iteration: int, max_seqs: int) -> int:
        """The KV pool a deployment gets, sized as ``SimRunner`` sizes hlserve's (memory
        utilisation 0.9, a 2 GiB reserve, the largest iteration's activations), so that two
        systems with the same caps simulate the same pool."""
        return self.cost.kv_pool_tokens(max_tokens_per_iteration, max_seqs)


class ForeignSimEngine(ABC):
    """The driver's engine surface over another engine's scheduler on a virtual clock."""

    virtual_time = True

    def __init__(self, pricer: StepPricer) -> None:
        self.pricer = pricer
        self.requests: dict[str, Request] = {}
        self._now = 0.0

    # ---- what the driver reads -------------------------------------------------------------

    def clock(self) -> float:
        return self._now

    def skip_time(self, dt: float) -> None:
        self._now += dt

    @property
    def num_steps(self) -> int:
        return self.pricer.counters.iterations

    def add_request(self, prompt: Sequence[int], params: SamplingParams,
                    arrival_time: float | None = None, session_id: str | None = None) -> Request:
        """Mirror the request and hand it to the other scheduler, now."""
        req = Request(list(prompt), params,
                      arrival_time=self.clock() if arrival_time is None else arrival_time,
                      session=session_id)
        self.requests[req.request_id] = req
        self.submit(req)
        return req

    def step_requests(self) -> list[Request]:
        """One step of the other scheduler; the mirrored requests it finished."""
        return [self.requests.pop(rid) for rid in self.step()]

    # ---- what a subclass reports through -----------------------------------------------------

    def emitted(self, rid: str, tokens: Sequence[int], at: float) -> None:
        req = self.requests[rid]
        if not tokens:
            return
        if req.first_token_time is None:
            req.first_token_time = at
        req.output_token_ids.extend(tokens)
        req.token_times.extend([at] * len(tokens))

    def admitted(self, rid: str, cached_prompt: int, at: float) -> None:
        """The first time the scheduler runs the request: the prompt tokens its cache held."""
        req = self.requests[rid]
        if req.first_scheduled_time is None:
            req.first_scheduled_time = at
            req.num_cached_prompt = cached_prompt
            req.num_computed = cached_prompt

    def ended(self, rid: str, at: float, reason: FinishReason = FinishReason.LENGTH,
              error: str | None = None) -> None:
        req = self.requests[rid]
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.error, req.finish_time = reason, error, at

    # ---- the other scheduler -------------------------------------------------------------------

    @abstractmethod
    def submit(self, req: Request) -> None:
        """Give the other scheduler the mirrored request (its id, prompt, output length)."""

    @abstractmethod
    def step(self) -> list[str]:
        """Schedule and run one step, advancing ``_now``; the ids of requests it finished."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def kv_pool_tokens(self) -> int: ...
