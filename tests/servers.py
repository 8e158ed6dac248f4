"""Helpers for tests on real ``hlserve serve`` processes: SSE streams read line by line,
metrics parsed, the process's resident memory."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hlserve.server.runtime.launch import ExternalServer, free_port

HERE = Path(__file__).parent
BASE_ARGS = ["--dtype", "float32", "--uvicorn-log-level", "warning", "--cpu-threads", "1"]


def faulty_server(fault: str, model: Path, args: list[str], log_path: Path) -> ExternalServer:
    port = free_port()
    cmd = [sys.executable, str(HERE / "faulty_server.py"), fault, "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port), *BASE_ARGS, *args]
    return ExternalServer(cmd, "127.0.0.1", port, log_path, health_timeout=120,
                          stop_timeout=15)


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    """Each ``data:`` payload of a stream: a dict, or the string ``[DONE]``."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def read_stream(r: httpx.Response, lines: Iterator[str] | None = None) -> dict:
    """A whole stream (or its rest, from ``lines``): its token ids, finish reason, error (if
    any), and whether it ended with [DONE]."""
    out: dict = {"ids": [], "finish_reason": None, "error": None, "done": False}
    for ev in sse_events(lines if lines is not None else r.iter_lines()):
        if ev == "[DONE]":
            out["done"] = True
            break
        if "error" in ev:
            out["error"] = ev["error"]
            continue
        for c in ev["choices"]:
            out["ids"] += c.get("token_ids") or []
            out["finish_reason"] = c.get("finish_reason") or out["finish_reason"]
    return out


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")
