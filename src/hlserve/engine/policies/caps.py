"""The caps of one step, and the start-up block that lists every cap in force.

Throughput mode's latency caps are off for agent traffic and tightened to the interactive
caps only where an interactive request would feel the others' prefill: its chunk cap while
it waits for its first token (so it gets in soon), its chunk and token caps while it
decodes (bounded iterations, so bounded gaps). hlserve's scheduler and the vLLM plugin
both read their queues into an ``interactive_presence`` and ask ``step_caps``; the plugin
then writes the answer into vLLM's own knobs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from hlserve.config import EngineConfig
from hlserve.engine.policies.budget import BudgetController, EMABudget, RatchetBudget

# where interactive traffic stands this step (decides which latency caps apply)
NO_INTERACTIVE, INTERACTIVE_WAITING, INTERACTIVE_DECODING = "none", "waiting", "decoding"


def cap(value: int | None) -> float:
    """A size knob as a bound: None (no cap) is infinity."""
    return math.inf if value is None else value


def interactive_presence(running: Iterable[Any], waiting: Iterable[Any],
                         is_interactive: Callable[[Any], bool],
                         is_decoding: Callable[[Any], bool]) -> str:
    """``INTERACTIVE_DECODING`` if a running interactive request decodes, else
    ``INTERACTIVE_WAITING`` if one waits for its first token (queued or mid-prefill), else
    ``NO_INTERACTIVE``."""
    seen = NO_INTERACTIVE
    for r in running:
        if is_interactive(r):
            if is_decoding(r):
                return INTERACTIVE_DECODING
            seen = INTERACTIVE_WAITING
    if seen == NO_INTERACTIVE and any(is_interactive(r) for r in waiting):
        seen = INTERACTIVE_WAITING
    return seen


class StepCaps(NamedTuple):
    chunk: float  # tokens of one request's prefill in this step (inf: no cap)
    budget: float  # tokens in this step (decodes are never starved by it: the host's rule)


def step_caps(config: EngineConfig, budget: float, presence: str) -> StepCaps:
    """The step's chunk cap and token budget: the config's chunk size and the budget
    controller's ``budget``, tightened by the interactive caps as ``presence`` requires."""
    chunk = cap(config.chunk_size)
    if presence == NO_INTERACTIVE:
        return StepCaps(chunk, budget)  # nobody is waiting: pure throughput
    chunk = min(chunk, cap(config.interactive_chunk_size))
    if presence == INTERACTIVE_DECODING:
        return StepCaps(chunk, min(budget, cap(config.interactive_token_budget)))
    return StepCaps(chunk, budget)


def chunk_tokens(uncomputed: int, chunk: float, budget: float) -> int:
    """Tokens a request's prefill gets in this step: what is left of it, within the chunk
    cap and what is left of the budget."""
    return int(min(uncomputed, chunk, budget))


# ---- the start-up block ---------------------------------------------------------------------

# knob -> (kind, why); kind is what throughput mode may remove (latency) or must keep (safety)
CAPS: dict[str, tuple[str, str]] = {
    "chunk_size": ("latency", "bounds each prefill chunk so decodes are not stalled (TTFT of others)"),
    "token_budget": ("latency", "bounds tokens per iteration (TPOT)"),
    "prefill_delay": ("latency", "holds new prefill while decodes run (TPOT)"),
    "max_chunked_prefills": ("latency", "requests mid-chunk at once"),
    "interactive_chunk_size": ("latency", "chunk size while an interactive request waits or decodes"),
    "interactive_token_budget": ("latency", "iteration budget while an interactive request decodes"),
    "max_num_seqs": ("safety", "running-request limit"),
    "max_model_len": ("safety", "longest sequence the model and KV hold"),
    "max_prefill_tokens": ("safety", "prefill tokens per iteration (activation memory)"),
    "max_step_seconds": ("safety", "tokens per iteration bounded so a step takes about this "
                         "long, from the measured time per token (no request holds the engine)"),
}


@dataclass(frozen=True)
class HostCaps:
    """What the host holds and enforces beside the config's knobs."""

    title: str
    num_pages: int
    page_size: int
    max_model_len: int
    page_word: str = "pages"  # what the host calls a page of its pool
    rows: tuple[tuple[str, str, object, str], ...] = ()  # its own caps: (kind, name, value, why)
    notes: tuple[str, ...] = ()  # lines after the policy line


def _budget_text(config: EngineConfig, budget: BudgetController) -> object:
    if isinstance(budget, EMABudget):
        return (f"ema controller, start {budget.budget:.0f}, floor {budget.floor}, ceiling "
                f"{budget.ceiling}, alpha {budget.alpha}, warm-up {budget.warmup}")
    if isinstance(budget, RatchetBudget):
        return f"ratchet controller, start {budget.budget:.0f}, warm-up {budget.warmup}"
    return config.token_budget


def describe_caps(config: EngineConfig, host: HostCaps, budget: BudgetController) -> str:
    """One block that lists every cap in force, so a run can be reproduced from its log."""
    def line(kind: str, name: str, value: object, why: str) -> str:
        shown = "off" if value is None else value
        return f"  {kind:<7} {name:<26} {shown!s:<28} {why}"

    lines = [host.title]
    for name, (kind, why) in CAPS.items():
        value: object = getattr(config, name)
        if name == "max_model_len":
            value = host.max_model_len
        elif name == "token_budget":
            value = _budget_text(config, budget)
        if name.startswith("interactive_"):
            why += " (only when interactive traffic is present)"
        lines.append(line(kind, name, value, why))
    lines += [line(*row) for row in host.rows]
    lines.append(line("safety", "kv_pool", f"{host.num_pages} {host.page_word} x "
                      f"{host.page_size} tokens", f"KV capacity ({host.num_pages * host.page_size} tokens)"))
    mixing = config.mixing + (f"(high {config.two_stage_high}, low {config.two_stage_low})"
                              if config.mixing == "two_stage" else "")
    order = config.order + (f"(aging {config.lpm_aging})" if config.order == "lpm" else "")
    if config.order == "program":
        order += f"(lpm aging {config.lpm_aging}, aging limit {config.program_aging_steps} steps)"
    lines.append(f"  policy  mixing={mixing} order={order} admission={config.admission} "
                 f"retraction={config.retraction} prefix_caching={config.enable_prefix_caching} "
                 f"default_class={config.default_request_class}")
    lines += host.notes
    return "\n".join(lines)
