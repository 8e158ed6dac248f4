"""The study's systems against the engines' own code: the tables of docs/study/h20-systems/.

Reads the stored points of ``docs/study/h20`` (hlserve's engine: throughput mode and the
presets) and ``docs/study/h20-systems`` (vLLM 0.34's and SGLang 0.5.23's own schedulers,
stock and with hlserve's plugin, on the same simulated runner, workload and driver:
``hlserve study --systems vllm-0.34,...``), and writes ``systems.md``:

1. each preset against the scheduler it stands for, per headline cell (the policy side of
   fidelity, docs/fidelity.md): throughput, TTFT and TPOT p99, and what the steps did; and
   the `sglang` preset after its fix (``docs/study/h20-systems/preset-after``, written by
   ``benchmarks/preset_after.py``);
2. throughput per system per cell, with each plugin's gain over its stock engine;
3. the seed's claims on SGLang's code: throughput mode (the plugin) over stock SGLang and
   over Sarathi-style chunking (SGLang with --enable-mixed-chunk, C = 512), and the vLLM
   plugin over stock vLLM, paired over the workload seeds stored (95% Fieller interval of
   the ratio of means);
4. the human tax at the production and strict SLO pairs within each system, the node's
   concurrency free (16-128 sessions; the best point meeting the pair against the system's
   best point).

    python benchmarks/study_systems.py            # writes docs/study/h20-systems/systems.md
    python benchmarks/study_systems.py --check    # exits 1 when the stored file, or a row
                                                  # docs/fidelity.md or docs/study.md quote
                                                  # (tables 1-4), differs

Nothing is simulated here; tests/test_study_systems.py runs ``--check``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hlserve.driver.stats import ratio_ci
from hlserve.study.core import PRODUCTION_SLO, STRICT_SLO, human_tax, throughput

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "docs" / "study" / "h20" / "points"
SYSTEMS = ROOT / "docs" / "study" / "h20-systems" / "points"
OUT = ROOT / "docs" / "study" / "h20-systems" / "systems.md"
AFTER = ROOT / "docs" / "study" / "h20-systems" / "preset-after"  # benchmarks/preset_after.py
CELLS = [(c, n) for c in (32768, 65536) for n in (16, 64, 128)]
# preset key (system_knob) -> the engine's own scheduler it stands for
PAIRS = (("vllm_8192", "vllm-0.34"), ("sglang_8192", "sglang-0.5.23"))
COLUMNS = ("hlserve", "vllm_8192", "vllm-0.34", "vllm-0.34+hlserve", "sglang_8192",
           "sglang-0.5.23", "sglang-0.5.23-mixed", "sglang-0.5.23+hlserve")
NAMES = {"hlserve": "hlserve engine, throughput mode", "vllm_8192": "preset vllm B=8192",
         "sglang_8192": "preset sglang C=8192"}


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def point(ctx: int, n: int, system: str, seed: int = 0) -> dict[str, Any] | None:
    """A stored point: a preset (``vllm_8192``), throughput mode (``hlserve``) or an engine's
    own scheduler (``vllm-0.34``, at its default knob)."""
    suffix = "" if seed == 0 else f".seed{seed}"
    if system == "hlserve" or "_" in system:
        key = system if "_" in system else "hlserve_inf"
        return _load(PRESETS / f"ctx{ctx}_n{n}_{key}{suffix}.json")
    return _load(SYSTEMS / f"ctx{ctx}_n{n}_{system}_inf{suffix}.json")


def seeds_of(ctx: int, n: int, system: str) -> dict[int, dict[str, Any]]:
    out = {}
    for seed in range(10):
        r = point(ctx, n, system, seed)
        if r is not None:
            out[seed] = r
    return out


def _k(v: float) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{v / 1e3:.1f}K"


def _ms(r: dict[str, Any], key: str) -> str:
    v = r["metrics"].get(key)
    if v is None or not math.isfinite(v):
        return "—"
    return f"{v / 1e3:.1f} s" if v >= 10_000 else f"{v:.0f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def after(ctx: int, n: int, preset: str, code_throughput: float) -> str:
    """The preset after its fix (benchmarks/preset_after.py), against the code; vLLM's preset
    is not changed."""
    r = _load(AFTER / f"ctx{ctx}_n{n}_{preset}.json")
    if r is None:
        return "unchanged" if preset.startswith("vllm") else "—"
    t = throughput(r)
    return f"{_k(t)} ({_pct(t / code_throughput - 1)}), {r['metrics']['retractions']}"


def fidelity_rows() -> Iterable[str]:
    yield ("| cell | preset | engine's code | throughput preset / code (diff) | TTFT p99 | "
           "TPOT p99 | iterations | mixed iterations | preemptions | prefill tokens computed | "
           "after the fix: throughput (diff), preemptions |")
    yield "|---|---|---|---|---|---|---|---|---|---|---|"
    for ctx, n in CELLS:
        for preset, real in PAIRS:
            a, b = point(ctx, n, preset), point(ctx, n, real)
            if a is None or b is None:
                continue
            ta, tb = throughput(a), throughput(b)
            ma, mb = a["metrics"], b["metrics"]
            yield (f"| {ctx // 1024}K / {n} | {NAMES[preset]} | {real} | {_k(ta)} / {_k(tb)} "
                   f"({_pct(ta / tb - 1)}) | {_ms(a, 'p99_ttft_ms')} / {_ms(b, 'p99_ttft_ms')} | "
                   f"{_ms(a, 'p99_tpot_ms')} / {_ms(b, 'p99_tpot_ms')} | "
                   f"{ma['iterations']:,} / {mb['iterations']:,} | "
                   f"{ma['mixed_iterations']:,} / {mb['mixed_iterations']:,} | "
                   f"{ma['retractions']} / {mb['retractions']} | "
                   f"{ma['prefill_tokens_computed'] / 1e6:.2f}M / "
                   f"{mb['prefill_tokens_computed'] / 1e6:.2f}M | {after(ctx, n, preset, tb)} |")


def throughput_rows() -> Iterable[str]:
    yield ("| cell | " + " | ".join(NAMES.get(c, c) for c in COLUMNS)
           + " | vLLM plugin / stock | SGLang plugin / stock |")
    yield "|---|" + "---:|" * (len(COLUMNS) + 2)
    for ctx, n in CELLS:
        got = {c: point(ctx, n, c) for c in COLUMNS}
        t = {c: throughput(r) if r else math.nan for c, r in got.items()}
        gains = [_pct(t[p] / t[s] - 1) if t[s] > 0 and math.isfinite(t[p]) else "—"
                 for p, s in (("vllm-0.34+hlserve", "vllm-0.34"),
                              ("sglang-0.5.23+hlserve", "sglang-0.5.23"))]
        yield (f"| {ctx // 1024}K / {n} | " + " | ".join(_k(t[c]) for c in COLUMNS)
               + " | " + " | ".join(gains) + " |")


# (throughput mode's host, the baseline) of table 3
SEED_PAIRS = (("sglang-0.5.23+hlserve", "sglang-0.5.23"),
              ("sglang-0.5.23+hlserve", "sglang-0.5.23-mixed"),
              ("vllm-0.34+hlserve", "vllm-0.34"))


def paired_gain(ctx: int, n: int, ours: str, base: str) -> str:
    """Throughput of ``ours`` over ``base`` on the seeds both have: the ratio of means less 1,
    with its paired 95% interval from two seeds on."""
    a_by, b_by = seeds_of(ctx, n, base), seeds_of(ctx, n, ours)
    common = sorted(set(a_by) & set(b_by))
    if not common:
        return "—"
    r, ci = ratio_ci([throughput(a_by[s]) for s in common], [throughput(b_by[s]) for s in common])
    interval = f" [{_pct(ci[0] - 1)}, {_pct(ci[1] - 1)}]" if ci else ""
    return f"{_pct(r - 1)}{interval} ({len(common)} seed{'s' * (len(common) > 1)})"


def seed_rows() -> Iterable[str]:
    yield ("| cell | SGLang plugin over stock SGLang (C=8192) | SGLang plugin over SGLang mixed "
           "C=512 (Sarathi-style) | vLLM plugin over stock vLLM (B=8192) |")
    yield "|---|---|---|---|"
    for ctx, n in CELLS:
        cells = [paired_gain(ctx, n, ours, base) for ours, base in SEED_PAIRS]
        yield f"| {ctx // 1024}K / {n} | " + " | ".join(cells) + " |"


def tax_rows() -> Iterable[str]:
    systems = ("hlserve", "vllm-0.34", "vllm-0.34+hlserve", "sglang-0.5.23",
               "sglang-0.5.23-mixed", "sglang-0.5.23+hlserve")
    yield "| context | SLO pair (TTFT p99 / TPOT p99) | " + " | ".join(systems) + " |"
    yield "|---|---|" + "---|" * len(systems)
    for ctx in (32768, 65536):
        for name, (ttft, tpot) in (("production", PRODUCTION_SLO), ("strict", STRICT_SLO)):
            cells = []
            for s in systems:
                recs = [r for n in (16, 64, 128) if (r := point(ctx, n, s)) is not None]
                tax, best_ok, _ = human_tax(recs, ttft, tpot)
                where = f" ({best_ok['point']['sessions']} sessions)" if best_ok else ""
                cells.append("—" if not recs else f"{100 * tax:.0f}%{where}")
            yield (f"| {ctx // 1024}K | {name} ({ttft / 1e3:.0f} s / {tpot:.0f} ms) | "
                   + " | ".join(cells) + " |")


# tables the docs quote, row by row: --check fails when a quoted row is not the points'
QUOTED = (("docs/fidelity.md", fidelity_rows), ("docs/study.md", throughput_rows),
          ("docs/study.md", seed_rows), ("docs/study.md", tax_rows))


def render() -> str:
    parts = [
        "# The study's systems against the engines' own schedulers (8xH20, Qwen2.5-32B)",
        "",
        "Written by `python benchmarks/study_systems.py` from `docs/study/h20/points` "
        "(hlserve's engine) and `docs/study/h20-systems/points` (vLLM 0.34's and SGLang "
        "0.5.23's own scheduling code on the same simulated runner, cost model, workload and "
        "driver). Each point: 20 simulated minutes after 10 of warm-up, seed 0 unless a "
        "column says otherwise. Throughput: tokens served per second in the window.",
        "",
        "## 1. Each preset against the scheduler it stands for",
        "", *fidelity_rows(), "",
        "## 2. Throughput per system (tok/s)",
        "", *throughput_rows(), "",
        "## 3. Throughput mode on the engines' code, over seeds",
        "",
        "Ratio of mean throughputs, paired by workload seed, with its 95% interval.",
        "", *seed_rows(), "",
        "## 4. The human tax within each system (concurrency 16-128 free)",
        "", *tax_rows(), "",
    ]
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the stored file")
    args = ap.parse_args()
    text = render()
    if args.check:
        bad = [] if OUT.exists() and OUT.read_text() == text else [
            f"{OUT.relative_to(ROOT)} differs from its points: rerun this script"]
        for doc, rows in QUOTED:
            quoted = (ROOT / doc).read_text()
            bad += [f"{doc} lacks the row: {row}" for row in rows() if row not in quoted]
        sys.stderr.write("".join(line + "\n" for line in bad))
        return 1 if bad else 0
    OUT.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
