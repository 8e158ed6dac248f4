"""Multi-turn traces in the ecosystem's formats, read into hlserve's trace
(:class:`~hlserve.driver.workloads.MooncakeTrace`) and written from hlserve's workloads.

- ``mooncake``: Mooncake's JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids`` over 512-token blocks of the whole prompt). Sessions are implicit: a request
  continues the one whose full blocks begin its own.
- ``aiperf``: AIPerf's custom datasets, one JSONL of either kind. ``mooncake_trace`` rows
  with ``session_id`` (and ``delay`` ms, or ``timestamp``): a session's turns in file order,
  each turn's ``input_length`` the new input only (AIPerf's default context mode,
  ``deltas_without_responses``: the history and the replies before it are sent again
  ahead of it). ``multi_turn`` rows: ``{"session_id", "turns": [{"text" or
  "input_length", "output_length", "delay" or "timestamp"}]}``, the same way.
- ``inference-perf``: its OpenTelemetry trace replay (``otel_trace_replay``): a JSON file with
  ``spans``, or a folder of them, each trace a session; an LLM call is a ``chat`` span with
  ``gen_ai.input.messages`` (the whole conversation), its token counts from
  ``gen_ai.usage.input_tokens`` / ``output_tokens`` (``prompt_tokens`` / ``completion_tokens``)
  or, as inference-perf estimates them, 4 characters a token; the tool time is the gap from a
  call's ``end_time`` to the next call's ``start_time``.

Reading: a session's first prompt is built from its hash ids where the trace has them (so
sessions share the system prompt the trace says they share); each later turn's prompt is the
turn before's full blocks plus new blocks, so a turn continues its session block for block.
A turn with no recorded time is sent its delay after the turn before was sent (open loop,
``--workload trace``: serving time is not known before a run); in closed loop (``--workload
agent``) the delay is the pause after the turn before ends (``--tool-time recorded``).
A turn with no output length gets 256 tokens (vLLM ``bench serve``'s custom-dataset default).

Writing (``hlserve bench --write-trace``): hlserve's sessions as they would run, each round's
prompt and output length, its hash ids (block ``i``'s id names the prompt's first ``i + 1``
blocks, so a shared prefix shares ids), and the tool time drawn after each round as the next
round's delay. Timestamps (Mooncake's, OTel's times) put each round its delay after the
round before, with no serving time: a closed loop's times are only known once it has run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from hlserve.driver.workloads import BLOCK, MooncakeTrace, pool_ids

FORMATS = ("mooncake", "aiperf", "inference-perf")
DEFAULT_OUTPUT = 256  # a turn without an output length (vLLM bench serve's custom default)
CHARS_PER_TOKEN = 4  # inference-perf's estimate, where a span records no token counts
FRESH = 1 << 40  # synthesized hash ids start here, clear of any trace's own


# ---- reading -----------------------------------------------------------------------------


def detect_format(path: str | Path) -> str:
    """The trace's format from its content: a folder, or a JSON object with ``spans``, is
    inference-perf's; JSONL rows with ``turns``, ``session_id`` or ``delay`` are AIPerf's;
    other JSONL rows, Mooncake's."""
    p = Path(path)
    if p.is_dir():
        return "inference-perf"
    text = p.read_text()
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and "spans" in whole:
        return "inference-perf"
    for line in text.splitlines():
        if line.strip():
            first = json.loads(line)
            break
    else:
        raise ValueError(f"{path}: an empty trace")
    if not isinstance(first, dict):
        raise ValueError(f"{path}: not a trace (a JSON object a line, or OTel spans)")
    if {"turns", "session_id", "delay"} & first.keys():
        return "aiperf"
    return "mooncake"


def load_trace(path: str | Path, fmt: str = "auto", **kw: Any) -> MooncakeTrace:
    """A trace in any of :data:`FORMATS` (``auto``: :func:`detect_format`) as hlserve's
    trace; ``kw`` as :meth:`MooncakeTrace.load` takes them (slice, vocabulary, seed)."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "mooncake":
        return MooncakeTrace.load(path, **kw)
    if fmt == "aiperf":
        sessions = _aiperf_sessions(path)
    elif fmt == "inference-perf":
        sessions = _otel_sessions(path)
    else:
        raise ValueError(f"unknown trace format {fmt!r}: auto, {', '.join(FORMATS)}")
    return MooncakeTrace.from_rows(session_rows(sessions), **kw)


def _turn(input_length: int, output_length: int | None, delay_ms: float | None,
          timestamp_ms: float | None, hash_ids: list[int] | None, full: bool = False
          ) -> dict[str, Any]:
    return {"input": int(input_length), "output": int(output_length or DEFAULT_OUTPUT),
            "delay": delay_ms, "timestamp": timestamp_ms, "hash_ids": hash_ids, "full": full}


def _text_len(turn: dict[str, Any]) -> int:
    """Tokens of an AIPerf turn's text (4 characters a token): ``text`` or ``texts``."""
    texts = turn.get("texts") or [turn.get("text") or ""]
    chars = 0
    for t in texts:
        chars += len(t) if isinstance(t, str) else sum(len(c) for c in t.get("contents", []))
    return max(1, chars // CHARS_PER_TOKEN)


def _aiperf_sessions(path: str | Path) -> list[list[dict[str, Any]]]:
    """AIPerf's rows as sessions of turns (input lengths the new input of each turn)."""
    sessions: dict[str, list[dict[str, Any]]] = {}
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            sid = str(row.get("session_id") or f"row-{n}")  # AIPerf: a fresh id per row
            turns = row.get("turns", [row])
            for t in turns:
                if t.get("role") == "system":  # a leading system turn: part of the prompt
                    continue
                n_in = t["input_length"] if t.get("input_length") is not None else _text_len(
                    {**t, "text": t.get("text") or t.get("text_input")})
                sessions.setdefault(sid, []).append(_turn(
                    n_in, t.get("output_length") or t.get("max_tokens"), t.get("delay"),
                    t.get("timestamp"), t.get("hash_ids")))
    return list(sessions.values())


def _otel_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.json")) if path.is_dir() else [path]


def _iso(ts: str) -> float:
    t = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def _llm_span(span: dict[str, Any]) -> bool:
    attrs = span.get("attributes") or {}
    chat = attrs.get("gen_ai.operation.name") == "chat" or str(span.get("name", "")).startswith(
        "chat ")
    return chat and bool(attrs.get("gen_ai.input.messages")) and \
        (span.get("status") or {}).get("code", 0) != 2


def _tokens(attrs: dict[str, Any], keys: tuple[str, ...], text: str) -> int:
    for k in keys:
        if attrs.get(k) is not None:
            return int(attrs[k])
    return max(1, len(text) // CHARS_PER_TOKEN)


def _messages_text(raw: Any) -> str:
    msgs = json.loads(raw) if isinstance(raw, str) else raw
    parts = []
    for m in msgs:
        c = m.get("content")
        parts.append(c if isinstance(c, str) else json.dumps(c) if c is not None else "")
    return "".join(parts)


def _otel_sessions(path: str | Path) -> list[list[dict[str, Any]]]:
    """inference-perf's OTel traces as sessions: each trace's chat spans by start time, whole
    prompts (``full``), the gap from a call's end to the next call's start its delay."""
    by_trace: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for i, f in enumerate(_otel_files(Path(path))):
        for span in json.loads(f.read_text()).get("spans", []):
            if _llm_span(span):
                by_trace.setdefault((i, str(span.get("trace_id"))), []).append(span)
    if not by_trace:
        raise ValueError(f"{path}: no chat spans with gen_ai.input.messages")
    t0 = min(_iso(s["start_time"]) for spans in by_trace.values() for s in spans)
    out = []
    for spans in by_trace.values():
        spans.sort(key=lambda s: _iso(s["start_time"]))
        turns, end = [], None
        for s in spans:
            a, start = s["attributes"], _iso(s["start_time"])
            n_in = _tokens(a, ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"),
                           _messages_text(a["gen_ai.input.messages"]))
            n_out = _tokens(a, ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"),
                            str(a.get("gen_ai.output.text") or ""))
            if not (a.get("gen_ai.output.text") or a.get("gen_ai.usage.output_tokens")
                    or a.get("gen_ai.usage.completion_tokens")):
                n_out = a.get("gen_ai.request.max_tokens") or DEFAULT_OUTPUT
            delay = None if end is None else 1e3 * max(0.0, start - end)
            turns.append(_turn(n_in, n_out, delay, 1e3 * (start - t0) if end is None else None,
                               None, full=True))
            end = _iso(s.get("end_time") or s["start_time"])
        out.append(turns)
    return out


def session_rows(sessions: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Mooncake rows (with ``parent`` and ``delay``) of sessions of turns, by time: whole
    input lengths, hash ids continuing the turn before block for block (module docstring)."""
    fresh = iter(range(FRESH, FRESH + (1 << 40)))
    rows: list[dict[str, Any]] = []
    for turns in sessions:
        prev: dict[str, Any] | None = None
        t = 0.0
        for turn in turns:
            if prev is None:
                n = turn["input"]
                ids = list(turn["hash_ids"] or [])
                t = turn["timestamp"] or 0.0
            else:
                n = turn["input"] if turn["full"] else prev["input_length"] + \
                    prev["output_length"] + turn["input"]
                ids = prev["hash_ids"][: prev["input_length"] // BLOCK]
                t = turn["timestamp"] if turn["timestamp"] is not None else \
                    t + (turn["delay"] or 0.0)
            ids += [next(fresh) for _ in range(max(0, -(-n // BLOCK) - len(ids)))]
            row = {"timestamp": t, "input_length": n, "output_length": turn["output"],
                   "hash_ids": ids, "parent": None if prev is None else prev["_i"],
                   "delay": None if prev is None else (turn["delay"] or 0.0), "_i": len(rows)}
            rows.append(row)
            prev = row
    # by time, a session's turns in order where times tie; parents are row indices
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["timestamp"], i))
    at = {i: k for k, i in enumerate(order)}
    return [{**rows[i], "parent": None if rows[i]["parent"] is None else at[rows[i]["parent"]]}
            for i in order]


# ---- writing -----------------------------------------------------------------------------


def workload_turns(sessions: list[Any], vocab: tuple[int, int] = (3, 4096),
                   seed: int = 0) -> Iterator[tuple[int, int, list[int], int, float]]:
    """(session, round, prompt ids, output length, delay s before it) of each round of
    hlserve's sessions (:class:`~hlserve.driver.workloads.AgentSession` or a trace's), run
    without a server: a round's output is ``output length`` ids drawn for it, and the tool
    time after a round (its own draw) is the next round's delay."""
    import random

    for s in sessions:
        delay = 0.0
        while not s.done:
            r = s.round
            prompt, n_out = s.next_request()
            yield s.session_id, r, prompt, n_out, delay
            s.complete(pool_ids(random.Random(seed * 7919 + s.session_id * 131 + r), n_out,
                                vocab, seed))
            delay = s.tool_pause(0.0) if not s.done else 0.0


class _Blocks:
    """Mooncake hash ids: block ``i`` of a prompt is named by its first ``i + 1`` blocks."""

    def __init__(self) -> None:
        self.ids: dict[tuple[Any, ...], int] = {}

    def __call__(self, prompt: list[int]) -> list[int]:
        out, key = [], ()
        for i in range(0, len(prompt), BLOCK):
            key = (key and self.ids[key], tuple(prompt[i:i + BLOCK]))
            out.append(self.ids.setdefault(key, len(self.ids)))
        return out


def write_trace(sessions: list[Any], path: str | Path, fmt: str,
                vocab: tuple[int, int] = (3, 4096), seed: int = 0) -> Path:
    """hlserve's sessions as a trace in ``fmt`` (module docstring); inference-perf's is a
    folder of one OTel JSON file a session (its ``trace_directory``)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}: {', '.join(FORMATS)}")
    blocks, out = _Blocks(), Path(path)
    rows: list[dict[str, Any]] = []
    last: dict[int, tuple[float, int, int]] = {}  # session: (time, prompt, output) so far
    for sid, r, prompt, n_out, delay in workload_turns(sessions, vocab, seed):
        t0, n0, o0 = last.get(sid, (0.0, 0, 0))
        t = t0 + delay
        ids = blocks(prompt)
        row: dict[str, Any] = {"session": sid, "round": r, "time": t, "input": len(prompt),
                               "new": len(prompt) - (n0 + o0 if r else 0), "output": n_out,
                               "delay": delay, "hash_ids": ids, "first": (n0 + o0) // BLOCK}
        rows.append(row)
        last[sid] = (t, len(prompt), n_out)
    if fmt == "inference-perf":
        return _write_otel(rows, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for row in (sorted(rows, key=lambda x: x["time"]) if fmt == "mooncake" else rows):
            f.write(json.dumps(_jsonl_row(row, fmt)) + "\n")
    return out


def _jsonl_row(row: dict[str, Any], fmt: str) -> dict[str, Any]:
    if fmt == "mooncake":
        return {"timestamp": round(1e3 * row["time"]), "input_length": row["input"],
                "output_length": row["output"], "hash_ids": row["hash_ids"]}
    # AIPerf's mooncake_trace in sessions: the new input, its blocks, the delay in ms (ints)
    out = {"session_id": f"s{row['session']}", "input_length": row["new"],
           "output_length": row["output"],
           "hash_ids": row["hash_ids"] if row["round"] == 0 else row["hash_ids"][row["first"]:]}
    if row["round"]:
        out["delay"] = round(1e3 * row["delay"])
    return out


def _filler(n: int, tag: str) -> str:
    """Text of ``n`` tokens at 4 characters a token, ``tag`` first (unique per message)."""
    head = f"{tag} "
    return (head + "tok " * n)[: max(len(head), CHARS_PER_TOKEN * n)]


def _write_otel(rows: list[dict[str, Any]], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    base = datetime(2025, 1, 1, tzinfo=timezone.utc)
    by_session: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_session.setdefault(row["session"], []).append(row)
    for sid, turns in by_session.items():
        trace, messages, spans = f"hlserve-s{sid}", [], []
        for row in turns:
            if messages:
                messages.append({"role": "assistant",
                                 "content": _filler(turns[row["round"] - 1]["output"],
                                                    f"s{sid}r{row['round'] - 1}a")})
            messages.append({"role": "user", "content": _filler(row["new"],
                                                                f"s{sid}r{row['round']}u")})
            at = (base + timedelta(seconds=row["time"])).isoformat()
            spans.append({
                "trace_id": trace, "span_id": f"s{sid}-r{row['round']}", "parent_span_id": None,
                "name": "chat hlserve", "start_time": at, "end_time": at,
                "attributes": {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.request.max_tokens": row["output"],
                    "gen_ai.usage.input_tokens": row["input"],
                    "gen_ai.usage.output_tokens": row["output"],
                    "gen_ai.input.messages": json.dumps(messages),
                    "gen_ai.output.text": _filler(row["output"], f"s{sid}r{row['round']}a")},
                "status": {"code": 1, "message": ""}})
        (out / f"session-{sid}.json").write_text(json.dumps(
            {"trace_id": trace, "span_count": len(spans), "spans": spans}, indent=1) + "\n")
    return out
