"""Workloads as token ids, shared by every driver (in-process, HTTP, simulated).

- :class:`AgentWorkload`: closed-loop agent sessions. Round r's prompt is the shared system
  prompt (tool definitions), then every earlier round's prompt additions and outputs, then a
  new tool result. The next round is sent when the tool call between them has run: its
  ``tool_time`` (:mod:`hlserve.driver.tool_time`; zero by default, the source study's zero-gap
  workload), drawn per round from a generator of the session's own apart from the one the
  lengths and ids come from, so a tool time never changes a prompt. Lengths come from
  configurable distributions (:class:`Dist`); with ``target_context`` a session's context
  grows up to that length and the session ends there.
- :class:`MooncakeTrace`: a Mooncake-format trace (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids`` over 512-token blocks). Each hash id maps to a fixed block of
  token ids, so two requests share exactly the prefix the trace says they share; a request
  whose hash ids begin with all of an earlier request's full-block ids continues that
  request's session (``parent``). Replayed open loop by timestamps (``hlserve.study.drive``),
  or closed loop along the chains as sessions (:func:`trace_sessions`).
- :class:`PoissonChat`: open-loop chat traffic, Poisson arrivals, the contrast case.
- :class:`ScaledTrace` and what ``hlserve bench`` builds from it: a trace's lengths scaled
  down for small machines (with ``length_scale`` s a 512-token block becomes round(512·s)
  tokens, the first ids of that hash id's block, so prefix sharing is kept block for block),
  open-loop requests (:func:`trace_requests`) and closed-loop sessions along the trace's
  chains (:func:`trace_sessions`).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hlserve.driver.tool_time import NO_TOOL_TIME, ToolTime, check_drawn, draw_pause, tool_rng


@dataclass(frozen=True)
class Dist:
    """A length distribution, clipped to ``[lo, hi]``: ``constant``, ``uniform`` (lo..hi),
    ``lognormal`` (with the given ``mean`` and log-space ``sigma``) or ``exponential``."""

    kind: str = "uniform"
    lo: int = 1
    hi: int = 1
    mean: float = 0.0
    sigma: float = 0.0

    @classmethod
    def constant(cls, n: int) -> Dist:
        return cls("constant", n, n, float(n))

    @classmethod
    def uniform(cls, lo: int, hi: int) -> Dist:
        return cls("uniform", lo, hi, (lo + hi) / 2)

    @classmethod
    def lognormal(cls, mean: float, sigma: float = 0.8, lo: int = 1, hi: int = 1 << 20) -> Dist:
        return cls("lognormal", lo, hi, mean, sigma)

    @classmethod
    def exponential(cls, mean: float, lo: int = 1, hi: int = 1 << 20) -> Dist:
        return cls("exponential", lo, hi, mean)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "constant":
            return self.lo
        if self.kind == "uniform":
            return rng.randint(self.lo, self.hi)
        if self.kind == "lognormal":
            mu = math.log(self.mean) - self.sigma**2 / 2  # so that E[x] = mean
            x = rng.lognormvariate(mu, self.sigma)
        elif self.kind == "exponential":
            x = rng.expovariate(1 / self.mean)
        else:
            raise ValueError(f"unknown distribution {self.kind!r}")
        return int(min(self.hi, max(self.lo, round(x))))


LengthSpec = tuple[int, int] | int | Dist


def as_dist(spec: LengthSpec) -> Dist:
    if isinstance(spec, Dist):
        return spec
    if isinstance(spec, int):
        return Dist.constant(spec)
    lo, hi = spec
    return Dist.uniform(lo, hi)


def random_ids(rng: random.Random, n: int, vocab: tuple[int, int]) -> list[int]:
    return rng.choices(range(*vocab), k=n)


_POOL_SIZE = 1 << 20


@functools.lru_cache(maxsize=4)
def _id_pool(vocab: tuple[int, int], seed: int) -> list[int]:
    return np.random.default_rng([seed, 0x5EED]).integers(vocab[0], vocab[1], _POOL_SIZE).tolist()


def pool_ids(rng: random.Random, n: int, vocab: tuple[int, int], seed: int = 0) -> list[int]:
    """``n`` random-looking ids: a window of a fixed random pool at a random offset. Much
    faster than drawing each id (long agent contexts), and as good for serving: the prefix
    cache keys pages by their whole prefix, so equal windows after different prefixes never
    match."""
    pool = _id_pool(vocab, seed)
    out: list[int] = []
    while n > 0:
        k = min(n, _POOL_SIZE // 2)
        off = rng.randrange(_POOL_SIZE - k)
        out += pool[off : off + k]
        n -= k
    return out


@dataclass(frozen=True)
class AgentWorkload:
    sessions: int = 16
    rounds: int = 4
    system_prompt_len: int = 512  # shared by every session: tool definitions
    task_len: int = 64  # per session, unique: the user's task
    tool_output_len: LengthSpec = (64, 256)  # new tokens appended each round
    output_len: LengthSpec = (16, 64)  # generated tokens per round (ignore_eos pins them)
    vocab: tuple[int, int] = (3, 4096)  # ids drawn from [lo, hi): clear of special tokens
    seed: int = 0
    target_context: int | None = None  # a session's context grows up to this, then it ends
    # False: every round's prompt after the shared system prompt is fresh ids of the length it
    # would have had, so nothing of an earlier round is in the prefix cache (the paper's
    # benchmark has little prefix reuse); the lengths drawn are the same as with reuse
    prefix_reuse: bool = True
    # the pause between a round's end and the next round's start (the tool call); zero draws
    # nothing, so the zero-gap workload is the one it always was
    tool_time: ToolTime = NO_TOOL_TIME

    def __post_init__(self) -> None:
        check_drawn(self.tool_time)

    def sessions_list(self) -> list[AgentSession]:
        return [self.make_session(i) for i in range(self.sessions)]

    def make_session(self, index: int) -> AgentSession:
        """Session ``index`` (any index: a steady-state driver keeps starting new ones); the
        same workload and index always give the same session."""
        return AgentSession(self, index, self.system_ids(),
                            random.Random(self.seed * 1_000_003 + index * 7919 + 1),
                            tool_rng=tool_rng(self.seed, index))

    @functools.cached_property
    def _system(self) -> tuple[int, ...]:
        return tuple(random_ids(random.Random(self.seed), self.system_prompt_len, self.vocab))

    def system_ids(self) -> list[int]:
        return list(self._system)

    def _ids(self, rng: random.Random, n: int) -> list[int]:
        return pool_ids(rng, n, self.vocab, self.seed)

    @classmethod
    def for_context(cls, target: int, sessions: int, rounds: int = 8, system_prompt_len: int = 2048,
                    task_len: int = 256, output_mean: float = 200.0, seed: int = 0,
                    vocab: tuple[int, int] = (3, 4096), prefix_reuse: bool = True,
                    tool_time: ToolTime = NO_TOOL_TIME) -> AgentWorkload:
        """Sessions whose context grows from the system prompt to ``target`` over ``rounds``
        rounds: lognormal tool results (mean sized to reach the target) and outputs (mean
        ``output_mean``, as agent turns are short: the Mooncake tool&agent trace's mean is 182)."""
        per_round = max(16.0, (target - system_prompt_len - task_len) / rounds - output_mean)
        return cls(
            sessions=sessions, rounds=rounds, system_prompt_len=system_prompt_len,
            task_len=task_len, tool_output_len=Dist.lognormal(per_round, 0.6, 16, target),
            output_len=Dist.lognormal(output_mean, 0.6, 8, 2048), vocab=vocab, seed=seed,
            target_context=target, prefix_reuse=prefix_reuse, tool_time=tool_time,
        )


@dataclass
class AgentSession:
    workload: AgentWorkload
    session_id: int
    system: list[int]
    rng: random.Random
    round: int = 0
    context: list[int] = field(default_factory=list)
    ended: bool = False
    tool_rng: random.Random = field(default_factory=lambda: random.Random(0))

    def __post_init__(self) -> None:
        self.context = self.system + self.workload._ids(self.rng, self.workload.task_len)

    @property
    def done(self) -> bool:
        return self.ended or self.round >= self.workload.rounds

    def next_request(self) -> tuple[list[int], int]:
        """Prompt ids and output length of this session's next round."""
        w = self.workload
        tool = as_dist(w.tool_output_len).sample(self.rng)
        out = as_dist(w.output_len).sample(self.rng)
        if w.target_context is not None:
            room = w.target_context - len(self.context)
            out = max(1, min(out, room // 4))
            tool = max(1, min(tool, room - out))
            if len(self.context) + tool + out + 64 >= w.target_context:
                self.ended = True  # no room for another round after this one
        self.context = self.context + self.workload._ids(self.rng, tool)
        if not w.prefix_reuse:
            return self.fresh_prompt(), out
        return list(self.context), out

    def fresh_prompt(self) -> list[int]:
        """The system prompt, then fresh ids as long as the rest of the context: drawn from a
        generator of their own (session, round), so the lengths the session draws are those
        of the same session with reuse (a paired comparison)."""
        w = self.workload
        rng = random.Random((w.seed * 1_000_003 + self.session_id * 7919) * 131 + self.round + 7)
        return self.system + w._ids(rng, len(self.context) - len(self.system))

    def complete(self, output_ids: list[int]) -> None:
        """Record the round's output; the next prompt extends this one with it."""
        self.context = self.context + list(output_ids)
        self.round += 1

    def tool_pause(self, served: float = 0.0) -> float:
        """Seconds the tool call after the round just completed runs before the next round
        is sent (drivers ask once per round that has a next one, with the seconds the round
        took to serve, which only a trace's ``recorded`` gaps use)."""
        return draw_pause(self.workload.tool_time, self.tool_rng)


# ---- Mooncake traces ---------------------------------------------------------------------------

BLOCK = 512  # tokens per hash id in Mooncake traces


@dataclass(frozen=True)
class TraceRequest:
    index: int
    timestamp: float  # seconds from the trace's start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    parent: int | None  # the earlier request this one continues (its session), if any
    # seconds from the end of the session's previous request to this one's start (a trace
    # that records its tool time as a delay: AIPerf's, inference-perf's); None: not recorded
    delay: float | None = None


class MooncakeTrace:
    def __init__(self, requests: list[TraceRequest], vocab: tuple[int, int] = (3, 4096),
                 seed: int = 0) -> None:
        self.requests = requests
        self.vocab = vocab
        self.seed = seed

    @classmethod
    def load(cls, path: str | Path, limit: int | None = None, start: float = 0.0,
             duration: float | None = None, vocab: tuple[int, int] = (3, 4096), seed: int = 0,
             min_chain_blocks: int = 2) -> MooncakeTrace:
        """Read a JSONL trace; ``start``/``duration`` (seconds) or ``limit`` take a slice.
        A request continues the latest earlier request whose full-block hash ids (at least
        ``min_chain_blocks`` of them, so that the shared system block alone does not chain
        everything) begin its own."""
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return cls.from_rows(rows, limit, start, duration, vocab, seed, min_chain_blocks)

    @classmethod
    def from_rows(cls, rows: list[dict], limit: int | None = None, start: float = 0.0,
                  duration: float | None = None, vocab: tuple[int, int] = (3, 4096),
                  seed: int = 0, min_chain_blocks: int = 2) -> MooncakeTrace:
        """The trace of Mooncake rows (``timestamp`` ms, ``input_length``, ``output_length``,
        ``hash_ids``), sliced as :meth:`load` says. A row with a ``parent`` (a row index:
        a trace whose sessions are explicit, :mod:`hlserve.driver.trace_formats`) continues
        it, and its ``delay`` (ms) is kept; the others chain by their hash ids."""
        kept: list[dict] = []
        for r in rows:
            t = r["timestamp"] / 1000.0
            if t < start:
                continue
            if duration is not None and t >= start + duration:
                break
            kept.append(r)
            if limit is not None and len(kept) >= limit:
                break
        index = {id(r): i for i, r in enumerate(kept)}
        requests: list[TraceRequest] = []
        by_prefix: dict[tuple[int, ...], int] = {}
        for i, r in enumerate(kept):
            h = tuple(r["hash_ids"])
            parent = None
            if "parent" in r:  # explicit: the row it continues, if kept
                parent = None if r["parent"] is None else index.get(id(rows[r["parent"]]))
            else:
                for k in range(len(h), min_chain_blocks - 1, -1):
                    parent = by_prefix.get(h[:k])
                    if parent is not None:
                        break
                full = h[: r["input_length"] // BLOCK]
                if len(full) >= min_chain_blocks:
                    by_prefix[full] = i
            delay = r.get("delay")
            requests.append(TraceRequest(i, r["timestamp"] / 1000.0 - start, r["input_length"],
                                         r["output_length"], h, parent,
                                         None if delay is None else delay / 1000.0))
        return cls(requests, vocab, seed)

    def __len__(self) -> int:
        return len(self.requests)

    @functools.lru_cache(maxsize=8192)  # noqa: B019 (blocks are shared; the trace lives long)
    def block(self, hash_id: int) -> tuple[int, ...]:
        rng = np.random.default_rng([self.seed, hash_id])
        return tuple(rng.integers(self.vocab[0], self.vocab[1], BLOCK).tolist())

    def prompt(self, req: TraceRequest, n: int | None = None, block_len: int = BLOCK) -> list[int]:
        """The request's token ids: the first ``block_len`` ids of each hash id's block, cut
        to ``n`` tokens (default: its input length). Scaled replays shrink both."""
        n = req.input_length if n is None else n
        ids: list[int] = []
        for h in req.hash_ids:
            if len(ids) >= n:
                break
            ids.extend(self.block(h)[:block_len])
        return ids[:n]

    def stats(self) -> dict[str, float]:
        reqs = self.requests
        return {
            "requests": len(reqs),
            "duration_s": reqs[-1].timestamp if reqs else 0.0,
            "mean_input": float(np.mean([r.input_length for r in reqs])) if reqs else 0.0,
            "mean_output": float(np.mean([r.output_length for r in reqs])) if reqs else 0.0,
            "continuations": sum(r.parent is not None for r in reqs),
        }


# ---- open-loop chat -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    time: float  # seconds after the run starts
    prompt: list[int]
    max_tokens: int
    key: int  # index in the workload (trace request index, chat request number)


@dataclass(frozen=True)
class PoissonChat:
    """Open-loop chat: Poisson arrivals at ``rate`` requests/s; a shared system prompt, a
    user turn and an answer drawn from the given distributions."""

    rate: float = 1.0
    num_requests: int = 100
    system_prompt_len: int = 256
    prompt_len: LengthSpec = Dist("lognormal", 16, 16384, 1000.0, 0.8)
    output_len: LengthSpec = Dist("lognormal", 8, 2048, 300.0, 0.8)
    vocab: tuple[int, int] = (3, 4096)
    seed: int = 0

    def arrivals(self) -> Iterator[Arrival]:
        rng = random.Random(self.seed)
        system = random_ids(random.Random(self.seed + 1), self.system_prompt_len, self.vocab)
        t = 0.0
        for i in range(self.num_requests):
            t += rng.expovariate(self.rate)
            user = random_ids(rng, as_dist(self.prompt_len).sample(rng), self.vocab)
            yield Arrival(t, system + user, as_dist(self.output_len).sample(rng), i)


def trace_arrivals(trace: MooncakeTrace, time_scale: float = 1.0) -> Iterator[Arrival]:
    """Every trace request at its timestamp (divided by ``time_scale``: 2 replays twice as fast)."""
    for r in trace.requests:
        yield Arrival(r.timestamp / time_scale, trace.prompt(r), max(1, r.output_length), r.index)


# ---- scaled traces for the HTTP bench ---------------------------------------------------------


@dataclass
class OpenRequest:
    send_at: float  # seconds after the start
    prompt_ids: list[int]
    output_len: int
    session_id: int | None = None
    round: int | None = None
    session: str | None = None  # the session it names on the wire (a trace chain's); None: none


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
        return self.trace.prompt(r, self.input_len(r), self.block_len)


def trace_requests(st: ScaledTrace, time_scale: float = 1.0, max_len: int | None = None
                   ) -> tuple[list[OpenRequest], int]:
    """Open-loop replay: request i at t_i / time_scale seconds (as
    :func:`~hlserve.driver.workloads.trace_arrivals`: 2 replays twice as fast). Requests whose
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
    :class:`~hlserve.driver.workloads.AgentSession`."""

    session_id: int
    rounds_spec: list[tuple[int, int]]  # (input length, output length), scaled
    first_prompt: list[int]
    rng: random.Random
    vocab: tuple[int, int] = (3, 4096)
    min_new: int = 16
    round: int = 0
    context: list[int] = field(default_factory=list)
    tool_time: ToolTime = NO_TOOL_TIME
    tool_rng: random.Random = field(default_factory=lambda: random.Random(0))
    gaps: list[float] = field(default_factory=list)  # recorded seconds from round r to r + 1
    # True: the gaps are the pauses themselves (a trace's recorded delays, from a round's
    # end); False: start-to-start gaps that include the round's own serving
    gaps_are_delays: bool = False

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

    def tool_pause(self, served: float = 0.0) -> float:
        """As :meth:`AgentSession.tool_pause`; with a ``recorded`` tool time, the trace's gap
        from the round just completed to the next, less ``served`` (the seconds the replay
        took to serve that round: the trace's gap includes its own serving), at least 0."""
        if self.tool_time.kind == "recorded":
            gap = self.gaps[self.round - 1]
            return max(0.0, gap if self.gaps_are_delays else gap - served)
        return draw_pause(self.tool_time, self.tool_rng)


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
                   min_new: int = 16, tool_time: ToolTime = NO_TOOL_TIME,
                   time_scale: float = 1.0) -> list[TraceSession]:
    """The first ``sessions`` chains with at least ``min_rounds`` rounds, each cut to
    ``max_rounds`` and to the rounds whose projected context fits ``max_len``; ``tool_time``
    between their rounds (``recorded``: the chain's own gaps over ``time_scale``)."""
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
        kept = chain[:len(spec)]
        delays = all(reqs[b].delay is not None for b in kept[1:])
        gaps = [(reqs[b].delay if delays else reqs[b].timestamp - reqs[a].timestamp)
                / time_scale for a, b in itertools.pairwise(kept)]
        out.append(TraceSession(len(out), spec, st.prompt(reqs[chain[0]]),
                                random.Random(st.trace.seed * 7919 + chain[0]),
                                st.trace.vocab, min_new, tool_time=tool_time,
                                tool_rng=tool_rng(st.trace.seed, len(out)), gaps=gaps,
                                gaps_are_delays=delays))
    return out
