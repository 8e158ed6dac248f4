"""Flags and entry points of ``hlserve bench`` and ``hlserve sweep`` (docs/bench.md).

``hlserve.cli.commands.build_parser`` adds the two subcommands with :func:`add_bench_args` /
:func:`cmd_bench` and :func:`add_sweep_args` / :func:`cmd_sweep`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from hlserve.driver.records import SLO
from hlserve.driver.repeats import add_repeat_args
from hlserve.request import REQUEST_CLASSES


def parse_range(text: str) -> tuple[int, int]:
    """``N`` or ``LO:HI`` (inclusive)."""
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI with 0 < LO <= HI, got {text}")
    return a, b


def _floats(text: str) -> list[float | None]:
    return [None if t.strip().lower() in ("none", "") else float(t) for t in text.split(",")]


def tool_time_arg(text: str) -> Any:
    """``--tool-time SPEC`` (:mod:`hlserve.driver.tool_time`), checked when the flags are read."""
    from hlserve.driver.tool_time import parse_tool_time

    try:
        return parse_tool_time(text)
    except (ValueError, OSError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj


def _add_workload_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    g = p.add_argument_group("workload")
    if not sweep:
        g.add_argument("--workload", choices=["agent", "coding", "chat", "trace"],
                       default="agent",
                       help="agent: closed-loop sessions; coding: closed-loop sessions editing "
                            "files of a shared repository, in text through the chat template "
                            "(needs --tokenizer); chat: open-loop Poisson; trace: "
                            "Mooncake-format replay by timestamps (default: agent)")
    else:
        g.add_argument("--workload", choices=["agent", "coding"], default="agent",
                       help="agent: closed-loop sessions; coding: sessions editing files of "
                            "a shared repository, in text through the model's chat template "
                            "(default: agent)")
    g.add_argument("--sessions", type=int, default=16,
                   help="agent: concurrent sessions, one slot each (default: 16)")
    g.add_argument("--rounds", type=int, default=4,
                   help="agent: rounds per session (with --trace: at most) (default: 4)")
    g.add_argument("--system-prompt-len", type=int, default=512,
                   help="agent: shared system prompt / tool definitions; chat: shared system "
                        "prompt (default: 512)")
    g.add_argument("--task-len", type=int, default=64, help="agent: unique task (default: 64)")
    g.add_argument("--tool-output-len", type=parse_range, default=(64, 256), metavar="LO:HI",
                   help="agent: new tokens per round (default: 64:256)")
    g.add_argument("--output-len", type=parse_range, default=(16, 64), metavar="LO:HI",
                   help="generated tokens per request, pinned with ignore_eos; coding: "
                        "max_tokens is HI, replies end at the model's end of turn "
                        "(default: 16:64)")
    g.add_argument("--tool-time", type=tool_time_arg, default=None, metavar="SPEC",
                   help="agent: the tool call between a round's end and the next round, drawn "
                        "per round from the workload seed: fixed:S (or S), exp:MEAN, "
                        "lognormal:MEDIAN:SIGMA, empirical:FILE (seconds, one a line), "
                        "recorded (with --trace: each chain's own gaps less the round's serving) "
                        "(default: 0, the next round at once)")
    g.add_argument("--repo-files", type=int, default=8,
                   help="coding: files in the shared repository (default: 8)")
    g.add_argument("--files-per-round", type=int, default=1,
                   help="coding: files quoted per round, the last one edited (default: 1)")
    if not sweep:
        g.add_argument("--think-time", type=float, default=None, metavar="S",
                       help="agent: the same as --tool-time fixed:S (kept for old command "
                            "lines)")
        g.add_argument("--num-prompts", type=int, default=100, help="chat: requests")
        g.add_argument("--request-rate", type=float, default=math.inf,
                       help="chat: requests per second, Poisson (default: inf, all at once)")
        g.add_argument("--input-len", type=parse_range, default=(256, 1024), metavar="LO:HI",
                       help="chat: prompt tokens (default: 256:1024)")
        g.add_argument("--max-concurrency", type=int, default=None,
                       help="chat/trace: at most this many requests in flight")
        g.add_argument("--time-scale", type=float, default=1.0,
                       help="trace: request i is sent at t_i / this: 2 replays twice as fast "
                            "(default: 1)")
    g.add_argument("--trace", default=None,
                   help="a multi-turn trace (Mooncake's, AIPerf's or inference-perf's "
                        "format): replayed (--workload trace), or its sessions as agent "
                        "sessions (--workload agent)")
    g.add_argument("--trace-format", default="auto",
                   choices=["auto", "mooncake", "aiperf", "inference-perf"],
                   help="the format of --trace, or the one --write-trace writes (default: "
                        "auto: read from the file; --write-trace: mooncake)")
    g.add_argument("--trace-start", type=float, default=0.0,
                   help="trace: seconds into the trace to start from (default: 0)")
    g.add_argument("--trace-limit", type=int, default=None, help="trace: requests used")
    g.add_argument("--length-scale", type=float, default=1.0,
                   help="trace: multiply prompt lengths (and 512-token blocks) by this")
    g.add_argument("--output-scale", type=float, default=None,
                   help="trace: multiply output lengths by this (default: --length-scale)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--vocab", type=parse_range, default=(3, 4096), metavar="LO:HI",
                   help="token ids drawn from [LO, HI) (default: 3:4096)")


def _add_slo_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SLO")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT target (goodput)")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT target (goodput)")
    g.add_argument("--slo-e2el-ms", type=float, default=None, help="E2E latency target")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server, with or without /v1 (default: http://127.0.0.1:8000)")
    g.add_argument("--model", default=None, help="model name (default: the first served)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--request-class", choices=list(REQUEST_CLASSES), default=None,
                   help="sent as X-Request-Class (hlserve); other servers ignore it")
    g.add_argument("--tokenizer", default=None,
                   help="model directory, .gguf file, smollm2-135m or tokenizer.json: text "
                        "prompts for servers that "
                        "refuse token ids, output ids for servers that do not return them")
    g.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                   help="auto: token ids if the server takes them (default)")
    g.add_argument("--no-return-token-ids", action="store_true",
                   help="do not ask the server for output token ids")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (output lengths are then not pinned)")
    g.add_argument("--min-tokens", action="store_true",
                   help="also send min_tokens = max_tokens (servers without ignore_eos)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", type=_json_object, default={},
                   help="JSON object merged into every request body")
    g.add_argument("--session-xargs", action="store_true",
                   help="also name the session in vllm_xargs.session_id: what hlserve's vLLM "
                        "plugin reads on vLLM 0.32 and 0.33, whose OpenAI API passes no "
                        "session field to the scheduler (docs/vllm.md)")
    g.add_argument("--no-session-ids", dest="session_ids", action="store_false",
                   help="send no session names. By default every round of an agent/coding "
                        "session (and each trace replay request of a chain) carries "
                        "session_id, prompt_cache_key and user, all set to "
                        "hlserve-bench-<run>-s<N> (trace chains: -c<N>), so a server that "
                        "keeps a session's KV between rounds (hlserve serve --session-ttl) "
                        "can (OpenAI's API reads prompt_cache_key and user); chat "
                        "requests carry none. A field the server refuses in the probe (an "
                        "error naming it) is dropped from every request, with a note in the "
                        "result")
    g.add_argument("--timeout", type=float, default=3600.0, help="per request, seconds")
    _add_workload_args(p)
    _add_slo_args(p)
    add_repeat_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--result-file", default=None, help="result JSON (vLLM bench serve keys)")
    o.add_argument("--request-file", default=None,
                   help="per-request JSONL (default: RESULT.requests.jsonl beside --result-file)")
    o.add_argument("--write-trace", default=None, metavar="FILE",
                   help="write the agent workload (its sessions, rounds, lengths, hash ids "
                        "and tool times) as a trace in --trace-format and exit, without "
                        "running it; inference-perf's is a folder of OTel JSON files")
    o.add_argument("--record-ids", action="store_true",
                   help="write prompt and output token ids into the per-request JSONL")
    o.add_argument("--label", default=None, help="a name for this run, kept in the result")
    add_report_arg(o)
    o.add_argument("--no-progress", dest="progress", action="store_false")


def add_report_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--report FILE.html`` of bench, sweep and study (hlserve.html_report)."""
    p.add_argument("--report", default=None, metavar="FILE.html",
                   help="also write the result as one self-contained HTML page (charts with "
                        "each point's configuration on hover; opens offline)")


def bench_spec(args: argparse.Namespace) -> Any:
    """A BenchSpec from the flags parsed: every field whose flag this command has (the sweep
    has fewer than ``hlserve bench``), the rest at BenchSpec's own defaults."""
    from hlserve.bench.serve_bench import BenchSpec

    given = vars(args)
    fields = {f.name for f in dataclasses.fields(BenchSpec)}
    kw: dict[str, Any] = {k: given[k] for k in fields & given.keys()}
    kw.setdefault("base_url", "")
    kw["model"] = given.get("model_name") or given.get("model")
    if "prompt_format" in given:
        kw["token_prompts"] = {"auto": None, "ids": True, "text": False}[given["prompt_format"]]
    if given.get("no_return_token_ids"):
        kw["return_token_ids"] = False
    kw["slo"] = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
    kw["tool_time"] = _tool_time(given)
    return BenchSpec(**kw)


def _tool_time(given: dict[str, Any]) -> Any:
    """``--tool-time``, or ``--think-time S`` as ``fixed:S``; both at once is an error."""
    from hlserve.driver.tool_time import ToolTime, parse_tool_time

    spec, think = given.get("tool_time"), given.get("think_time")
    if spec is not None and think is not None:
        raise ValueError("--think-time S is --tool-time fixed:S: give one of them")
    if think is not None:
        return parse_tool_time(think)
    return ToolTime() if spec is None else spec


def cmd_bench(args: argparse.Namespace) -> None:
    """Run one benchmark; print vLLM's result block; exit 1 if any request failed."""
    from hlserve.bench.client import ProbeError
    from hlserve.bench.serve_bench import format_result, run_bench, write_workload

    if args.write_trace:
        fmt = "mooncake" if args.trace_format == "auto" else args.trace_format
        path = write_workload(bench_spec(args), args.write_trace, fmt)
        print(f"wrote {path} ({fmt})")
        return
    try:
        if args.repeats > 1:
            from hlserve.bench.repeated import format_repeats, run_bench_repeated

            res = run_bench_repeated(bench_spec(args), args.repeats)
        else:
            res = run_bench(bench_spec(args))
    except ProbeError as e:
        print(f"hlserve bench: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(format_result(res))
    if args.repeats > 1:
        print(format_repeats(res))
    if args.report:
        from hlserve.html_report.load import from_bench
        from hlserve.html_report.page import write

        path = Path(args.result_file) if args.result_file else None
        print(f"report: {write(from_bench(res, path), args.report)}")
    if args.result_file:
        print(f"result: {args.result_file}; requests: {res.get('request_file')}")
    if res.get("repeat_errors"):
        print("hlserve bench: repeats failed: " + "; ".join(res["repeat_errors"]), file=sys.stderr)
        raise SystemExit(1)
    if res["failed"]:
        print(f"hlserve bench: {res['failed']} request(s) failed "
              f"({res['sessions_failed']} session(s) abandoned)", file=sys.stderr)
        raise SystemExit(1)


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("points")
    g.add_argument("--model", required=True,
                   help="model directory (in-process, {model} of --server-cmd), or a model "
                        "name of the simulator (--sim)")
    g.add_argument("--chunk-sizes", default="64,256,1024,none",
                   help="C values, 'none' = no cap (default: 64,256,1024,none)")
    g.add_argument("--token-budgets", default="same",
                   help="B values: 'same' (B = C, vLLM's one knob), 'none', or a list "
                        "(a grid C x B) (default: same)")
    g.add_argument("--add-point", action="append", default=[], metavar="LABEL=FLAGS",
                   help="one more point with its own engine flags (in-process) or {args} "
                        "(server), e.g. 'throughput=--mode throughput'; repeatable")
    g.add_argument("--engine-args", default="",
                   help="hlserve engine flags common to every in-process point, e.g. "
                        "'--preset vllm --dtype bfloat16 --max-model-len 4096'")
    g.add_argument("--sim", default=None, metavar="HARDWARE",
                   help="simulated runner on this hardware (e.g. H20; needs hlserve.sim)")
    g.add_argument("--tp", type=int, default=1, help="--sim: tensor-parallel degree")
    g.add_argument("--server-cmd", default=None,
                   help="start this server per point instead (a template: {model} {host} "
                        "{port} {chunk_size} {token_budget} {label} {args}; no cap is put "
                        "as none: for a server without that word, e.g. vLLM, list its number, "
                        "such as the model length)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads of the engine: torch.set_num_threads in-process, "
                        "OMP_NUM_THREADS for --server-cmd (default: torch's). On a machine "
                        "shared with other jobs, fewer threads than cores avoids OpenMP "
                        "oversubscription")
    g.add_argument("--health-timeout", type=float, default=600.0,
                   help="--server-cmd: seconds to wait for /health (default: 600)")
    g.add_argument("--served-model-name", dest="model_name", default=None,
                   help="--server-cmd: the model name to request (default: the first served)")
    _add_workload_args(p, sweep=True)
    _add_slo_args(p)
    add_repeat_args(p, ray=True)
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("results/sweep"),
                   help="output folder (default: results/sweep)")
    o.add_argument("--targets", default=None, metavar="TTFT:TPOT,...",
                   help="SLO targets of the tax table, ms, p99 (e.g. '500:none,2000:200'); "
                        "default: each point's own p99 TTFT and TPOT")
    o.add_argument("--slo-tiers", default=None, metavar="NAME=TTFT_S/TPOT_MS,...",
                   help="the tiers of the agents-per-node table in tax.md and sweep.json "
                        "(seconds / ms, none: no target) (default: interactive=0.5/50,"
                        "production=2/100,relaxed=10/250, and none)")
    o.add_argument("--title", default="", help="title of the frontier plot")
    add_report_arg(o)
    o.add_argument("--no-progress", dest="progress", action="store_false")


def _targets(text: str | None) -> list[tuple[float | None, float | None]] | None:
    if not text:
        return None
    out = []
    for part in text.split(","):
        a, _, b = part.partition(":")
        ttft = _floats(a)[0]
        tpot = _floats(b)[0] if b else None
        out.append((ttft, tpot))
    return [*out, (None, None)]


def cmd_sweep(args: argparse.Namespace) -> None:
    from hlserve.bench.sweep import SweepSpec, make_points, parse_sizes, run_sweep
    from hlserve.driver.tiers import DEFAULT_TIERS, parse_tiers

    points = make_points(parse_sizes(args.chunk_sizes), args.token_budgets, args.add_point)
    spec = bench_spec(args)
    spec.model = args.model_name
    if args.server_cmd is None:
        spec.model = args.model
    if spec.workload == "coding" and spec.tokenizer is None:
        spec.tokenizer = args.model  # a server point renders the chats with its tokenizer
    sw = SweepSpec(
        model=args.model, points=points, bench=spec, out_dir=args.out,
        engine_args=shlex.split(args.engine_args), server_cmd=args.server_cmd,
        health_timeout=args.health_timeout,
        sim=args.sim, tp=args.tp, targets=_targets(args.targets), threads=args.threads,
        command="hlserve " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["sweep"]
        else "hlserve sweep ...", title=args.title, repeats=args.repeats, ray=args.ray,
        tiers=parse_tiers(args.slo_tiers) if args.slo_tiers else DEFAULT_TIERS,
    )
    from hlserve.server.runtime.launch import stop_on_sigterm

    stop_on_sigterm()  # a stopped sweep takes the server of its current point with it
    summary = run_sweep(sw)
    bad = [p["label"] for p in summary["points"] if not p["metrics"].get("completed")
           or p["metrics"].get("failed") or p["metrics"].get("repeat_errors")]
    print(f"\nwrote {args.out}/frontier.png, {args.out}/tax.md, {args.out}/sweep.json")
    if args.report:
        from hlserve.html_report import write_report

        print(f"report: {write_report(args.out, args.report)}")
    if bad:
        print(f"hlserve sweep: points with failures: {', '.join(bad)}", file=sys.stderr)
        raise SystemExit(1)
