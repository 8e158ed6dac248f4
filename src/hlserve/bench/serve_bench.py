"""``hlserve bench``: the agent-era benchmark against any OpenAI-compatible server.

Three workloads, one client (:mod:`hlserve.bench.client`), the records and summary every
driver shares (:mod:`hlserve.driver.records`):

- ``agent``: closed loop. N sessions, each holding one concurrency slot; a session sends
  round r once round r−1 has completed and the tool call after it has run (``tool_time``, a
  :mod:`hlserve.driver.tool_time` distribution drawn per round; zero: at once), and round r's prompt is
  round r−1's prompt and output plus a new tool result. Lengths from
  :class:`~hlserve.driver.workloads.AgentWorkload`'s distributions, or from the chains of a
  Mooncake-format trace (``--trace``). A failed round ends its session (counted in
  ``sessions_failed``; an agent that lost a round has lost its context).
- ``coding``: closed loop like ``agent``, in text: each round quotes files of one shared
  synthetic repository and asks for an edited file (:mod:`hlserve.driver.coding_workload`); the
  prompts are the conversation rendered with the model's chat template (``--tokenizer``),
  the replies the model's own, ended by its end of turn (not pinned).
- ``chat``: open loop, Poisson arrivals at ``--request-rate`` (optionally capped at
  ``--max-concurrency`` requests in flight), single-turn, unique prompts.
- ``trace``: open-loop replay of a Mooncake-format trace by its timestamps times
  ``--time-scale``, prompts built from its hash ids so the trace's prefix sharing holds.

Requests name their session on the wire (``session_id``, ``prompt_cache_key``, ``user``, all
``hlserve-bench-<run>-s<N>``; a trace replay's chains ``...-c<N>``): every round of a
closed-loop session, and each replayed request of a Mooncake chain of two or more; single-turn
chat requests name none. ``session_ids`` False (``--no-session-ids``) sends none of them.

Every request is written to a JSONL file as it finishes (session, round, times, token
counts, error); the result JSON has vLLM ``bench serve`` keys plus session and SLO keys, and
its headline is the sessions' completion time (first round sent to last round done, tool
calls included) with the throughput beside it. Failures are counted, listed by message, and
printed: never dropped.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hlserve.bench.client import SESSION_FIELDS, BenchClient, ServerInfo, load_tokenizer
from hlserve.driver.coding_workload import ChatCodec, CodingWorkload
from hlserve.driver.machine import host
from hlserve.driver.records import SLO, Recorder, RequestRecord, headline, summarize
from hlserve.driver.tool_time import ToolTime
from hlserve.driver.trace_formats import load_trace, write_trace
from hlserve.driver.workloads import (
    AgentWorkload,
    Dist,
    MooncakeTrace,
    OpenRequest,
    PoissonChat,
    ScaledTrace,
    chains,
    trace_requests,
    trace_sessions,
)

WORKLOADS = ("agent", "coding", "chat", "trace")
CLOSED_LOOP = ("agent", "coding")
NAMES_SESSIONS = ("agent", "coding", "trace")  # workloads whose requests can name a session


@dataclass
class BenchSpec:
    """Everything a bench run needs; the CLI fills it from flags."""

    base_url: str
    model: str | None = None
    workload: str = "agent"
    # agent
    sessions: int = 16
    rounds: int = 4
    system_prompt_len: int = 512
    task_len: int = 64
    tool_output_len: tuple[int, int] = (64, 256)
    output_len: tuple[int, int] = (16, 64)
    tool_time: ToolTime = field(default_factory=ToolTime)  # between a session's rounds
    # coding (sessions, rounds as agent; max_tokens the top of output_len)
    repo_files: int = 8
    files_per_round: int = 1
    # chat
    num_prompts: int = 100
    request_rate: float = math.inf
    input_len: tuple[int, int] = (256, 1024)
    max_concurrency: int | None = None
    # trace (replay, or agent sessions from its chains)
    trace: str | None = None
    trace_format: str = "auto"  # mooncake, aiperf, inference-perf (driver/trace_formats.py)
    trace_start: float = 0.0  # seconds into the trace
    trace_limit: int | None = None
    time_scale: float = 1.0
    length_scale: float = 1.0
    output_scale: float | None = None
    # all
    vocab: tuple[int, int] = (3, 4096)
    seed: int = 0
    api_key: str | None = None
    request_class: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    ignore_eos: bool = True
    min_tokens: bool = False
    temperature: float = 0.0
    tokenizer: str | None = None
    token_prompts: bool | None = None  # None: probe
    return_token_ids: bool | None = None  # None: probe
    timeout: float = 3600.0
    session_ids: bool = True  # a session's requests carry SESSION_FIELDS (its per-run name)
    session_xargs: bool = False  # and vllm_xargs.session_id (the vLLM plugin before 0.34)
    slo: SLO = field(default_factory=SLO)
    result_file: str | None = None
    request_file: str | None = None  # per-request JSONL; default: beside result_file
    record_ids: bool = False  # put prompt and output token ids in the JSONL
    progress: bool = True
    label: str | None = None


def recorder(spec: BenchSpec, total: int) -> Recorder:
    """The run's :class:`~hlserve.driver.records.Recorder`: requests to ``--request-file``, or
    beside the result file (``<result>.requests.jsonl``)."""
    path = spec.request_file
    if path is None and spec.result_file:
        path = str(Path(spec.result_file).with_suffix("")) + ".requests.jsonl"
    return Recorder(total, path, spec.label or spec.workload, spec.progress, spec.record_ids)


def session_prefix() -> str:
    """This run's session names begin with this: unique per run, so two runs against one
    server (repeats, a sweep's points) never continue each other's sessions."""
    return f"hlserve-bench-{uuid.uuid4().hex[:8]}"


def chain_sessions(requests: list[OpenRequest], trace: MooncakeTrace, prefix: str) -> None:
    """Name each replayed request of a chain of two or more (its index is ``session_id``)
    after its chain: ``<prefix>-c<N>``; a request alone in its chain names none."""
    chain_of = {i: n for n, chain in enumerate(chains(trace)) if len(chain) > 1 for i in chain}
    for q in requests:
        n = chain_of.get(q.session_id) if q.session_id is not None else None
        q.session = None if n is None else f"{prefix}-c{n}"


async def _agent(client: BenchClient, sessions: list[Any], spec: BenchSpec, rec: Recorder,
                 prefix: str) -> None:
    async def one(session: Any) -> None:
        name = f"{prefix}-s{session.session_id}"
        started: float | None = None
        r: RequestRecord | None = None
        while not session.done:
            prompt, out_len = session.next_request()
            r = RequestRecord(request_id=f"s{session.session_id}-r{session.round}",
                              session_id=session.session_id, round=session.round)
            output = await client.complete(prompt, out_len, r, rec.t0,
                                           pin=getattr(session, "ignore_eos", True),
                                           session=name)
            if started is None:
                started = r.start
            rec.add(r, prompt, output)
            if output is None:
                rec.sessions_failed += 1
                return
            session.complete(output)
            if not session.done:
                pause = session.tool_pause(r.end - r.start)  # the tool call before the next round
                if pause > 0:
                    await asyncio.sleep(pause)
        if r is not None and started is not None:
            rec.session_times.append(r.end - started)

    await asyncio.gather(*(one(s) for s in sessions))


async def _open_loop(client: BenchClient, requests: list[OpenRequest], spec: BenchSpec,
                     rec: Recorder) -> None:
    sem = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None

    async def one(i: int, req: OpenRequest) -> None:
        delay = req.send_at - (time.perf_counter() - rec.t0)
        if delay > 0:
            await asyncio.sleep(delay)
        r = RequestRecord(request_id=f"q{i}", session_id=req.session_id, round=req.round,
                          scheduled_at=req.send_at)
        if sem is None:
            output = await client.complete(req.prompt_ids, req.output_len, r, rec.t0,
                                           session=req.session)
        else:
            async with sem:
                output = await client.complete(req.prompt_ids, req.output_len, r, rec.t0,
                                               session=req.session)
        rec.add(r, req.prompt_ids, output)

    await asyncio.gather(*(one(i, q) for i, q in enumerate(requests)))


def coding_workload(spec: BenchSpec) -> CodingWorkload:
    return CodingWorkload(sessions=spec.sessions, rounds=spec.rounds, files=spec.repo_files,
                          files_per_round=spec.files_per_round, max_tokens=spec.output_len[1],
                          seed=spec.seed, tool_time=spec.tool_time)


def chat_codec(path: str | None) -> ChatCodec:
    """hlserve's tokenizer (with the chat template) of a model directory, .gguf or named
    model: what renders the coding workload's conversations."""
    from hlserve.models.resolve import resolve_model
    from hlserve.tokenizer import Tokenizer

    if path is None:
        raise ValueError("--workload coding renders chats: it needs --tokenizer (the served "
                         "model's directory, .gguf file or name)")
    tok = Tokenizer.from_dir(resolve_model(path))
    if tok is None or not tok.chat_template:
        raise ValueError(f"{path} has no tokenizer with a chat template: --workload coding "
                         "needs one")
    return tok


def agent_sessions(spec: BenchSpec, info: ServerInfo, chat: ChatCodec | None = None,
                   ) -> tuple[list[Any], dict[str, Any]]:
    """The spec's agent sessions (generated, or a trace's chains) and what to record of them;
    with ``--workload coding`` the coding sessions, rendered by ``chat`` (default: the
    tokenizer ``--tokenizer`` names)."""
    if spec.workload == "coding":
        w = coding_workload(spec)
        return w.sessions_list(chat or chat_codec(spec.tokenizer)), {
            "coding_workload": {**asdict(w), "tool_time": spec.tool_time.spec},
            "tool_time": spec.tool_time.spec}
    if spec.trace:
        sessions = trace_sessions(_scaled_trace(spec), spec.sessions, spec.rounds,
                                  max_len=info.max_model_len, tool_time=spec.tool_time,
                                  time_scale=spec.time_scale)
        if len(sessions) < spec.sessions:
            raise ValueError(f"the trace has only {len(sessions)} chains that fit; asked for "
                             f"{spec.sessions} sessions")
        return sessions, {"trace": spec.trace, "length_scale": spec.length_scale,
                          "tool_time": spec.tool_time.spec}
    w = AgentWorkload(sessions=spec.sessions, rounds=spec.rounds,
                      system_prompt_len=spec.system_prompt_len, task_len=spec.task_len,
                      tool_output_len=spec.tool_output_len, output_len=spec.output_len,
                      vocab=spec.vocab, seed=spec.seed, tool_time=spec.tool_time)
    longest = (w.system_prompt_len + w.task_len
               + w.rounds * (w.tool_output_len[1] + w.output_len[1]))
    if info.max_model_len is not None and longest > info.max_model_len:
        raise ValueError(f"a session can reach {longest} tokens; the server's context is "
                         f"{info.max_model_len}: lower --rounds or the lengths")
    return w.sessions_list(), {"agent_workload": {**asdict(w), "tool_time": spec.tool_time.spec},
                               "tool_time": spec.tool_time.spec}


def _scaled_trace(spec: BenchSpec) -> ScaledTrace:
    trace = load_trace(spec.trace, spec.trace_format, limit=spec.trace_limit,
                       start=spec.trace_start, vocab=spec.vocab, seed=spec.seed)
    return ScaledTrace(trace, spec.length_scale, spec.output_scale)


def write_workload(spec: BenchSpec, path: str, fmt: str) -> Path:
    """``--write-trace FILE``: the agent workload the spec describes (generated, or a trace's
    chains), written as a trace in ``fmt`` without running it (driver/trace_formats.py)."""
    if spec.workload != "agent":
        raise ValueError("--write-trace writes the agent workload (token lengths); "
                         f"--workload {spec.workload} is not one")
    sessions, _ = agent_sessions(spec, ServerInfo(model=spec.model or ""))
    return write_trace(sessions, path, fmt, spec.vocab, spec.seed)


def open_requests(spec: BenchSpec, info: ServerInfo, prefix: str,
                  ) -> tuple[list[OpenRequest], dict[str, Any], float]:
    """An open-loop workload's requests (``chat``, or a ``trace`` replay whose chains name
    their sessions), what to record of it, and its request rate."""
    if spec.workload == "chat":
        w = PoissonChat(rate=spec.request_rate, num_requests=spec.num_prompts,
                        system_prompt_len=spec.system_prompt_len,
                        prompt_len=Dist.uniform(*spec.input_len),
                        output_len=Dist.uniform(*spec.output_len), vocab=spec.vocab,
                        seed=spec.seed)
        requests = [OpenRequest(a.time, a.prompt, a.max_tokens, session_id=a.key)
                    for a in w.arrivals()]
        return requests, {"chat_workload": {k: str(v) for k, v in asdict(w).items()}}, \
            spec.request_rate
    if not spec.trace:
        raise ValueError("--workload trace needs --trace FILE")
    scaled = _scaled_trace(spec)
    requests, skipped = trace_requests(scaled, spec.time_scale, info.max_model_len)
    chain_sessions(requests, scaled.trace, prefix)
    extra = {"trace": spec.trace, "time_scale": spec.time_scale,
             "length_scale": spec.length_scale, "trace_skipped_too_long": skipped}
    span = requests[-1].send_at - requests[0].send_at if requests else 0.0
    return requests, extra, len(requests) / span if span > 0 else math.inf


async def run_async(spec: BenchSpec) -> dict[str, Any]:
    if spec.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {spec.workload!r}: {', '.join(WORKLOADS)}")
    tokenizer = load_tokenizer(spec.tokenizer)
    prefix = session_prefix()
    fields = SESSION_FIELDS if spec.session_ids and spec.workload in NAMES_SESSIONS else ()
    async with BenchClient(spec.base_url, spec.model, spec.api_key, spec.timeout,
                           spec.extra_body, spec.request_class, tokenizer, spec.ignore_eos,
                           spec.min_tokens, spec.temperature, fields,
                           spec.session_xargs and bool(fields)) as client:
        info = await client.probe(spec.token_prompts, spec.return_token_ids,
                                  session=f"{prefix}-probe")
        extra: dict[str, Any] = {}
        if spec.workload in CLOSED_LOOP:
            sessions, extra = agent_sessions(spec, info)
            total = sum(len(s.rounds_spec) if hasattr(s, "rounds_spec") else s.workload.rounds
                        for s in sessions)
            rec = recorder(spec, total)
            try:
                await _agent(client, sessions, spec, rec, prefix)
            finally:
                rec.close()
            concurrency: int | None = len(sessions)
            rate = math.inf
        else:
            requests, extra, rate = open_requests(spec, info, prefix)
            rec = recorder(spec, len(requests))
            try:
                await _open_loop(client, requests, spec, rec)
            finally:
                rec.close()
            concurrency = spec.max_concurrency
    duration = max((r.end for r in rec.records), default=0.0)
    out_src = "server" if info.return_token_ids else (
        "tokenizer" if tokenizer is not None else "placeholder")
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-completions",
        "label": spec.label,
        "base_url": client.root,
        "model_id": info.model,
        "workload": spec.workload,
        "num_prompts": len(rec.records),
        "request_rate": rate if math.isfinite(rate) else "inf",
        "max_concurrency": concurrency,
        "prompt_format": "token_ids" if info.token_prompts else "text",
        "output_ids_source": out_src,
        "server_max_model_len": info.max_model_len,
        "probe": {"requests": info.probe_requests, "prompt_tokens": info.probe_prompt_tokens,
                  "output_tokens": info.probe_output_tokens},
        "notes": info.notes,
        # what named a session's requests: the fields sent, and the run's name prefix
        "session_fields": info.session_fields,
        "session_prefix": prefix if info.session_fields else None,
        "request_file": rec.path,
        "machine": host(),  # where the client ran (the server's own machine is its to tell)
        **extra,
    }
    res = summarize(rec.records, duration, spec.slo, rec.session_times, rec.sessions_failed,
                    meta)
    if spec.result_file:
        Path(spec.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(spec.result_file).write_text(json.dumps(res, indent=2) + "\n")
    return res


def run_bench(spec: BenchSpec) -> dict[str, Any]:
    """Run one benchmark to completion (``asyncio.run``) and return the result dict."""
    return asyncio.run(run_async(spec))


def cached(res: dict[str, Any]) -> str:
    """``total_cached_tokens (ratio)``, or n/a where the server reported none."""
    n, ratio = res.get("total_cached_tokens"), res.get("cached_token_ratio")
    if n is None:
        return "n/a"
    return f"{n} ({ratio:.1%})" if ratio is not None else str(n)


def format_result(res: dict[str, Any]) -> str:
    """vLLM's result block, headed by the session completion line (agent runs), plus the
    session and SLO lines."""

    def f(key: str, fmt: str = "{:.2f}") -> str:
        v = res.get(key)
        return "n/a" if v is None else fmt.format(v)

    lines = ["{:=^64}".format(f" Benchmark result: {res.get('label') or res.get('workload')} ")]
    if res.get("sessions_completed"):
        lines.append(headline(res))
    lines += [
        f"{'Successful requests:':<44}{res['completed']:>20}",
        f"{'Failed requests:':<44}{res['failed']:>20}",
        f"{'Benchmark duration (s):':<44}{f('duration'):>20}",
        f"{'Total input tokens:':<44}{res['total_input_tokens']:>20}",
        f"{'  of which cached (server-reported):':<44}{cached(res):>20}",
        f"{'Total generated tokens:':<44}{res['total_output_tokens']:>20}",
        f"{'Request throughput (req/s):':<44}{f('request_throughput'):>20}",
        f"{'Output token throughput (tok/s):':<44}{f('output_throughput'):>20}",
        f"{'Total token throughput (tok/s):':<44}{f('total_token_throughput'):>20}",
    ]
    def row(title: str, value: str) -> str:
        return f"{title:<44}{value:>20}"

    def quad(prefix: str, suffix: str, fmt: str) -> str:
        return "/".join(f(f"{how}_{prefix}_{suffix}", fmt) for how in ("mean", "median", "p90",
                                                                       "p99"))

    if res.get("sessions_completed") or res.get("sessions_failed"):
        lines += [
            row("Sessions completed / failed:",
                f"{res['sessions_completed']} / {res['sessions_failed']}"),
            row("Sessions per hour:", f("sessions_per_hour", "{:.1f}")),
            row("Session time mean/p50/p90/p99 (s):", quad("session_time", "s", "{:.1f}")),
        ]
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        lines.append(row(f"{title} mean/p50/p90/p99 (ms):", quad(name, "ms", "{:.0f}")))
    if any(res.get(k) is not None for k in ("slo_ttft_ms", "slo_tpot_ms", "slo_e2el_ms")):
        lines.append(f"{'SLO attainment:':<44}{f('slo_attainment', '{:.1%}'):>20}")
        lines.append(f"{'Request goodput (req/s):':<44}{f('request_goodput'):>20}")
    if res.get("short_outputs"):
        lines.append(f"{'Outputs shorter than asked:':<44}{res['short_outputs']:>20}")
    for note in res.get("notes") or ():
        lines.append(f"note: {note}")
    if res.get("errors"):
        lines.append("Failures (count: message):")
        lines += [f"  {n}: {msg}" for msg, n in res["errors"].items()]
    lines.append("=" * 64)
    return "\n".join(lines)
