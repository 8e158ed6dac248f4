"""What ``hlserve bench`` needs of a Mooncake trace beyond :mod:`hlserve.bench.workloads`:
lengths scaled down for small machines, open-loop requests with scaled outputs, and
closed-loop agent sessions along the trace's chains.

NOTE (to merge): :mod:`hlserve.bench.workloads` is the workload module shared with the
simulator (``MooncakeTrace``, ``PoissonChat``, ``trace_arrivals``). This module only adds
what the HTTP bench needs on top of it; once the shared module has length scaling and
closed-loop chain sessions, these should move there.

Scaling: with ``length_scale`` s, a 512-token block becomes round(512·s) tokens (the first
round(512·s) ids of the shared module's block for that hash id), a request of n input
tokens round(n·s), and its output round(m·output_scale): the trace's prefix sharing is kept
block for block at a length a CPU can serve.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hlserve.bench.workloads import BLOCK, MooncakeTrace, TraceRequest


@dataclass
class OpenRequest:
    send_at: float  # seconds after the start
    prompt_ids: list[int]
    output_len: int
    session_id: int | None = None
    round: int | None = None


@dataclass
class ScaledTrace:
    trace: MooncakeTrace
    length_scale: float = 1.0
    output_scale: float | None = None  # None: length_scale

    @property
    def block_len(self) -> int:
        return max(1, round(BLOCK * self.length_scale))

    def input_len(self, r: TraceRequest) -> int:
        return max(1, round(r.input_length * self.length_scale))

    def output_len(self, r: TraceRequest) -> int:
        s = self.length_scale if self.output_scale is None else self.output_scale
        return max(1, round(r.output_length * s))

    def prompt(self, r: TraceRequest) -> list[int]:
        if self.length_scale == 1.0:
            return self.trace.prompt(r)
        n, b = self.input_len(r), self.block_len
        ids: list[int] = []
        for h in r.hash_ids:
            if len(ids) >= n:
                break
            ids.extend(self.trace.block(h)[:b])
        return ids[:n]


def trace_requests(st: ScaledTrace, time_scale: float = 1.0, max_len: int | None = None
                   ) -> tuple[list[OpenRequest], int]:
    """Open-loop replay: request i at t_i / time_scale seconds (as
    :func:`~hlserve.bench.workloads.trace_arrivals`: 2 replays twice as fast). Requests whose
    prompt + output would not fit ``max_len`` are left out; returns (requests, left out)."""
    out, skipped = [], 0
    for r in st.trace.requests:
        n_out = st.output_len(r)
        if max_len is not None and st.input_len(r) + n_out > max_len:
            skipped += 1
            continue
        out.append(OpenRequest(r.timestamp / time_scale, st.prompt(r), n_out, session_id=r.index))
    return out, skipped


@dataclass
class TraceSession:
    """A closed-loop agent session along one chain of a trace: round r's prompt is round
    r−1's prompt and output plus new ids up to the trace's (scaled) input length, at least
    ``min_new`` of them (the tool result); output lengths from the trace. Duck-types
    :class:`~hlserve.bench.workloads.AgentSession`."""

    session_id: int
    rounds_spec: list[tuple[int, int]]  # (input length, output length), scaled
    first_prompt: list[int]
    rng: random.Random
    vocab: tuple[int, int] = (3, 4096)
    min_new: int = 16
    round: int = 0
    context: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.round >= len(self.rounds_spec)

    def next_request(self) -> tuple[list[int], int]:
        n_in, n_out = self.rounds_spec[self.round]
        if self.round == 0:
            self.context = list(self.first_prompt)
        else:
            new = max(self.min_new, n_in - len(self.context))
            self.context = self.context + [self.rng.randrange(*self.vocab) for _ in range(new)]
        return list(self.context), n_out

    def complete(self, output_ids: list[int]) -> None:
        self.context = self.context + list(output_ids)
        self.round += 1


def chains(trace: MooncakeTrace) -> list[list[int]]:
    """The trace's sessions, from each request's ``parent``: lists of request indices. A
    request whose parent was already continued starts a session of its own (a branch)."""
    chain_of: dict[int, int] = {}
    continued: set[int] = set()
    out: list[list[int]] = []
    for r in trace.requests:
        p = r.parent
        if p is not None and p in chain_of and p not in continued:
            continued.add(p)
            chain_of[r.index] = chain_of[p]
            out[chain_of[p]].append(r.index)
        else:
            chain_of[r.index] = len(out)
            out.append([r.index])
    return out


def trace_sessions(st: ScaledTrace, sessions: int, max_rounds: int | None = None,
                   min_rounds: int = 2, max_len: int | None = None,
                   min_new: int = 16) -> list[TraceSession]:
    """The first ``sessions`` chains with at least ``min_rounds`` rounds, each cut to
    ``max_rounds`` and to the rounds whose projected context fits ``max_len``."""
    reqs = st.trace.requests
    out: list[TraceSession] = []
    for chain in chains(st.trace):
        if len(out) >= sessions:
            break
        spec: list[tuple[int, int]] = []
        ctx = 0
        for idx in chain[: max_rounds or None]:
            n_in, n_out = st.input_len(reqs[idx]), st.output_len(reqs[idx])
            if spec:
                n_in = max(n_in, ctx + min_new)
            if max_len is not None and n_in + n_out > max_len:
                break
            spec.append((n_in, n_out))
            ctx = n_in + n_out
        if len(spec) < min_rounds:
            continue
        out.append(TraceSession(len(out), spec, st.prompt(reqs[chain[0]]),
                                random.Random(st.trace.seed * 7919 + chain[0]),
                                st.trace.vocab, min_new))
    return out
