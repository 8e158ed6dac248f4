"""``hlserve demo --agent``: agent sessions on the real model (SmolLM2-135M-Instruct), each a
multi-turn tool loop through the official ``openai`` SDK against two ``hlserve serve``
processes, one in SLO mode and one in throughput mode, interleaved repeats with intervals.

A session is a task with a plan of tool steps. Each step asks the model for a call with
``tool_choice`` naming the step's tool: the grammar makes the arguments valid JSON of the
tool's schema (a 135M model cannot be relied on to pick the tool or to write the JSON itself,
but it does fill the arguments). The call is executed by a local Python tool (a calculator, a
file read over a small corpus, a word count), its result fed back as a ``tool`` message, and
a last turn without tools asks for the answer. A task is complete when that answer holds the
expected value, which only a tool's result gives.
"""

from __future__ import annotations

import ast
import json
import operator
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlserve.driver.repeats import RepeatPlan, Run, run_repeats
from hlserve.driver.stats import ci_table

CORPUS: dict[str, str] = {
    "paris.txt": "Paris is the capital of France. The Seine flows through the city, and the "
                 "Eiffel Tower was finished in 1889.",
    "rivers.txt": "The Nile, the Amazon and the Yangtze are the three longest rivers on Earth.",
    "recipe.txt": "Mix two cups of flour with one cup of water, knead for ten minutes and "
                  "bake at two hundred degrees for thirty minutes.",
}

SYSTEM = ("You are an assistant that uses tools. Tools: calculator(expression) evaluates "
          "arithmetic; read_file(path) returns a file of the corpus; word_count(path) counts the "
          "words of a file. After the tool results, answer in one short sentence.")


def _tool_schema(name: str, desc: str, arg: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {arg: {"type": "string", **extra}},
                       "required": [arg], "additionalProperties": False}}}


TOOLS = [
    _tool_schema("calculator", "evaluate an arithmetic expression", "expression",
                 {"pattern": r"^[0-9+*/(). -]{1,40}$"}),
    _tool_schema("read_file", "read a file of the corpus", "path", {"enum": sorted(CORPUS)}),
    _tool_schema("word_count", "count the words of a file", "path", {"enum": sorted(CORPUS)}),
]

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of ``+ - * /`` arithmetic (an AST walk, never ``eval``)."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("not arithmetic")

    try:
        v = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(v)) if float(v).is_integer() else f"{v:.4g}"


@dataclass(frozen=True)
class Task:
    prompt: str
    plan: tuple[str, ...]  # the tool of each step
    expected: str  # what the final answer must contain


TASKS = (
    Task("Use the calculator to compute 17 * 23 + 4.", ("calculator",), "395"),
    Task("What city is described in the file paris.txt? Read it.", ("read_file",), "Paris"),
    Task("How many words does the file rivers.txt have?", ("word_count",),
         str(len(CORPUS["rivers.txt"].split()))),
    Task("Use the calculator: what is 128 / 4 - 7?", ("calculator",), "25"),
    Task("Read recipe.txt and count its words.", ("read_file", "word_count"),
         str(len(CORPUS["recipe.txt"].split()))),
)


@dataclass
class Tools:
    """The local tools, reading a copy of the corpus on disk."""

    root: Path
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, name: str, args: dict[str, Any]) -> str:
        with self.lock:
            self.calls += 1
        if name == "calculator":
            return calculate(str(args["expression"]))
        text = (self.root / str(args["path"])).read_text()
        return text if name == "read_file" else str(len(text.split()))


@dataclass
class SessionResult:
    task: Task
    messages: list[dict[str, Any]]
    answer: str
    tool_calls: int
    seconds: float

    @property
    def complete(self) -> bool:
        return self.task.expected.lower() in self.answer.lower()


def run_session(client: Any, model: str, task: Task, tools: Tools) -> SessionResult:
    """One agent session: a forced tool call per plan step, each executed and fed back, then
    the answer."""
    t0 = time.perf_counter()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": task.prompt}]
    calls = 0
    for step in task.plan:
        r = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, temperature=0.0, max_tokens=48,
            tool_choice={"type": "function", "function": {"name": step}})
        msg = r.choices[0].message
        call = msg.tool_calls[0]
        args = json.loads(call.function.arguments)  # the grammar made it parse
        result = tools.run(call.function.name, args)
        calls += 1
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [{"id": call.id, "type": "function", "function": {
                             "name": call.function.name, "arguments": call.function.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    r = client.chat.completions.create(model=model, messages=messages, temperature=0.0,
                                       max_tokens=40)
    answer = r.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": answer})
    return SessionResult(task, messages, answer, calls, time.perf_counter() - t0)


@dataclass(frozen=True)
class AgentSpec:
    model: str = "smollm2-135m"
    sessions: int = 4
    repeats: int = 3
    seed: int = 0
    server_args: tuple[str, ...] = ("--dtype", "float32", "--max-model-len", "2048")


def one_run(url: str, spec: AgentSpec, tools: Tools, seed: int,
            keep: list[SessionResult] | None = None) -> dict[str, Any]:
    """``spec.sessions`` concurrent sessions (tasks rotated by ``seed``): session throughput,
    task completion and whether every call parsed and ran."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    tasks = [TASKS[(seed + i) % len(TASKS)] for i in range(spec.sessions)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(spec.sessions) as pool:
        results = list(pool.map(lambda t: run_session(client, spec.model, t, tools), tasks))
    wall = time.perf_counter() - t0
    if keep is not None:
        keep.extend(results)
    return {"sessions_per_min": 60 * len(results) / wall,
            "task_completion": sum(r.complete for r in results) / len(results),
            "tool_calls": sum(r.tool_calls for r in results),
            "median_session_s": sorted(r.seconds for r in results)[len(results) // 2]}


def transcript(s: SessionResult) -> str:
    lines = []
    for m in s.messages:
        if m.get("tool_calls"):
            f = m["tool_calls"][0]["function"]
            lines.append(f"  assistant -> {f['name']}({f['arguments']})")
        else:
            lines.append(f"  {m['role']:<9}: {m['content']}")
    lines.append(f"  task {'complete' if s.complete else 'NOT complete'} "
                 f"(expected {s.task.expected!r})")
    return "\n".join(lines)


def _servers(spec: AgentSpec, log: Callable[[str], None]) -> dict[str, Any]:
    from hlserve.server.runtime.launch import ServerProcess

    log(f"starting two hlserve serve processes on {spec.model} (SLO mode, throughput mode) ...")
    return {name: ServerProcess(spec.model, [*spec.server_args, "--mode", mode],
                                start_timeout=300.0)
            for name, mode in (("slo", "slo"), ("throughput", "throughput"))}


def run_agent_demo(spec: AgentSpec, log: Callable[[str], None] = print) -> dict[str, Any]:
    from hlserve.models.resolve import resolve_model

    t0 = time.perf_counter()
    resolve_model(spec.model)  # convert once here, not in both servers at the same time
    servers = _servers(spec, log)
    kept: list[SessionResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in CORPUS.items():
            (Path(tmp) / name).write_text(text)
        tools = Tools(Path(tmp))
        try:
            with ThreadPoolExecutor(len(servers)) as pool:  # both load at once
                list(pool.map(lambda s: s.start(), servers.values()))
            log(f"  servers up ({time.perf_counter() - t0:.0f} s); {spec.sessions} concurrent "
                f"sessions a run, {spec.repeats} repeats a mode, interleaved")
            res = _measure(spec, servers, tools, kept, log)
        finally:
            for s in servers.values():
                s.stop()
    log("\none session's transcript:\n" + transcript(kept[0]))
    log("\n" + agent_table(res))
    log(f"tool calls executed: {tools.calls}, every one parsed as JSON of its schema")
    log(f"({time.perf_counter() - t0:.0f} s)")
    res["tool_calls_executed"] = tools.calls
    return res


def _measure(spec: AgentSpec, servers: dict[str, Any], tools: Tools,
             kept: list[SessionResult], log: Callable[[str], None]) -> dict[str, Any]:
    done = [0]
    total = 2 * spec.repeats + 1

    def run(url: str, seed: int) -> dict[str, Any]:
        return one_run(url, spec, tools, seed, kept if not kept else None)

    def on_run(r: Run[Any], res: Any) -> None:
        done[0] += 1
        what = "warm-up, excluded" if r.warmup else f"repeat {r.repeat + 1}"
        val = (f"error: {res}" if isinstance(res, BaseException) else
               f"{res['sessions_per_min']:.1f} sessions/min, "
               f"{100 * res['task_completion']:.0f}% complete")
        log(f"  [{done[0]}/{total}] {r.name:<10} ({what}): {val}")

    urls = {name: s.url for name, s in servers.items()}
    return run_repeats(urls, run, RepeatPlan(repeats=spec.repeats, base_seed=spec.seed),
                       baseline="slo", ratio_metrics=("sessions_per_min",), on_run=on_run)


def agent_table(res: dict[str, Any]) -> str:
    rows = ci_table(res["configs"], ("mode", 12), [
        ("sessions/min", "sessions_per_min", "{:.1f}", 18),
        ("task completion", "task_completion", "{:.2f}", 20),
        ("session p50 s", "median_session_s", "{:.1f}", 18)])
    r = res["ratios"].get("throughput", {}).get("sessions_per_min")
    rows.append("(mean ± 95% interval half-width over the repeats)")
    if r is not None:
        rows.append(f"throughput mode against SLO mode, sessions/min: {r['text']}")
    for name, errs in res["errors"].items():
        rows.append(f"{name}: {len(errs)} failed run(s): {errs[0]}")
    return "\n".join(rows)
