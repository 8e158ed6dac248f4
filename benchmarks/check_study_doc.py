"""Check docs/study.md against its stored points: every number the doc takes from
docs/study/h20/points (and h20-out1000/points) is recomputed here and compared with the number
as written.

A claim is a short, unique quote of the doc with ``{}`` where its numbers stand; the quote is
found in the doc (whitespace folded), the numbers are parsed out of it and compared with the
recomputed ones within the doc's rounding (half a unit of the last digit written), or as a
bound rounded the way the doc words it (``floor``: "≥ 142 ms", ``ceil``: "within 8%").

    python benchmarks/check_study_doc.py            # prints the table, exits 1 on a mismatch
    python benchmarks/check_study_doc.py --replot   # also redraws docs/study/h20/*.png

Not checked here: numbers from other benchmarks (sim_speed, sim_sensitivity, sim_mooncake,
sim_cost_tables, the other rows of the sim_two_stage table, `hlserve cost` output, the
calibration table) and the published figures of section 4.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlserve.study.core import (
    COMPUTED_METRIC,
    WINDOW_COMPUTED_METRIC,
    components,
    human_tax,
    latency,
    throughput,
    with_computed,
)
from hlserve.study.runs import load_points
from hlserve.study.seeds import Interval, key, load_by_seed, meets_in, tax_over_seeds

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "study.md"
POINTS = ROOT / "docs" / "study" / "h20"
OUT1000 = ROOT / "docs" / "study" / "h20-out1000"
SEEDS = ROOT / "docs" / "study" / "h20-seeds"  # a subset of the grid over seeds 0-2 (section 7)
NOREUSE = ROOT / "docs" / "study" / "h20-noreuse"  # the same without prefix reuse
K8, K32, K64 = 8192, 32768, 65536
PROD, STRICT = (2000.0, 100.0), (1000.0, 50.0)
INF = math.inf
FCFS = ("vllm", "sarathi", "hlserve-fcfs")
Rec = dict[str, Any]

# ---- the points --------------------------------------------------------------------------------


@dataclass
class Study:
    """The stored points, with the selections the doc's numbers are made of."""

    recs: list[Rec]
    long_out: list[Rec]  # h20-out1000: mean output 1,000 tokens
    seeds: dict[int, list[Rec]] = field(default_factory=dict)  # h20-seeds, by seed
    noreuse: dict[int, list[Rec]] = field(default_factory=dict)  # h20-noreuse, by seed

    @classmethod
    def load(cls, points: Path = POINTS, long_out: Path = OUT1000, seeds: Path = SEEDS,
             noreuse: Path = NOREUSE) -> Study:
        return cls(load_points(points), load_points(long_out), load_by_seed(seeds),
                   load_by_seed(noreuse))

    def at(self, ctx: int, n: int | None = None, where: Callable[[Rec], bool] | None = None,
           recs: list[Rec] | None = None) -> list[Rec]:
        return [r for r in (self.recs if recs is None else recs)
                if r["point"]["context"] == ctx and (n is None or r["point"]["sessions"] == n)
                and (where is None or where(r))]

    def one(self, ctx: int, n: int, system: str, knob: int | None = None) -> Rec:
        (r,) = self.at(ctx, n, lambda r: (r["point"]["system"], r["point"]["knob"]) == (system, knob))
        return r

    def sessions(self, ctx: int) -> list[int]:
        return sorted({r["point"]["sessions"] for r in self.at(ctx)})

    def best(self, ctx: int, n: int | None = None, **kw: Any) -> float:
        """Best throughput (K tok/s)."""
        return max(throughput(r) for r in self.at(ctx, n, **kw)) / 1e3

    def tax(self, ctx: int, slo: tuple[float, float], n: int | None = None, **kw: Any) -> float:
        """Human tax (%)."""
        return 100 * human_tax(self.at(ctx, n, **kw), *slo)[0]

    def met(self, ctx: int, slo: tuple[float, float], n: int | None = None, **kw: Any) -> Rec:
        """Best point meeting the SLO (KeyError when none does)."""
        r = human_tax(self.at(ctx, n, **kw), *slo)[1]
        if r is None:
            raise KeyError(f"nothing meets {slo} at {ctx}/{n}")
        return r

    def top(self, ctx: int, n: int | None = None, **kw: Any) -> Rec:
        best = human_tax(self.at(ctx, n, **kw), INF, INF)[2]
        assert best is not None
        return best

    def gain(self, ctx: int, n: int, name: str) -> float:
        """Throughput mode's gain (%) over an ablation or preset (components' names)."""
        return 100 * components(self.at(ctx, n))[name]

    def loss(self, r: Rec) -> float:
        """How far (%) a point is below the best at its context and concurrency."""
        p = r["point"]
        return 100 * (1 - throughput(r) / (1e3 * self.best(p["context"], p["sessions"])))


def kthr(r: Rec) -> float:
    return throughput(r) / 1e3


def system(*names: str) -> Callable[[Rec], bool]:
    return lambda r: r["point"]["system"] in names


def same(*xs: float) -> float:
    """The one value ``xs`` round to together (a doc range like "18% at 70–100 ms"), else NaN."""
    return xs[0] if max(xs) - min(xs) < 0.5 else math.nan


def below_overload(r: Rec) -> bool:
    """Outside 64K at 64+ sessions, where the KV pool is short."""
    return not (r["point"]["context"] == K64 and r["point"]["sessions"] >= 64)


def chunk(r: Rec, lo: int, hi: float) -> bool:
    """A preset configuration whose chunk (or budget; unlimited counts as inf) is in [lo, hi]."""
    knob = r["point"]["knob"]
    return r["point"]["system"] in ("sglang", "sarathi", "vllm") and lo <= (knob or INF) <= hi


def tool_mean(ctx: int) -> float:
    """The mean tool result (tokens) of the study's workload at ``ctx``, from the generator."""
    from hlserve.driver.workloads import AgentWorkload

    return AgentWorkload.for_context(ctx, 1).tool_output_len.mean


# ---- claims -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    name: str
    quote: str  # doc text, ``{}`` for each number
    compute: Callable[[Study], Iterable[float]]
    modes: tuple[str, ...] = ()  # per number: "round" (default), "floor", "ceil"


NUM = r"([+−-]?\d[\d,]*(?:\.\d+)?)"


def _fold(text: str) -> str:
    return " ".join(text.split())


def _pattern(quote: str) -> re.Pattern[str]:
    parts = _fold(quote).split("{}")
    return re.compile(NUM.join(re.escape(p) for p in parts))


def parse_number(s: str) -> tuple[float, int]:
    """The value and the number of decimals written."""
    s = s.replace("−", "-").replace(",", "")
    return float(s), len(s.split(".")[1]) if "." in s else 0


def agrees(doc: float, decimals: int, value: float, mode: str) -> bool:
    unit = 10.0 ** -decimals
    eps = 1e-9 * max(1.0, abs(value))
    if not math.isfinite(value):
        return False
    if mode == "floor":  # the doc writes a lower bound, rounded down
        return doc - eps <= value < doc + unit + eps
    if mode == "ceil":  # an upper bound, rounded up
        return doc - unit - eps < value <= doc + eps
    return abs(doc - value) <= unit / 2 + eps


@dataclass(frozen=True)
class Result:
    claim: str
    in_doc: str
    from_points: str
    ok: bool


def check_claim(doc: str, claim: Claim, study: Study) -> list[Result]:
    hits = list(_pattern(claim.quote).finditer(_fold(doc)))
    if len(hits) != 1:
        why = "quote not found" if not hits else f"quote found {len(hits)} times"
        return [Result(claim.name, why, "", False)]
    try:
        values = list(claim.compute(study))
    except (KeyError, ValueError) as e:
        return [Result(claim.name, "", f"error: {e}", False)]
    written = hits[0].groups()
    if len(values) != len(written):
        return [Result(claim.name, str(len(written)), f"{len(values)} values", False)]
    out = []
    for i, (text, value) in enumerate(zip(written, values, strict=True)):
        doc_v, decimals = parse_number(text)
        mode = claim.modes[i] if i < len(claim.modes) else "round"
        name = claim.name if len(values) == 1 else f"{claim.name} [{i + 1}]"
        shown = f"{value:.{decimals + 2}f}" + ("" if mode == "round" else f" ({mode})")
        out.append(Result(name, text, shown, agrees(doc_v, decimals, value, mode)))
    return out


def check(doc: str, study: Study, claims: Iterable[Claim] | None = None) -> list[Result]:
    """Every claim's numbers against the points: one row per number."""
    return [res for c in (CLAIMS if claims is None else claims) for res in check_claim(doc, c, study)]


def n_of(r: Rec) -> int:
    return r["point"]["sessions"]


def named(r: Rec, *prefixes: str) -> Rec:
    """``r``, checked to be one of the systems the doc names (by prefix)."""
    if not r["point"]["system"].startswith(prefixes):
        raise ValueError(f"the point is {r['label']}, not {' / '.join(prefixes)}")
    return r


def pool(s: Study, ctx: int) -> float:
    """Throughput mode's KV pool at ``ctx`` (tokens)."""
    return float(s.one(ctx, 16, "hlserve")["kv_pool_tokens"])


def span(xs: Iterable[float]) -> tuple[float, float]:
    xs = list(xs)
    return min(xs), max(xs)


def gains(s: Study, name: str, where: Callable[[Rec], bool] = lambda r: True,
          ctxs: tuple[int, ...] = (K8, K32, K64)) -> list[float]:
    """Throughput mode's gain over ``name`` at every (context, sessions) it was run at."""
    keys = sorted({(r["point"]["context"], n_of(r)) for r in s.recs
                   if r["point"]["context"] in ctxs and where(r)})
    out = []
    for ctx, n in keys:
        comp = components(s.at(ctx, n))
        if name in comp:
            out.append(100 * comp[name])
    return out


def not_overload(r: Rec) -> bool:
    return (r["point"]["context"], n_of(r)) != (K64, 128)


def feasible_sessions(s: Study, ctx: int, slo: tuple[float, float]) -> list[int]:
    return [n for n in s.sessions(ctx) if s.tax(ctx, slo, n) < 100]


def infeasible_from(s: Study, ctx: int, slo: tuple[float, float]) -> int:
    """The lowest concurrency from which no configuration meets ``slo``."""
    ok = feasible_sessions(s, ctx, slo)
    return min(n for n in s.sessions(ctx) if not ok or n > max(ok))


def lost(s: Study, where: Callable[[Rec], bool]) -> list[float]:
    return [s.loss(r) for r in s.recs if where(r)]


def identical_to_vllm(s: Study, ctx: int, n: int) -> bool:
    keys = ("window_token_throughput", "p99_ttft_ms", "p99_tpot_ms", "median_ttft_ms",
            "iterations", "retractions")
    a, b = s.one(ctx, n, "hlserve")["metrics"], s.one(ctx, n, "vllm")["metrics"]
    return all(a.get(k) == b.get(k) for k in keys)


def identical_up_to(s: Study) -> float:
    """At 64K, the highest concurrency up to which throughput mode equals vllm B=inf
    (NaN unless it does at every 8K and 32K concurrency)."""
    if not all(identical_to_vllm(s, c, n) for c in (K8, K32) for n in s.sessions(c)):
        return math.nan
    top = 0
    for n in s.sessions(K64):
        if not identical_to_vllm(s, K64, n):
            break
        top = n
    return top


def within_own(s: Study, ctx: int, slo: tuple[float, float]) -> list[float]:
    return [s.tax(ctx, slo, where=system(name)) for name in ("sglang", "sarathi", "vllm")]


EIGHT = {("sglang", 512), ("sglang", 2048), ("sglang", 8192), ("sarathi", 512),
         ("sarathi", 2048), ("sarathi", 8192), ("vllm", 8192), ("hlserve", None)}


def long_output_row(s: Study, recs: list[Rec], n_at_200ms: bool = False) -> list[float]:
    """The longer-outputs table's row: taxes at its four SLO pairs (with the concurrency of
    the best point meeting the first, and the third if asked) and the best throughput at 16
    and 128 sessions."""
    kw: dict[str, Any] = {"recs": recs, "where": lambda r: n_of(r) >= 16}
    relaxed = [s.tax(K32, (2000.0, 200.0), **kw)]
    relaxed += [n_of(s.met(K32, (2000.0, 200.0), **kw))] if n_at_200ms else []
    return [s.tax(K32, PROD, **kw), n_of(s.met(K32, PROD, **kw)), s.tax(K32, (INF, 100.0), **kw),
            *relaxed, s.tax(K32, (INF, 50.0), **kw), s.best(K32, 16, recs=recs),
            s.best(K32, 128, recs=recs)]


def eight_at_200(s: Study) -> list[Rec]:
    return [r for r in s.at(K32) if (r["point"]["system"], r["point"]["knob"]) in EIGHT]


def ttft_s(r: Rec, key: str = "p99_ttft_ms") -> float:
    return latency(r, key) / 1e3


def tax_row(s: Study, ctx: int, slo: tuple[float, float], knob: bool = False,
            prefixes: tuple[str, ...] = ("hlserve",)) -> list[float]:
    """A row of section 1's table: tax, [C of] the best point meeting the SLO, its concurrency
    and throughput, and the best point's concurrency and throughput."""
    out = [s.tax(ctx, slo)]
    if s.tax(ctx, slo) < 100:
        met = named(s.met(ctx, slo), *prefixes)
        out += [met["point"]["knob"]] if knob else []
        out += [n_of(met), kthr(met)]
    return [*out, n_of(s.top(ctx)), kthr(s.top(ctx))]


COMPONENT_COLUMNS = ("hlserve-chunked", "hlserve-mix_always", "hlserve-prefill_first",
                     "hlserve-ratchet", "hlserve-no_budget", "hlserve-fcfs", "vs sglang (C=8192)",
                     "vs sarathi (C=B=512)", "vs best sarathi")


def component_claims() -> list[Claim]:
    """Section 3's table, row by row."""
    out = []
    for ctx, n, note in ((K8, 16, ""), (K8, 64, ""), (K8, 128, ""), (K32, 16, ""), (K32, 64, ""),
                         (K32, 128, ""), (K64, 16, ""), (K64, 64, ""), (K64, 128, " (overload)")):
        cells = " | ".join(["{}%"] * len(COMPONENT_COLUMNS))
        out.append(Claim(f"components {ctx // 1024}K/{n}", f"| {ctx // 1024}K / {n}{note} | {cells} |",
                         lambda s, c=ctx, k=n: [s.gain(c, k, col) for col in COMPONENT_COLUMNS]))
    for ctx, note in ((K8, " (no ablations run)"), (K32, ""), (K64, "")):
        out.append(Claim(f"components {ctx // 1024}K/32", f"| {ctx // 1024}K / 32{note} | | | | | | | "
                         "{}% | {}% | {}% |",
                         lambda s, c=ctx: [s.gain(c, 32, col) for col in COMPONENT_COLUMNS[-3:]]))
    return out


# ---- section 7: seeds, no prefix reuse, ITL, steady state ----------------------------------------


def subset(by_seed: dict[int, list[Rec]], where: Callable[[Rec], bool],
           seeds: Iterable[int] | None = None) -> dict[int, list[Rec]]:
    keep = set(by_seed) if seeds is None else set(seeds)
    return {k: [r for r in v if where(r)] for k, v in by_seed.items() if k in keep}


def in_noreuse_grid(s: Study) -> Callable[[Rec], bool]:
    """The points the no-reuse folder has (its first seed's), to compare like with like."""
    first = next(iter(s.noreuse.values()), [])
    have = {key(r) for r in first}
    return lambda r: key(r) in have


def seed_tax(by_seed: dict[int, list[Rec]], ctx: int, slo: tuple[float, float],
             tpot_key: str = "p99_tpot_ms", sessions: int | None = None) -> Interval:
    return tax_over_seeds(by_seed, ctx, slo, sessions=sessions, tpot_key=tpot_key)


def computed_row(s: Study) -> list[float]:
    """Section 7.7: the 32K production tax over computed tokens, then over served tokens
    counted the same way (per request), then the cached share of prompt tokens."""
    seeds = {seed: with_computed(recs) for seed, recs in s.seeds.items()}
    return [*pct_ci(tax_over_seeds(seeds, K32, PROD, metric=COMPUTED_METRIC)),
            *pct_ci(tax_over_seeds(seeds, K32, PROD, metric="total_token_throughput")),
            cached_share(s.seeds, K32)]


# the 32K subset of h20-seeds rerun over seeds 0-2 with the window's computed-token count
COMPUTED_RUN = ROOT / "docs" / "study" / "h20-computed"


def computed_window_row(s: Study) -> list[float]:
    """Section 7.7: the rerun's points that reproduce the stored window throughput exactly,
    of all its points; then the 32K production tax over computed tokens in the window, and
    over served tokens from the same runs."""
    rerun = load_by_seed(COMPUTED_RUN)
    stored = {(seed, key(r)): r for seed, recs in s.seeds.items() for r in recs}
    pts = [(seed, r) for seed, recs in rerun.items() for r in recs]
    same = sum(1 for seed, r in pts
               if (seed, key(r)) in stored and throughput(stored[(seed, key(r))]) == throughput(r))
    return [same, len(pts),
            *pct_ci(tax_over_seeds(rerun, K32, PROD, metric=WINDOW_COMPUTED_METRIC)),
            *pct_ci(tax_over_seeds(rerun, K32, PROD))]


AT256 = ROOT / "docs" / "study" / "h20-256"  # throughput mode and sglang C=8192 at 256 sessions


@functools.cache
def points_256() -> dict[tuple[int, str], Rec]:
    """The h20-256 points by (context, system), read once for both claims."""
    return {(r["point"]["context"], r["point"]["system"]): r for r in load_points(AT256)}


def at_256(s: Study) -> list[float]:
    """Section 7.8: throughput (K tok/s) of throughput mode and sglang C=8192 at 128 and 256
    sessions, 32K then 64K (seed 0), and the 64K peak (64 sessions)."""
    big = points_256()
    out = []
    for ctx in (K32, K64):
        out += [kthr(s.one(ctx, 128, "hlserve")), kthr(big[(ctx, "hlserve")]),
                kthr(s.one(ctx, 128, "sglang", 8192)), kthr(big[(ctx, "sglang")])]
    return [*out, kthr(s.one(K64, 64, "hlserve"))]


def cached_256(s: Study) -> list[float]:
    """Section 7.8: cached share of prompt tokens (%), throughput mode at 32K and 128 / 256
    sessions, sglang C=8192 at 64K and 256; then the 256 points' turnover span, 32K, 64K."""
    big = points_256()
    share = lambda r: 100 * r["metrics"]["cached_tokens"] / r["metrics"]["total_input_tokens"]  # noqa: E731
    turn = lambda ctx: span(big[(ctx, n)]["metrics"]["turnover"] for n in ("hlserve", "sglang"))  # noqa: E731
    return [share(s.one(K32, 128, "hlserve")), share(big[(K32, "hlserve")]),
            share(big[(K64, "sglang")]), *turn(K32), *turn(K64)]


def pct_ci(iv: Interval) -> list[float]:
    """Mean and half-width of a tax (%)."""
    hw = 0.0 if iv.ci is None else max(iv.mean - iv.ci[0], iv.ci[1] - iv.mean)
    return [100 * iv.mean, 100 * hw]


def seed_values(by_seed: dict[int, list[Rec]], where: Callable[[Rec], bool], metric: str,
                ) -> list[float]:
    return [float(r["metrics"][metric]) for recs in by_seed.values() for r in recs
            if where(r) and r["metrics"].get(metric) is not None]


def at_cell(ctx: int, n: int, label: str | None = None) -> Callable[[Rec], bool]:
    return lambda r: (r["point"]["context"] == ctx and n_of(r) == n
                      and (label is None or r["label"] == label))


def cached_share(by_seed: dict[int, list[Rec]], ctx: int) -> float:
    """Prompt tokens served from the prefix cache (%), over the seeds' points at ``ctx``."""
    cached = sum(r["metrics"].get("cached_tokens") or 0 for v in by_seed.values() for r in v
                 if r["point"]["context"] == ctx)
    prompt = sum(r["metrics"].get("total_input_tokens") or 0 for v in by_seed.values() for r in v
                 if r["point"]["context"] == ctx)
    return 100 * cached / prompt


def split_share(ctx: int, reuse: bool, chunk_size: int = 8192, sessions: int = 500) -> float:
    """Rounds (%) whose uncached prompt is longer than a chunk, from the workload generator:
    with reuse a round's new tokens are its tool result (the rest is cached); without, all
    but the shared system prompt."""
    from hlserve.driver.workloads import AgentWorkload

    w = AgentWorkload.for_context(ctx, sessions, prefix_reuse=reuse)
    split = total = 0
    for i in range(sessions):
        sess, cached = w.make_session(i), w.system_prompt_len
        while not sess.done:
            prompt, out = sess.next_request()
            split += len(prompt) - cached > chunk_size
            total += 1
            sess.complete([7] * out)
            cached = len(sess.context) if reuse else w.system_prompt_len
    return 100 * split / total


def turnovers(by_seed: dict[int, list[Rec]], where: Callable[[Rec], bool] = lambda r: True,
              ) -> list[float]:
    return seed_values(by_seed, where, "turnover")


SLO_NAMES = {PROD: "2 s / 100 ms", STRICT: "1 s / 50 ms", (INF, 100.0): "TTFT free / 100 ms"}
SEED_TAX_ROWS = ((K8, PROD), (K8, STRICT), (K32, PROD), (K32, STRICT), (K32, (INF, 100.0)),
                 (K64, PROD), (K64, (INF, 100.0)))
ITL_ROWS = ("throughput mode", "sglang C=8192", "vllm B=16384", "sarathi C=B=2048",
            "sarathi C=B=512")


def seed_tax_row(s: Study, ctx: int, slo: tuple[float, float]) -> list[float]:
    iv = seed_tax(s.seeds, ctx, slo)
    return [*pct_ci(iv), *(100 * v for v in iv.values)]


def itl_row(s: Study, ctx: int, n: int, label: str) -> list[float]:
    """TPOT p99 (seeds 0-2), ITL p99 and the longest stall's median and p99 (seeds 1-2)."""
    w = at_cell(ctx, n, "hlserve" if label == "throughput mode" else label)
    return [statistics.mean(seed_values(s.seeds, w, m)) for m in
            ("p99_tpot_ms", "p99_itl_ms", "median_longest_stall_ms", "p99_longest_stall_ms")]


def itl_spread(s: Study, ctx: int) -> float:
    """How far apart (points) the seeds' ITL-based taxes at the production targets are."""
    vs = [100 * v for v in seed_tax(s.seeds, ctx, PROD, "p99_itl_ms").values if math.isfinite(v)]
    return max(vs) - min(vs)


def edge_32(s: Study) -> list[float]:
    """32K/32: TPOT p99 range of all but Sarathi's C = B <= 512, and those two's TTFT p99 (s)."""
    small_ = lambda r: r["point"]["system"] == "sarathi" and (r["point"]["knob"] or INF) <= 512  # noqa: E731
    cell = at_cell(K32, 32)
    tpot = seed_values(s.seeds, lambda r: cell(r) and not small_(r), "p99_tpot_ms")
    ttft = seed_values(s.seeds, lambda r: cell(r) and small_(r), "p99_ttft_ms")
    return [min(tpot), max(tpot), min(ttft) / 1e3, max(ttft) / 1e3]


NOREUSE_SLOS = ((PROD, "2 s / 100 ms"), ((INF, 100.0), "TTFT free / 100 ms"),
                ((INF, 200.0), "TTFT free / 200 ms"))
GAIN_CELLS = ((K32, 16), (K32, 64), (K64, 16), (K64, 64))


def reuse_like(s: Study) -> dict[int, list[Rec]]:
    """The seeded points with reuse that the no-reuse folder also has, on its seeds."""
    return subset(s.seeds, in_noreuse_grid(s), seeds=s.noreuse.keys())


def noreuse_tax_row(s: Study, ctx: int, slo: tuple[float, float]) -> list[float]:
    return [*pct_ci(seed_tax(reuse_like(s), ctx, slo)), *pct_ci(seed_tax(s.noreuse, ctx, slo))]


def gain_pct(by_seed: dict[int, list[Rec]], ctx: int, n: int, base: tuple[str, int | None],
             ours: tuple[str, int | None] = ("hlserve", None)) -> list[float]:
    """Gain (%) of ``ours`` over ``base`` paired by seed, and its interval's ends."""
    from hlserve.study.seeds import gain_over_seeds

    v = gain_over_seeds(by_seed, (ctx, n, *ours), (ctx, n, *base))
    if v is None or v.ci is None:
        raise ValueError(f"no paired gain at {ctx}/{n} over {base}")
    return [100 * (v.ratio - 1), 100 * (v.ci[0] - 1), 100 * (v.ci[1] - 1)]


def best_k(by_seed: dict[int, list[Rec]], ctx: int) -> float:
    from hlserve.study.seeds import best_over_seeds

    return best_over_seeds(by_seed, ctx, None)[0].mean / 1e3


def min_ttft_s(by_seed: dict[int, list[Rec]], ctx: int) -> float:
    return min(seed_values(by_seed, lambda r: r["point"]["context"] == ctx, "p99_ttft_ms")) / 1e3


def prefill_s(tokens: int) -> float:
    """The cost model's time (s) for one prefill of ``tokens`` alone on the study's machine
    (what ``hlserve cost --prefill`` prints)."""
    from hlserve.sim.cost import CostModel
    from hlserve.sim.hardware import get_hardware
    from hlserve.sim.model_specs import resolve_model_spec

    model = CostModel(resolve_model_spec("Qwen2.5-32B")[1], get_hardware("H20"), tp=8)
    return model.prefill(tokens).total


def noreuse_claims() -> list[Claim]:
    out = [
        Claim("no-reuse seeds", "`docs/study/h20-noreuse/` holds the same configurations at 32K and "
              "64K, 4–128 sessions, and at 8K, 16–128 sessions, on seeds 0–{}",
              lambda s: [max(s.noreuse)]),
        Claim("no-reuse: a 30K prefill", "a 30,000-token prefill alone takes {} s on 8×H20",
              lambda s: [prefill_s(30000)]),
        Claim("no-reuse at 8K", "At 8K, where a round's whole context prefills in about {} s, the "
              "production pair is still met without reuse, but at a tax of {} ± {}% against {}% "
              "with it, and the best throughput falls from {}K to {}K tok/s",
              lambda s: [prefill_s(8192 - 2048), *noreuse_tax_row(s, K8, PROD)[2:],
                         noreuse_tax_row(s, K8, PROD)[0], best_k(reuse_like(s), K8),
                         best_k(s.noreuse, K8)]),
        Claim("split shares", "a chunk of 8192 tokens splits {}% of rounds at 32K and {}% at 64K; "
              "without it, {}% and {}%",
              lambda s: [split_share(K32, True), split_share(K64, True), split_share(K32, False),
                         split_share(K64, False)]),
        Claim("cached shares", "The prefix cache serves {}% (32K) and {}% (64K) of prompt tokens "
              "with reuse, {}% and {}% without",
              lambda s: [cached_share(reuse_like(s), K32), cached_share(reuse_like(s), K64),
                         cached_share(s.noreuse, K32), cached_share(s.noreuse, K64)]),
        Claim("best throughput", "The best throughput falls from {}K to {}K tok/s at 32K and from "
              "{}K to {}K at 64K",
              lambda s: [best_k(reuse_like(s), K32), best_k(s.noreuse, K32),
                         best_k(reuse_like(s), K64), best_k(s.noreuse, K64)]),
        Claim("no-reuse saturation", "extra sessions add little: at 32K it is within {}% of its "
              "best from 16 sessions on",
              lambda s: [100 * (1 - min(best_k(subset(s.noreuse, lambda r, k=n: n_of(r) == k), K32)
                                        for n in (16, 32, 64, 128)) / best_k(s.noreuse, K32))],
              ("ceil",)),
        Claim("two-stage vs prefill-first over seeds", "it gains what mixing itself gains, {}–{}% "
              "with intervals that exclude zero",
              lambda s: span(gain_pct(s.seeds, c, n, ("hlserve-prefill_first", None))[0]
                             for c, n in GAIN_CELLS[:3])),
        Claim("64K/200 ms with and without reuse", "a 200 ms target ({}% against {}%)",
              lambda s: [noreuse_tax_row(s, K64, (INF, 200.0))[0],
                         noreuse_tax_row(s, K64, (INF, 200.0))[2]]),
        Claim("no-reuse TTFT floor", "TTFT p99 is at least {} s at 32K and {} s at 64K at every "
              "concurrency, 4 sessions included", lambda s: [min_ttft_s(s.noreuse, K32),
                                                             min_ttft_s(s.noreuse, K64)],
              ("floor", "floor")),
        Claim("greedy prefill proxy", "SGLang's C = 8192 against its unchunked prefill, paired by "
              "seed at 16 sessions: {}% at 32K and {}% at 64K with reuse, {}% and {}% without",
              lambda s: [gain_pct(reuse_like(s), c, 16, ("sglang", 8192), ("sglang", None))[0]
                         for c in (K32, K64)]
              + [gain_pct(s.noreuse, c, 16, ("sglang", 8192), ("sglang", None))[0]
                 for c in (K32, K64)]),
    ]
    for ctx in (K8, K32, K64):
        for slo, name in NOREUSE_SLOS:
            out.append(Claim(f"no-reuse tax {ctx // 1024}K {name}",
                             f"| {ctx // 1024}K | {name} | {{}} ± {{}}% | {{}} ± {{}}% |",
                             lambda s, c=ctx, o=slo: noreuse_tax_row(s, c, o)))
    for ctx, n in GAIN_CELLS:
        out.append(Claim(f"two-stage over seeds {ctx // 1024}K/{n}",
                         f"| {ctx // 1024}K / {n} | {{}}% [{{}}, {{}}] | {{}}% [{{}}, {{}}] |",
                         lambda s, c=ctx, k=n: gain_pct(s.seeds, c, k, ("hlserve-mix_always", None))
                         + gain_pct(s.seeds, c, k, ("hlserve-prefill_first", None))))
        for base, name in ((("sglang", 8192), "sglang C=8192"), (("vllm", 8192), "vllm B=8192")):
            out.append(Claim(f"no-reuse gain {ctx // 1024}K/{n} {name}",
                             f"| {ctx // 1024}K / {n} | {name} | {{}}% [{{}}, {{}}] | {{}}% [{{}}, {{}}] |",
                             lambda s, c=ctx, k=n, b=base: gain_pct(reuse_like(s), c, k, b)
                             + gain_pct(s.noreuse, c, k, b)))
    return out


def section7_claims() -> list[Claim]:
    out = [
        Claim("seeded points per seed", "`docs/study/h20-seeds/` ({} points per seed",
              lambda s: [len(next(iter(s.seeds.values())))]),
        Claim("seeded TTFT-free taxes", "With TTFT free the 32K tax is {} ± {}%, but 64K's 9% of "
              "section 1 is one seed's: {}%, {}% and {}% in seeds 0–2",
              lambda s: [*pct_ci(seed_tax(s.seeds, K32, (INF, 100.0))),
                         *(100 * v for v in seed_tax(s.seeds, K64, (INF, 100.0)).values)]),
        Claim("seeded 32K tax", "The headline holds: 18% at 32K is {} ± {}% over seeds",
              lambda s: pct_ci(seed_tax(s.seeds, K32, PROD))),
        Claim("256 sessions", "At 32K throughput mode goes from {}K tok/s at 128 sessions to "
              "{}K at 256, and sglang C=8192 from {}K to {}K; at 64K from {}K to {}K and from "
              "{}K to {}K, past a peak of {}K", at_256),
        Claim("256 sessions: cache", "at 32K the prompt tokens served from the cache fall from "
              "{}% to {}% for throughput mode, and SGLang's default at 64K and 256 sessions keeps "
              "{}%. The 256-session points are transients (turnover {}-{} at 32K, {}-{} at 64K)",
              cached_256),
        Claim("computed-token tax, windowed", "reproduces the stored window throughput of {} of its "
              "{} points exactly. Over the tokens computed inside the window, the 32K tax at the "
              "production pair is {} ± {}%, against {} ± {}% over served tokens from the same "
              "runs", computed_window_row),
        Claim("computed-token tax", "over computed tokens the 32K tax at the production pair is "
              "{} ± {}%, against {} ± {}% over served tokens counted the same way, per measured "
              "request; {}% of the prompt tokens", computed_row),
        Claim("brief: seeded taxes", "32K's tax at the production pair is {} ± {}% (95% interval), "
              "8K's is {}% and 64K's {}% in every seed; the strict pair costs {} ± {}% at 8K",
              lambda s: [*pct_ci(seed_tax(s.seeds, K32, PROD)),
                         max(seed_tax(s.seeds, K8, PROD).values) * 100,
                         min(seed_tax(s.seeds, K64, PROD).values) * 100,
                         *pct_ci(seed_tax(s.seeds, K8, STRICT))]),
        Claim("brief: no-reuse at 8K", "at 8K it rises from {}% to {} ± {}%",
              lambda s: [noreuse_tax_row(s, K8, PROD)[0], *noreuse_tax_row(s, K8, PROD)[2:]]),
        Claim("brief: no-reuse TTFT", "TTFT p99 is at least {} s at 32K even at {} sessions",
              lambda s: [min_ttft_s(s.noreuse, K32), min(n_of(r) for r in s.noreuse[0])],
              ("floor", "round")),
        Claim("brief: ITL", "throughput mode has TPOT p99 {} ms but ITL p99 {} ms, and a stream's "
              "longest stall is {} s at its p99. With ITL p99 in TPOT's place the tax at 8K is {}% "
              "instead of {}%",
              lambda s: [*itl_row(s, K32, 16, "throughput mode")[:2],
                         itl_row(s, K32, 16, "throughput mode")[3] / 1e3,
                         pct_ci(seed_tax(s.seeds, K8, PROD, "p99_itl_ms"))[0],
                         pct_ci(seed_tax(s.seeds, K8, PROD))[0]]),
        Claim("beside the published: tested", "on ITL p99 instead of TPOT p99 it is {}% at 8K and "
              "{}–{}% at 32K",
              lambda s: [pct_ci(seed_tax(s.seeds, K8, PROD, "p99_itl_ms"))[0],
                         *span(100 * v for v in seed_tax(s.seeds, K32, PROD, "p99_itl_ms").values
                               if math.isfinite(v))]),
        Claim("32K/32 edge", "every configuration but Sarathi's C = B ≤ 512 has TPOT p99 between "
              "{} and {} ms in the three seeds, against the 100 ms target, and those two have "
              "TTFT p99 of {}–{} s", edge_32, ("floor", "ceil", "floor", "ceil")),
        Claim("32K/16 meets in every seed", "At 32K and 16 sessions throughput mode meets the pair "
              "in all {} seeds", lambda s: [meets_in(s.seeds, (K32, 16, "hlserve", None), PROD)]),
        Claim("seeds move throughput", "(32K, 32 sessions: {}K against {}K tok/s for seeds 0 and 1)",
              lambda s: [kthr(next(r for r in s.seeds[i] if at_cell(K32, 32, "hlserve")(r)))
                         for i in (0, 1)]),
        Claim("stall at p99", "while a stream stalls for about {} s at its p99",
              lambda s: [itl_row(s, K32, 16, "throughput mode")[3] / 1e3]),
        Claim("small chunks bound the gaps", "(C = B = 512: ITL p99 {} ms)",
              lambda s: [itl_row(s, K32, 16, "sarathi C=B=512")[1]]),
        Claim("ITL taxes", "raises the tax at 8K from {}% to {}% (seeds 1 and 2 within {} "
              "points), and at 32K from {}% to {}% and {}% in seeds 1 and 2",
              lambda s: [pct_ci(seed_tax(s.seeds, K8, PROD))[0],
                         pct_ci(seed_tax(s.seeds, K8, PROD, "p99_itl_ms"))[0],
                         itl_spread(s, K8),
                         pct_ci(seed_tax(s.seeds, K32, PROD))[0],
                         *(100 * v for v in seed_tax(s.seeds, K32, PROD, "p99_itl_ms").values[1:])],
              ("round", "round", "ceil", "round", "round", "round")),
        Claim("64K/128 transient", "With reuse only 64K at 128 sessions is one: turnover {}–{} "
              "over the configurations and seeds, against at least {} everywhere else",
              lambda s: [min(turnovers(s.seeds, at_cell(K64, 128))),
                         max(turnovers(s.seeds, at_cell(K64, 128))),
                         min(turnovers(s.seeds, lambda r: not at_cell(K64, 128)(r)))],
              ("floor", "ceil", "floor")),
        Claim("no-reuse transients", "Without prefix reuse (the control of section 7.2) 32K at "
              "128 sessions is one too (turnover {}–{}), as are 64K at 64 and 128 sessions "
              "({}–{}) and some 64K configurations at 32 sessions (from {})",
              lambda s: [min(turnovers(s.noreuse, at_cell(K32, 128))),
                         max(turnovers(s.noreuse, at_cell(K32, 128))),
                         min(turnovers(s.noreuse, lambda r: at_cell(K64, 64)(r) or at_cell(K64, 128)(r))),
                         max(turnovers(s.noreuse, lambda r: at_cell(K64, 64)(r) or at_cell(K64, 128)(r))),
                         min(turnovers(s.noreuse, at_cell(K64, 32)))],
              ("floor", "ceil", "floor", "ceil", "floor")),
        Claim("64K/128 session counts", "(sessions that started and ended inside the window) is "
              "{}–{} for throughput mode, while {}–{} sessions ended per hour",
              lambda s: [*span(seed_values(s.seeds, at_cell(K64, 128, "hlserve"), "sessions_per_hour")),
                         *span(seed_values(s.seeds, at_cell(K64, 128, "hlserve"),
                                           "sessions_ended_per_hour"))]),
    ]
    for ctx, slo in SEED_TAX_ROWS:
        out.append(Claim(f"seeded tax {ctx // 1024}K {SLO_NAMES[slo]}",
                         f"| {ctx // 1024}K | {SLO_NAMES[slo]} | {{}} ± {{}}% | {{}} / {{}} / {{}}% |",
                         lambda s, c=ctx, o=slo: seed_tax_row(s, c, o)))
    for label in ITL_ROWS:
        out.append(Claim(f"ITL row {label}", f"| {label} | {{}} | {{}} | {{}} / {{}} |",
                         lambda s, lb=label: itl_row(s, K32, 16, lb)))
    return out


def wall_times(s: Study) -> list[float]:
    return sorted(r["metrics"]["wall_s"] for r in s.recs)


RATCHET = system("hlserve-ratchet")


def core_minutes(s: Study, sessions: tuple[int, ...]) -> float:
    return sum(r["metrics"]["wall_s"] for r in s.recs if n_of(r) in sessions) / 60


def ratchet_collapsed(r: Rec) -> bool:
    """The ratchet points whose budget collapsed: all but 8K/16."""
    return RATCHET(r) and (r["point"]["context"], n_of(r)) != (K8, 16)


def small(r: Rec) -> bool:
    """Sarathi's C = B <= 512 and the ratchet ablation: the doc's exceptions at 32K."""
    return (system("sarathi")(r) and chunk(r, 0, 512)) or RATCHET(r)


def misses_at_16(s: Study) -> list[float]:
    """The TTFT p99 range (s) of the points missing the production pair at 32K/16, checked to
    be exactly the doc's exceptions."""
    misses = s.at(K32, 16, lambda r: not (latency(r, "p99_ttft_ms") <= PROD[0]
                                          and latency(r, "p99_tpot_ms") <= PROD[1]))
    if {r["label"] for r in misses} != {r["label"] for r in s.at(K32, 16, small)}:
        raise ValueError(f"the points missing it are {sorted(r['label'] for r in misses)}")
    return list(span(ttft_s(r) for r in misses))


def long_output_200(s: Study) -> list[float]:
    return long_output_row(s, eight_at_200(s), n_at_200ms=True)


CLAIMS: list[Claim] = [
    # the introduction and "the answers in brief"
    Claim("points and their window", "`docs/study/h20/`: {} points of {} simulated minutes each",
          lambda s: [len(s.recs), same(*{r["metrics"]["window_s"] / 60 for r in s.recs})]),
    Claim("32K: tax, best meeting it, best", "**32K: {}%.** The best configuration meeting the SLOs "
          "is {} sessions at {}K tok/s. The best without SLOs is {} sessions at {}K tok/s.",
          lambda s: tax_row(s, K32, PROD)),
    Claim("64K: nothing meets TTFT 2 s", "**64K: {}%.** No configuration at any concurrency from {} "
          "to {} sessions meets TTFT p99 ≤ 2 s.",
          lambda s: [s.tax(K64, (2000.0, INF)), min(s.sessions(K64)), max(s.sessions(K64))]),
    Claim("TTFT free taxes", "With TTFT free and TPOT p99 ≤ 100 ms, the tax is {}% (32K) and {}% (64K).",
          lambda s: [s.tax(K32, (INF, 100.0)), s.tax(K64, (INF, 100.0))]),
    Claim("strict pair", "is met by nothing at 32K or 64K (tax {}%). At 8K its tax is {}%.",
          lambda s: [min(s.tax(K32, STRICT), s.tax(K64, STRICT)), s.tax(K8, STRICT)]),
    Claim("growth with context (production)", "- 8K: {}%; 32K: {}%; 64K: {}% at the production pair.",
          lambda s: [s.tax(c, PROD) for c in (K8, K32, K64)]),
    Claim("growth with context (TTFT free)", "- 8K: {}%; 32K: {}%; 64K: {}% with TTFT free and TPOT",
          lambda s: [s.tax(c, (INF, 100.0)) for c in (K8, K32, K64)]),
    Claim("chunks >= 1K: largest loss", "chunks of 1K and more are within {}% of the best",
          lambda s: [max(lost(s, lambda r: chunk(r, 1024, INF) and below_overload(r)))], ("ceil",)),
    Claim("sarathi C=B=512 losses", "Sarathi's C = B = 512 loses {}–{}% up to 16 sessions and up to "
          "{}% at 32–128 sessions",
          lambda s: [*span(lost(s, lambda r: chunk(r, 512, 512) and system("sarathi")(r)
                                and n_of(r) <= 16)),
                     max(lost(s, lambda r: chunk(r, 512, 512) and system("sarathi")(r)
                              and n_of(r) >= 32 and below_overload(r)))]),
    Claim("smaller chunks and the ratchet", "SGLang's C = 512 and the ratchet budget lose up to {}%",
          lambda s: [max(lost(s, lambda r: below_overload(r) and (
              chunk(r, 0, 256) or (chunk(r, 0, 512) and system("sglang")(r)) or RATCHET(r))))]),
    Claim("feasible concurrency", "(32K: up to {} sessions)",
          lambda s: [max(feasible_sessions(s, K32, PROD))]),
    Claim("infeasible concurrency", "(32K: {} sessions; 64K: {} sessions, TTFT-bound)",
          lambda s: [infeasible_from(s, K32, PROD), infeasible_from(s, K64, PROD)]),
    Claim("throughput of extra sessions", "8 → 128 sessions at 32K adds {}%, at 64K (4 → 64) {}%.",
          lambda s: [100 * (s.best(K32, 128) / s.best(K32, 8) - 1),
                     100 * (s.best(K64, 64) / s.best(K64, 4) - 1)]),
    Claim("vs sglang C=8192", "(C = 8192): +{}% to +{}% at 32K, and {}% to +{}% at 64K up to 64 "
          "sessions.",
          lambda s: [*span(gains(s, "vs sglang (C=8192)", ctxs=(K32,))),
                     *span(gains(s, "vs sglang (C=8192)", not_overload, (K64,)))]),
    Claim("vs sarathi C=B=512", "(C = B = 512): +{}% (8K) to +{}% (32K, 128 sessions).",
          lambda s: [min(gains(s, "vs sarathi (C=B=512)", not_overload)),
                     s.gain(K32, 128, "vs sarathi (C=B=512)")]),
    Claim("vs best sarathi", "which is greedy enough to be the same policy): within ±{}%.",
          lambda s: [max(abs(g) for g in gains(s, "vs best sarathi", not_overload))]),
    Claim("overload", "{}× at full context) it is {}% behind `sglang` and {}× ahead of the FCFS",
          lambda s: [128 * K64 / pool(s, K64), -s.gain(K64, 128, "vs sglang (C=8192)"),
                     kthr(s.one(K64, 128, "hlserve")) / s.best(K64, 128, where=system(*FCFS[:2]))]),
    Claim("mixing over prefill-first", "prefill-first policy does not do: +{}% to +{}%.",
          lambda s: list(span(gains(s, "hlserve-prefill_first", not_overload)))),
    # section 1
    Claim("table: 8K production", "| 8K | 2 s / 100 ms | **{}%** | throughput mode, {} sessions, "
          "{}K tok/s | the same |", lambda s: tax_row(s, K8, PROD)[:3]),
    Claim("table: 8K strict", "| 8K | 1 s / 50 ms | **{}%** | sarathi C=B={}, {} sessions, {}K | "
          "{} sessions, {}K |", lambda s: tax_row(s, K8, STRICT, True, ("sarathi",))),
    Claim("table: 32K production", "| 32K | 2 s / 100 ms | **{}%** | throughput mode (any variant), "
          "{} sessions, {}K | {} sessions, {}K |", lambda s: tax_row(s, K32, PROD)),
    Claim("table: 32K strict", "| 32K | 1 s / 50 ms | **{}%** | none | {} sessions, {}K |",
          lambda s: tax_row(s, K32, STRICT)),
    Claim("table: 32K TTFT free", "| 32K | TTFT free / 100 ms | {}% | sarathi C=B={}, {} sessions, "
          "{}K | {} sessions, {}K |", lambda s: tax_row(s, K32, (INF, 100.0), True, ("sarathi",))),
    Claim("table: 64K production", "| 64K | 2 s / 100 ms | **{}%** | none (TTFT p99 ≥ {} s "
          "everywhere) | {} sessions, {}K |",
          lambda s: [s.tax(K64, PROD), min(ttft_s(r) for r in s.at(K64)),
                     *tax_row(s, K64, PROD)[1:]], ("round", "floor")),
    Claim("table: 64K strict", "| 64K | 1 s / 50 ms | **{}%** | none | {} sessions, {}K |",
          lambda s: tax_row(s, K64, STRICT)),
    Claim("table: 64K TTFT free", "| 64K | TTFT free / 100 ms | {}% | throughput mode with the "
          "ratchet budget, {} sessions, {}K | {} sessions, {}K |",
          lambda s: tax_row(s, K64, (INF, 100.0), prefixes=("hlserve-ratchet",))),
    Claim("table: 64K 5 s", "| 64K | 5 s / 100 ms | {}% | throughput mode, {} sessions, {}K | "
          "{} sessions, {}K |", lambda s: tax_row(s, K64, (5000.0, 100.0))),
    Claim("tax curve at 32K", "At 32K the curve falls from {}% at 25 ms, through {}% at 35 ms, {}% "
          "at 50 ms, {}% at 70–100 ms and {}% at 150–200 ms ({} sessions meet those), to {}% at "
          "500 ms. With TTFT free, it falls faster: {}% at 50 ms, {}% at 100 ms, {} from 300 ms.",
          lambda s: [s.tax(K32, (2000.0, 25.0)), s.tax(K32, (2000.0, 35.0)),
                     s.tax(K32, (2000.0, 50.0)),
                     same(s.tax(K32, (2000.0, 70.0)), s.tax(K32, PROD)),
                     same(s.tax(K32, (2000.0, 150.0)), s.tax(K32, (2000.0, 200.0))),
                     same(n_of(s.met(K32, (2000.0, 150.0))), n_of(s.met(K32, (2000.0, 200.0)))),
                     s.tax(K32, (2000.0, 500.0)), s.tax(K32, (INF, 50.0)), s.tax(K32, (INF, 100.0)),
                     max(s.tax(K32, (INF, t)) for t in (300.0, 500.0, 1000.0, 2000.0))]),
    Claim("64K alone", "Even alone on the machine (4 sessions: TTFT p99 {} s)",
          lambda s: [ttft_s(s.one(K64, 4, "hlserve"))]),
    # section 2
    Claim("best at each concurrency, 8K", "| 8K | | | {}K | {}K | {}K | {}K |",
          lambda s: [s.best(K8, n) for n in (16, 32, 64, 128)]),
    Claim("best at each concurrency, 32K", "| 32K | {}K | {}K | {}K | {}K | {}K | {}K |",
          lambda s: [s.best(K32, n) for n in (4, 8, 16, 32, 64, 128)]),
    Claim("best at each concurrency, 64K", "| 64K | {}K | {}K | {}K | {}K | {}K | {}K (thrashing) |",
          lambda s: [s.best(K64, n) for n in (4, 8, 16, 32, 64, 128)]),
    Claim("32K/64: TPOT and the exceptions' TTFT", "64 sessions: TPOT p99 ≥ {} ms for every "
          "configuration except Sarathi's C = B ≤ 512 and the ratchet ablation, and those have "
          "TTFT p99 ≥ {} s",
          lambda s: [min(latency(r, "p99_tpot_ms") for r in s.at(K32, 64, lambda r: not small(r))),
                     min(ttft_s(r) for r in s.at(K32, 64, small))], ("floor", "floor")),
    Claim("32K/32: TPOT and the exceptions' TTFT", "32 sessions: TPOT p99 ≥ {} ms for every "
          "configuration except Sarathi's C = B ≤ 512, whose TTFT p99 is {} s and {} s",
          lambda s: [min(latency(r, "p99_tpot_ms") for r in s.at(K32, 32, lambda r: not small(r))),
                     ttft_s(s.one(K32, 32, "sarathi", 512)), ttft_s(s.one(K32, 32, "sarathi", 256))],
          ("floor",)),
    Claim("32K/16: who misses", "16 sessions: every configuration meets the pair except Sarathi's "
          "C = B ≤ 512 and the ratchet ablation (TTFT p99 {}–{} s).", lambda s: misses_at_16(s)),
    Claim("32K: extra sessions' throughput", "moderate at 32K (+{}%)",
          lambda s: [100 * (s.best(K32, 128) / s.best(K32, 16) - 1)]),
    Claim("tool results 64K / 8K (the workload generator)", "the mean tool result is about {}× "
          "larger at 64K than at 8K ({} against {} tokens",
          lambda s: [tool_mean(K64) / tool_mean(K8), tool_mean(K64), tool_mean(K8)]),
    Claim("overload: pool and full context", "128 sessions need about twice the KV pool ({}M tokens) "
          "on average, and {}× at their full context.",
          lambda s: [pool(s, K64) / 1e6, 128 * K64 / pool(s, K64)]),
    Claim("overload: best drops", "the best drops from {}K to {}K.",
          lambda s: [s.best(K64, 64), s.best(K64, 128)]),
    Claim("overload: FCFS thrash", "The FCFS systems (vLLM, Sarathi) thrash: {}–{}K tok/s, TTFT p99 "
          "{}–{} minutes.",
          lambda s: [*span(kthr(r) for r in s.at(K64, 128, system("vllm", "sarathi"))),
                     *span(ttft_s(r) / 60 for r in s.at(K64, 128, system("vllm", "sarathi")))]),
    Claim("overload: LPM systems", "The LPM systems keep {}–{}K tok/s",
          lambda s: list(span(kthr(r) for r in s.at(K64, 128, lambda r: not system(*FCFS)(r))))),
    Claim("longer outputs: 200 tokens", "| 200 tokens | {}% ({} sessions) | {}% | {}% ({} sessions) "
          "| {}% | {}K → {}K tok/s |", lambda s: long_output_200(s)),
    Claim("longer outputs: 1,000 tokens", "| 1,000 tokens | **{}%** ({} sessions) | {}% | {}% | {}% "
          "| {}K → {}K tok/s |", lambda s: long_output_row(s, s.long_out)),
    Claim("longer outputs: lowest TPOT at 128", "(At 128 sessions the lowest TPOT p99 is {} ms",
          lambda s: [min(latency(r, "p99_tpot_ms") for r in s.long_out if n_of(r) == 128)]),
    # section 3
    *component_claims(),
    Claim("throughput mode = vllm B=inf", "At 8K and 32K at every concurrency, and at 64K up to {} "
          "sessions, its metrics are identical to `vllm B=inf`", lambda s: [identical_up_to(s)]),
    Claim("64K/64: pool, LPM, vllm B=inf", "passes the pool's {}M tokens, and LPM keeps {}% more "
          "throughput than FCFS: `vllm B=inf` falls to {}K.)",
          lambda s: [pool(s, K64) / 1e6, 100 * (kthr(s.one(K64, 64, "hlserve"))
                                                / kthr(s.one(K64, 64, "vllm")) - 1),
                     kthr(s.one(K64, 64, "vllm"))]),
    Claim("mixing gain by context", "Decodes share prefill iterations instead of waiting for them: "
          "+{}–{}% at 8K, +{}–{}% at 32K, +{}–{}% at 64K.",
          lambda s: [v for c in (K8, K32, K64)
                     for v in span(gains(s, "hlserve-prefill_first", not_overload, (c,)))]),
    Claim("two-stage against prefill-first", "two-stage mixing gains +{}% to +{}% below overload, "
          "and +{}% in overload.",
          lambda s: [*span(gains(s, "hlserve-prefill_first", not_overload)),
                     s.gain(K64, 128, "hlserve-prefill_first")]),
    Claim("prefill-first against always-mix in overload", "In overload prefill-first ({}K tok/s) "
          "comes within {}% of always-mix ({}K), and stage 2 is ahead of both.",
          lambda s: [kthr(s.one(K64, 128, "hlserve-prefill_first")),
                     100 * (1 - kthr(s.one(K64, 128, "hlserve-prefill_first"))
                            / kthr(s.one(K64, 128, "hlserve-mix_always"))),
                     kthr(s.one(K64, 128, "hlserve-mix_always"))], ("round", "ceil")),
    Claim("greedy prefill in overload", "In overload it gains {}%:",
          lambda s: [s.gain(K64, 128, "hlserve-chunked")]),
    Claim("two-stage against always-mix", "then +{}% (64K/64) and +{}% in overload.",
          lambda s: [s.gain(K64, 64, "hlserve-mix_always"), s.gain(K64, 128, "hlserve-mix_always")]),
    Claim("stage 2 in overload", "so a waiting round waits long: TTFT p50 {} s against {} s for "
          "always-mix. The decodes meanwhile run alone, at a median {} ms per token against {} ms "
          "mixed, so rounds finish and free their KV sooner: in the window throughput mode serves "
          "{}M prompt tokens against {}M, at the same prefix-cache hit rate ({}% and {}%)",
          lambda s: [ttft_s(s.one(K64, 128, "hlserve"), "median_ttft_ms"),
                     ttft_s(s.one(K64, 128, "hlserve-mix_always"), "median_ttft_ms"),
                     latency(s.one(K64, 128, "hlserve"), "median_tpot_ms"),
                     latency(s.one(K64, 128, "hlserve-mix_always"), "median_tpot_ms"),
                     *(s.one(K64, 128, a)["metrics"]["total_input_tokens"] / 1e6
                       for a in ("hlserve", "hlserve-mix_always")),
                     *(100 * s.one(K64, 128, a)["metrics"]["cached_tokens"]
                       / s.one(K64, 128, a)["metrics"]["total_input_tokens"]
                       for a in ("hlserve", "hlserve-mix_always"))]),
    Claim("brief: two-stage when the pool is short", "(then +{}% at 64K/64 and +{}% in overload, "
          "against always mixing)",
          lambda s: [s.gain(K64, 64, "hlserve-mix_always"), s.gain(K64, 128, "hlserve-mix_always")]),
    Claim("two-stage table: default", "| 0.90 / 0.70 (default) | {} | {} (TTFT p50 {} s) |",
          lambda s: [throughput(s.one(K64, 64, "hlserve")), throughput(s.one(K64, 128, "hlserve")),
                     ttft_s(s.one(K64, 128, "hlserve"), "median_ttft_ms")]),
    Claim("two-stage table: always mix", "| always mix | {} | {} ({} s) |",
          lambda s: [throughput(s.one(K64, 64, "hlserve-mix_always")),
                     throughput(s.one(K64, 128, "hlserve-mix_always")),
                     ttft_s(s.one(K64, 128, "hlserve-mix_always"), "median_ttft_ms")]),
    Claim("ratchet: collapsed budget", "TPOT p99 falls to {}–{} ms, TTFT p99 reaches {}–{} s, and "
          "throughput mode is up to {}% ahead of it at 32K ({}% at 8K/128)",
          lambda s: [*span(latency(r, "p99_tpot_ms") for r in s.recs if ratchet_collapsed(r)),
                     *span(ttft_s(r) for r in s.recs if ratchet_collapsed(r)),
                     max(gains(s, "hlserve-ratchet", ctxs=(K32,))),
                     s.gain(K8, 128, "hlserve-ratchet")]),
    Claim("ratchet in overload", "(−{}% for EMA)", lambda s: [-s.gain(K64, 128, "hlserve-ratchet")]),
    Claim("LPM", "**LPM is worth {}% at 64K/64 and {}× at 64K/128.**",
          lambda s: [s.gain(K64, 64, "hlserve-fcfs"), 1 + s.gain(K64, 128, "hlserve-fcfs") / 100]),
    # section 4
    Claim("beside the published: taxes", "| {}% at 32K, {}% at 64K (TTFT-infeasible); with TTFT "
          "free, {}% / {}%;",
          lambda s: [s.tax(K32, PROD), s.tax(K64, PROD), s.tax(K32, (INF, 100.0)),
                     s.tax(K64, (INF, 100.0))]),
    Claim("beside the published: extra sessions", "the throughput of extra sessions is small: 16 → "
          "128 sessions adds {}%.", lambda s: [100 * (s.best(K32, 128) / s.best(K32, 16) - 1)]),
    Claim("prompt share at 32K", "this workload is {}% prompt tokens",
          lambda s: [100 * (1 - sum(throughput(r, "window_output_throughput") for r in s.at(K32))
                            / sum(throughput(r) for r in s.at(K32)))]),
    Claim("tax within each preset at 32K", "within each system it is {}% / {}% / {}% (sglang / "
          "sarathi / vllm) at 32K under the production pair", lambda s: within_own(s, K32, PROD)),
    Claim("beside the published: presets", "| +{}% to +{}% over `sglang` (C = 8192) at 32K; {}% to "
          "+{}% at 64K; within ±{}% of the best `sarathi`, +{}–{}% over its strict default |",
          lambda s: [*span(gains(s, "vs sglang (C=8192)", ctxs=(K32,))),
                     *span(gains(s, "vs sglang (C=8192)", not_overload, (K64,))),
                     max(abs(g) for g in gains(s, "vs best sarathi", not_overload)),
                     min(gains(s, "vs sarathi (C=B=512)", not_overload)),
                     s.gain(K32, 128, "vs sarathi (C=B=512)")]),
    Claim("beside the published: greedy prefill", "| {}% / {}% (64 sessions); +{}% only in overload |",
          lambda s: [s.gain(K32, 64, "hlserve-chunked"), s.gain(K64, 64, "hlserve-chunked"),
                     s.gain(K64, 128, "hlserve-chunked")]),
    Claim("beside the published: two-stage", "| {}% / {}% against always mixing and +{}% / +{}% "
          "against prefill-first (64 sessions); {}% and {}% in overload |",
          lambda s: [s.gain(K32, 64, "hlserve-mix_always"), s.gain(K64, 64, "hlserve-mix_always"),
                     s.gain(K32, 64, "hlserve-prefill_first"),
                     s.gain(K64, 64, "hlserve-prefill_first"),
                     s.gain(K64, 128, "hlserve-mix_always"),
                     s.gain(K64, 128, "hlserve-prefill_first")]),
    Claim("beside the published: the pool at 32K", "holds {}M tokens at 32K: {} full 32K sessions",
          lambda s: [pool(s, K32) / 1e6, pool(s, K32) / K32], ("round", "floor")),
    # section 5 and how the numbers were made
    Claim("wall time per point", "The {} stored points record {}–{} s of wall time each (median {} s)",
          lambda s: [len(wall_times(s)), min(wall_times(s)), max(wall_times(s)),
                     statistics.median(wall_times(s))], ("round", "floor")),
    Claim("KV pool", "that is {} M tokens in throughput mode at 64K and {} M with 512-token "
          "chunks: {} sessions at a 32K average context, or {} at full 64K.",
          lambda s: [pool(s, K64) / 1e6, s.one(K32, 16, "sarathi", 512)["kv_pool_tokens"] / 1e6,
                     pool(s, K64) / K32, pool(s, K64) / K64], ("round", "round", "floor", "floor")),
    Claim("main sweep points", "# the main sweep: {} points",
          lambda s: [sum(n_of(r) in (16, 64, 128) for r in s.recs)]),
    Claim("main sweep wall time", "# {} core-minutes of stored wall time (~{} min with 2 jobs)",
          lambda s: [core_minutes(s, (16, 64, 128)), core_minutes(s, (16, 64, 128)) / 2]),
    Claim("lower concurrency points", "lower and intermediate concurrency for the presets and "
          "throughput mode: {} points", lambda s: [sum(n_of(r) in (4, 8, 32) for r in s.recs)]),
    Claim("lower concurrency wall time", "points, # {} core-minutes hlserve study",
          lambda s: [core_minutes(s, (4, 8, 32))]),
]


CLAIMS += section7_claims() + noreuse_claims()


def table(results: list[Result]) -> str:
    w = max(len(r.claim) for r in results)
    lines = [f"{'claim':<{w}}  {'in doc':>16}  {'from points':>22}  OK"]
    lines += [f"{r.claim:<{w}}  {r.in_doc:>16}  {r.from_points:>22}  {'ok' if r.ok else 'NO'}"
              for r in results]
    bad = sum(not r.ok for r in results)
    lines.append(f"{len(results)} numbers, {bad} mismatched")
    return "\n".join(lines)


def replot(points: Path = POINTS) -> list[Path]:
    """Redraw the study's figures from the stored points (no simulation)."""
    from hlserve.study.core import group
    from hlserve.study.study_report import plots

    return plots(group(load_points(points)), points)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--points", type=Path, default=POINTS)
    ap.add_argument("--long-output-points", type=Path, default=OUT1000)
    ap.add_argument("--replot", action="store_true", help="redraw the figures in --points")
    args = ap.parse_args(argv)
    if args.replot:
        for p in replot(args.points):
            print(f"wrote {p}")
    results = check(args.doc.read_text(), Study.load(args.points, args.long_output_points))
    print(table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
