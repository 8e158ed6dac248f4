"""Command-line entry points of the simulator: ``hlserve cost``, ``hlserve calibrate``,
``hlserve study``. Each is an ``add_*_args(parser)`` / ``cmd_*(args)`` pair for the main CLI;
``python -m hlserve.cli.simulate {cost,calibrate,study} ...`` runs them standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hlserve.engine.args import cap_flag

# ---- hlserve cost --------------------------------------------------------------------------------


def add_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default="H20",
                   help="H20 | H100 | H200 | A100 | L40S, or a profile JSON from 'hlserve calibrate'")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default 1, or NxGPU's N)")
    p.add_argument("--model", default="Qwen2.5-32B", help="a known model name or a config.json / model dir")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prefill", type=int, metavar="N", help="a whole prefill of N tokens")
    what.add_argument("--decode-batch", type=int, metavar="B", help="one decode iteration of B sequences")
    p.add_argument("--chunk-size", type=cap_flag, default=None,
                   help="prefill in chunks of C tokens ('none': in one pass, the default)")
    p.add_argument("--context", type=int, default=0,
                   help="decode: tokens per sequence; prefill: tokens already cached before it")
    p.add_argument("--mixed-prefill", type=int, default=0, metavar="C",
                   help="decode: a prefill chunk of C tokens shares the iteration")
    p.add_argument("--json", action="store_true", help="print JSON")


def _fmt(x: float) -> str:
    return f"{1e3 * x:9.3f} ms"


def cmd_cost(args: argparse.Namespace) -> None:
    from hlserve.sim.cost import CostModel
    from hlserve.sim.hardware import get_hardware, parse_cluster
    from hlserve.sim.model_specs import resolve_model_spec

    hw = get_hardware(args.hardware)
    tp = args.tp or parse_cluster(str(args.hardware))[1] or 1
    name, mc = resolve_model_spec(args.model)
    cm = CostModel(mc, hw, tp)
    out: dict = {"model": name, "hardware": hw.name, "tp": tp}
    if args.prefill is not None:
        bd = cm.prefill(args.prefill, args.chunk_size, args.context)
        ref = cm.prefill(args.prefill, None, args.context)
        head = (f"prefill of {args.prefill} tokens"
                + (f" after {args.context} cached" if args.context else "")
                + (f" in chunks of {args.chunk_size} ({bd.iterations} iterations)"
                   if args.chunk_size else " in one pass"))
        out.update(kind="prefill", tokens=args.prefill, chunk_size=args.chunk_size,
                   context=args.context, tokens_per_s=args.prefill / bd.total, **bd.as_dict())
        if args.chunk_size:
            out["unchunked_ms"] = 1e3 * ref.total
            out["chunking_overhead"] = bd.total / ref.total - 1
    else:
        if args.decode_batch < 1 and not args.mixed_prefill:
            raise ValueError("--decode-batch must be >= 1")
        if args.decode_batch and args.context < 1:
            raise ValueError("--decode-batch needs --context L (tokens per sequence)")
        bd = cm.decode(args.decode_batch, args.context, args.mixed_prefill)
        head = (f"decode iteration: {args.decode_batch} sequences at {args.context} tokens"
                + (f" + a {args.mixed_prefill}-token prefill chunk" if args.mixed_prefill else ""))
        out.update(kind="decode", batch=args.decode_batch, context=args.context,
                   mixed_prefill=args.mixed_prefill,
                   decode_tokens_per_s=args.decode_batch / bd.total, **bd.as_dict())
        if args.mixed_prefill:
            pure = cm.decode(args.decode_batch, args.context)
            out["pure_decode_ms"] = 1e3 * pure.total
            out["decode_slowdown"] = 1 - pure.total / bd.total
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{name} on {tp}x{hw.name}: {head}")
    print(f"  predicted {_fmt(bd.total).strip()}, bound by {bd.bound} "
          f"({100 * getattr(bd, bd.bound) / bd.total:.0f}%)")
    for kind in ("compute", "memory", "communication", "overhead"):
        v = getattr(bd, kind)
        if v > 0:
            print(f"    {kind:<14}{_fmt(v)}")
    print("  by component:")
    for part, v in sorted(bd.parts.items(), key=lambda kv: -kv[1]):
        print(f"    {part:<18}{_fmt(v)}")
    if out["kind"] == "prefill":
        print(f"  {out['tokens_per_s']:.0f} prefill tokens/s")
        if args.chunk_size:
            print(f"  unchunked: {out['unchunked_ms']:.1f} ms; chunking costs "
                  f"{100 * out['chunking_overhead']:+.1f}%")
    else:
        print(f"  TPOT {1e3 * bd.total:.1f} ms, {out['decode_tokens_per_s']:.0f} decode tokens/s")
        if args.mixed_prefill:
            print(f"  pure decode: {out['pure_decode_ms']:.1f} ms; the mixed chunk lowers decode "
                  f"throughput by {100 * out['decode_slowdown']:.0f}%")


# ---- hlserve calibrate ---------------------------------------------------------------------------


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model directory to time (default: build the embedded tiny qwen2 model)")
    p.add_argument("--out", default="cpu_profile.json", help="profile JSON to write")
    p.add_argument("--name", default=None, help="profile name (default: cpu or cuda)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: steadier timings)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (about 10 s on a CPU)")
    p.add_argument("--no-fidelity", dest="fidelity", action="store_false",
                   help="skip the check against a real run of a different workload")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def cmd_calibrate(args: argparse.Namespace) -> None:
    from hlserve.models.default_model import default_model
    from hlserve.study.calibrate import calibrate, fidelity, write_profile

    model = args.model or str(default_model(quiet=True))
    name = args.name or args.device.split(":")[0]
    cal = calibrate(model, name=name, threads=args.threads, quick=args.quick, device=args.device,
                    progress=not args.json)
    write_profile(cal, args.out)
    report = {"profile": str(args.out), "calibration": cal.report}
    if args.fidelity:
        report["fidelity"] = fidelity(model, cal.hardware, device=args.device, threads=args.threads)
        Path(str(args.out) + ".report.json").write_text(json.dumps(report, indent=2, default=str))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return
    print(f"wrote {args.out} (use it as --hardware {args.out})")
    if args.fidelity:
        f = report["fidelity"]
        pi, e2e = f["per_iteration"], f["end_to_end"]
        print(f"fidelity on a different workload ({f['workload']['sessions']} sessions x "
              f"{f['workload']['rounds']} rounds, {f['engine_options']}), real run "
              f"{f['real_wall_s']:.1f}s, {f['iterations']['real']} iterations:")
        print(f"  per iteration: median |error| {100 * pi['median_abs_err']:.1f}%, p90 "
              f"{100 * pi['p90_abs_err']:.1f}%, total time {100 * pi['sum_err']:+.1f}%")
        print(f"  end to end: throughput {e2e['real_total_token_throughput']:.0f} real vs "
              f"{e2e['sim_total_token_throughput']:.0f} simulated tok/s "
              f"({100 * e2e['throughput_err']:+.1f}%); median TPOT {e2e['real_median_tpot_ms']:.1f} vs "
              f"{e2e['sim_median_tpot_ms']:.1f} ms")
        dc = f["drift_corrected"]
        print(f"  the machine ran at {1 / f['machine_drift']:.2f}x its calibrated speed (probe "
              f"batches); corrected for that: per iteration {100 * dc['per_iteration_median_abs_err']:.1f}%, "
              f"total {100 * dc['per_iteration_sum_err']:+.1f}%, throughput {100 * dc['throughput_err']:+.1f}%")


# ---- hlserve study -------------------------------------------------------------------------------


def add_study_args(p: argparse.ArgumentParser) -> None:
    from hlserve.study.core import DEFAULT_SYSTEMS

    p.add_argument("--hardware", default="H20")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--model", default="Qwen2.5-32B")
    p.add_argument("--contexts", default="8192,32768,65536", help="comma-separated context lengths")
    p.add_argument("--sessions", default="16,64,128", help="comma-separated concurrency levels")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="sglang, sarathi, vllm, hlserve (throughput mode), ablations; the "
                        "engines' own schedulers (their environments built by .ci): vllm-0.34, "
                        "vllm-0.34-chunked, vllm-0.34+hlserve, sglang-0.5.23, sglang-0.5.23-mixed, "
                        "sglang-0.5.23+hlserve")
    p.add_argument("--chunks", default=None,
                   help="chunk sizes / budgets to sweep (default per system; vLLM's code: "
                        "--max-num-batched-tokens, SGLang's: --chunked-prefill-size)")
    p.add_argument("--duration", type=float, default=1200.0, help="simulated seconds measured")
    p.add_argument("--warmup", type=float, default=600.0,
                   help="simulated seconds before measuring (sessions ramp up over half of it)")
    p.add_argument("--rounds", type=int, default=8, help="rounds per agent session")
    p.add_argument("--output-mean", type=float, default=200.0,
                   help="mean output tokens per round (lognormal)")
    p.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                   help="no round's prompt reuses an earlier round's (fresh ids after the shared "
                        "system prompt, same lengths): the paper's benchmark, with little reuse")
    p.add_argument("--out", default="study", help="output folder (per-point JSON, plots, table)")
    p.add_argument("--jobs", type=int, default=None, help="parallel processes (default: cores)")
    p.add_argument("--wall-limit", type=float, default=900.0, help="wall seconds per point at most")
    p.add_argument("--report-only", action="store_true", help="plots and table from existing points")
    p.add_argument("--tiers-only", action="store_true",
                   help="only tiers.md and tiers.json (agents per node at SLO tiers) from "
                        "existing points, the rest of the report left as it is")
    p.add_argument("--slo-tiers", default=None, metavar="NAME=TTFT_S/TPOT_MS,...",
                   help="the tiers of the tier table (default: interactive=0.5/50,"
                        "production=2/100,relaxed=10/250, and none)")
    p.add_argument("--seed", type=int, default=0,
                   help="workload seed (with --repeats N: seeds SEED .. SEED+N-1) (default: 0)")
    p.add_argument("--tool-time", default="0", type=tool_time_spec, metavar="SPEC",
                   help="the tool call between a session's rounds, drawn per round from the "
                        "seed: fixed:S, exp:MEAN, lognormal:MEDIAN:SIGMA, empirical:FILE "
                        "(default: 0, the zero-gap study)")
    from hlserve.cli.measure import add_report_arg
    from hlserve.driver.repeats import add_repeat_args

    add_repeat_args(p, ray=True)
    add_report_arg(p)


def tool_time_spec(text: str) -> str:
    """A ``--tool-time`` spec checked and written one way (``0`` for none, so a zero-gap
    point's fingerprint is the one stored points carry); an empirical file keeps its path."""
    from hlserve.driver.tool_time import parse_tool_time

    try:
        t = parse_tool_time(text)
    except (ValueError, OSError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if t.is_zero:
        return "0"
    return text.strip() if t.kind == "empirical" else t.spec


def cmd_study(args: argparse.Namespace) -> None:
    from hlserve.driver.tiers import DEFAULT_TIERS, parse_tiers
    from hlserve.study.core import StudySpec
    from hlserve.study.runs import run_study
    from hlserve.study.study_report import report, write_tiers

    tiers = parse_tiers(args.slo_tiers) if args.slo_tiers else DEFAULT_TIERS
    if args.tiers_only:
        for p in write_tiers(Path(args.out), tiers):
            print(f"wrote {p}")
        return
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    spec = StudySpec(
        hardware=args.hardware, tp=args.tp, model=args.model, contexts=tuple(ints(args.contexts)),
        sessions=tuple(ints(args.sessions)), systems=tuple(s for s in args.systems.split(",") if s),
        chunks=tuple(ints(args.chunks)) if args.chunks else None, duration=args.duration,
        warmup=args.warmup, rounds=args.rounds, output_mean=args.output_mean,
        prefix_reuse=args.prefix_reuse, wall_limit=args.wall_limit, seed=args.seed,
        tool_time=args.tool_time,
    )
    out = Path(args.out)
    if not args.report_only:
        from hlserve.study.foreign import missing_environments

        missing = missing_environments(spec.systems)
        if missing:  # before any point runs, not in the middle of the study
            raise ValueError("; ".join(missing))
        run_study(spec, out, jobs=args.jobs, progress=True, repeats=args.repeats, ray=args.ray)
    paths = report(out, tiers_=tiers)
    if args.report:
        from hlserve.html_report import write_report

        paths.append(write_report(out, args.report))
    for p in paths:
        print(f"wrote {p}")


# ---- standalone ----------------------------------------------------------------------------------


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """``cost``, ``calibrate`` and ``study``, for ``hlserve`` and for this module alone."""
    for name, add, cmd, text in (
        ("cost", add_cost_args, cmd_cost, "predicted time of one batch or prefill on a GPU"),
        ("calibrate", add_calibrate_args, cmd_calibrate, "fit the cost model to this machine"),
        ("study", add_study_args, cmd_study, "the simulated human-tax study (docs/study.md)"),
    ):
        p = sub.add_parser(name, help=text)
        add(p)
        p.set_defaults(func=cmd)


def main(argv: list[str] | None = None) -> int:
    """``python -m hlserve.cli.simulate cost ...`` runs as ``hlserve cost ...`` does (the same
    subcommands, the same error handling), without importing the top-level CLI."""
    from hlserve.errors import run_command

    parser = argparse.ArgumentParser(prog="hlserve", description=__doc__)
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return run_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
