"""The study's headline numbers with an interval over workload seeds and model error together
(docs/study.md, "Model error in the headline"; the library is hlserve.study.model_error).

Each cost term is perturbed by residuals bootstrapped from the fidelity suite's rows that
exercise it (``benchmarks/fidelity.py``, shipped profiles, no serving replays needed):

- GEMM compute efficiency (``gemm_eta_max``): the Vidur GEMM held-out buckets above 16 tokens;
- prefill attention (``attn_eta_compute``): FlashAttention-3's held-out rows (TFLOP/s);
- decode attention (``attn_eta_mem``): vLLM's decode kernel at batch 100 and 128 (Vidur);
- host overhead (``iter_overhead``, ``seq_overhead``): vLLM's host path per step (Vidur,
  another engine's: an upper end for a Python engine);
- mixed-batch contention (``mix_contention``): Sarathi-Serve's 1021 + 3 row;
- with ``--allreduce``, the all-reduce latency (``allreduce_alpha``, every profiled device
  count): TurboMind's latency fitted on its one-client rows at 2 and 4 GPUs against the A100
  profile's (no row measures the study's 8).

Replicate k runs workload seed k on draw k, every point of the replicate on the same seed and
draw (paired). The seed-only replicates (the shipped cost model) are read from the stored
study points where they exist (docs/study/h20-seeds, docs/study/h20) and run otherwise. Results
go to ``--out`` as they come (a rerun resumes).

    python benchmarks/study_model_error.py                  # 3 seeds, 32K: ~20 points, ~10 min
    python benchmarks/study_model_error.py --seeds 5 --out /tmp/me.json
    python benchmarks/study_model_error.py --gpu H100   # docs/study/h100-model-error/
    python benchmarks/study_model_error.py --context 65536 \
        --out docs/study/h20-model-error/model_error_64k.json
    python benchmarks/study_model_error.py --allreduce  # + the all-reduce latency (~7 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from hlserve.sim.hardware import get_hardware
from hlserve.study import model_error as me
from hlserve.study.core import StudyPoint, StudySpec, run_point

ROOT = Path(__file__).resolve().parent.parent
STORED = (ROOT / "docs/study/h20-seeds/points", ROOT / "docs/study/h20/points",
          ROOT / "docs/study/h20-256/points")
OUT = ROOT / "docs/study/h20-model-error/model_error.json"
DRAW_SEED = 0


def _fidelity():
    spec = importlib.util.spec_from_file_location("fidelity", Path(__file__).with_name("fidelity.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fidelity"] = mod
    spec.loader.exec_module(mod)
    return mod


def terms(allreduce: bool = False) -> list[me.Term]:
    """The perturbed terms and their residuals (shipped profiles); ``allreduce`` adds the
    all-reduce latency, drawn last so that every other term draws as without it."""
    fid = _fidelity()
    results, _ = fid.run(gemm=True, serving=False)

    def pick(ok) -> tuple[tuple[float, ...], tuple[str, ...]]:
        rs = [r for r in results if ok(r)]
        return tuple(r.error for r in rs), tuple(r.id for r in rs)

    gemm = pick(lambda r: r.group == "gemm (held-out)" and not r.id.endswith("n1-16"))
    fa3 = pick(lambda r: r.group == "attention (FA3, H100)" and r.split == "heldout")
    dec = pick(lambda r: r.id in ("attn-vidur-dec-b100-ctx1920", "attn-vidur-dec-b128-ctx1920"))
    host = pick(lambda r: r.group == "host overhead")
    mix = pick(lambda r: r.group == "mixed-batch")
    return [
        me.Term("GEMM", ("gemm_eta_max",), gemm[0], +1, gemm[1]),
        me.Term("attention prefill", ("attn_eta_compute",), fa3[0], -1, fa3[1]),
        me.Term("attention decode", ("attn_eta_mem",), dec[0], +1, dec[1]),
        me.Term("host overhead", ("iter_overhead", "seq_overhead"), host[0], -1, host[1]),
        me.Term("mixed-batch contention", ("mix_contention",), mix[0], -1, mix[1], additive=True),
    ] + ([allreduce_term(fid)] if allreduce else [])


def allreduce_term(fid) -> me.Term:
    """The all-reduce latency: the A100 profile's (Vidur's fit) against TurboMind's, fitted on
    its one-client rows at 2 and 4 GPUs (docs/fidelity.md, item 6), one residual per device
    count, ``e = profile / fitted - 1``: a time term checked on time rows (power -1)."""
    data = fid.load()
    alphas = fid.turbomind_allreduce(fid.fit_corrections(data))
    return me.Term("all-reduce latency", ("allreduce_alpha",),
                   tuple(profile / fitted - 1 for fitted, profile in alphas.values()), -1,
                   tuple(i for n in alphas for i in fid.one_stream_rows(data, n)))


def stored(point: StudyPoint, seed: int, gpu: str) -> dict[str, Any] | None:
    """The stored study point of the shipped cost model at ``seed``, if one is stored (the
    stored study is on the default GPU only)."""
    if gpu != StudySpec().hardware:
        return None
    fp = dataclasses.replace(StudySpec(), seed=seed).fingerprint()
    name = f"{point.key}.json" if seed == 0 else f"{point.key}.seed{seed}.json"
    for d in STORED:
        if (d / name).exists():
            rec = json.loads((d / name).read_text())
            # seed 0 was stored before output_mean and prefix_reuse were recorded (defaults)
            if all(fp.get(k) == v for k, v in rec["spec"].items()):
                return rec
    return None


def replicate(mode: str, seed: int, hw, pts: dict[str, StudyPoint], done: dict, save) -> dict:
    """One replicate's records (resumed from ``done``)."""
    recs = done.setdefault(f"{mode}:{seed}", {})
    for name, p in pts.items():
        if name in recs:
            continue
        rec = stored(p, seed, hw.name) if mode == "seeds" else None
        if rec is None:
            rec = run_point(dataclasses.replace(StudySpec(), hardware=hw, seed=seed), p)
            rec["spec"]["hardware"] = hw.name  # a perturbed machine is a Hardware object
            print(f"  {mode} seed {seed} {name}: {rec['metrics']['window_token_throughput']:,.0f} tok/s "
                  f"({rec['metrics']['wall_s']:.0f} s)", flush=True)
        recs[name] = rec
        save()
    return {name: recs[name] for name in pts}  # a file run with more points keeps them


def _table(rows: dict[str, dict[str, me.Headline]]) -> str:
    cols = list(rows)
    lines = ["| headline | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name in next(iter(rows.values())):
        cells = [rows[c][name].text() if name in rows[c] else "-" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="replicates (workload seeds 0..n-1)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--sessions", help="throughput mode's concurrencies for the taxes, comma-"
                    "separated (default by context: " + "; ".join(
                        f"{c // 1024}K {','.join(map(str, n))}" for c, n in me.TAX_SESSIONS.items())
                    + "); a rerun with more adds only the new points")
    ap.add_argument("--gpu", default=StudySpec().hardware,
                    help="the GPU profile (8 of them, the study's deployment); default H20")
    ap.add_argument("--out", type=Path, help=f"default {OUT.relative_to(ROOT)} (another GPU: "
                    "docs/study/<gpu>-model-error/; with --allreduce: model_error_allreduce.json)")
    ap.add_argument("--allreduce", action="store_true", help="draw the all-reduce latency too "
                    "(TurboMind's one-client rows, docs/fidelity.md item 6)")
    args = ap.parse_args()
    if args.out is None:
        args.out = OUT if args.gpu == StudySpec().hardware else \
            ROOT / f"docs/study/{args.gpu.lower()}-model-error/model_error.json"
        if args.allreduce:
            args.out = args.out.with_name("model_error_allreduce.json")
    ts = terms(args.allreduce)
    base = get_hardware(args.gpu)
    draws = [me.draw(base, ts, DRAW_SEED, k) for k in range(args.seeds)]
    sessions = [int(n) for n in args.sessions.split(",")] if args.sessions else None
    pts = me.headline_points(args.context, sessions)
    state: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    if state.get("context") != args.context or state.get("gpu", "H20") != args.gpu:
        state = {"context": args.context, "gpu": args.gpu, "records": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps(state, default=float))

    done = state["records"]
    seeds_only = [replicate("seeds", s, base, pts, done, save) for s in range(args.seeds)]
    with_error = [replicate("model-error", s, draws[s].hardware, pts, done, save) for s in range(args.seeds)]
    print("\nterms (scale = (1 + e) ** power; residuals e of the rows named):")
    for t in ts:
        print(f"  {t.name}: {t.fields} power {t.power:+d}, scales "
              + ", ".join(f"{s:.3f}" for s in t.scales()) + f" (rows {', '.join(t.rows)})")
    print("\ndraws:")
    for d in draws:
        print(f"  seed {d.index}: " + ", ".join(f"{k} x{v:.3f}" for k, v in d.scales.items()))
    print("\nper replicate (window throughput, tok/s):")
    for mode, reps in (("seeds", seeds_only), ("model-error", with_error)):
        for s, r in enumerate(reps):
            print(f"  {mode} seed {s}: " + ", ".join(f"{k} {v['metrics']['window_token_throughput']:,.0f}"
                                                   for k, v in r.items()))
            print("    values: " + ", ".join(f"{k[:30]} {v:+.2%}" for k, v in me.replicate_values(r).items()))
    cols = {"seeds only (shipped cost model)": me.headlines(seeds_only),
            "seeds + model error (paired)": me.headlines(with_error),
            "seeds + model error, unpaired": me.crossed(with_error)}
    print("\n" + _table(cols))
    for name in me.GAINS:
        arm = [r[me.GAINS[name][1]]["metrics"]["window_token_throughput"] for r in with_error]
        print(f"\n{name}: denominator arm alone varies {statistics.pstdev(arm) / statistics.mean(arm):.1%} "
              f"(sd/mean) over the model-error replicates")
    state["headlines"] = {c: {n: dataclasses.asdict(h) | {"no_difference": h.no_difference}
                              for n, h in hs.items()} for c, hs in cols.items()}
    state["draws"] = [{"seed": d.index, "scales": d.scales} for d in draws]
    save()


if __name__ == "__main__":
    main()
