"""The HTML report (``hlserve report RESULT``, ``--report FILE.html``) opened in a real headless
browser (Debian's ``chromium``): the page loads with no script error, every frontier chart
lays out one marker per point of the result (counted from the result's own JSON), each
marker's hover holds its configuration, and a screenshot is kept (under the test's tmp dir,
and copied to ``$HLSERVE_TEST_ARTEFACTS`` where that is set). The file fetches nothing.

The sweep is a simulated one (seconds); the study is the committed ``docs/study/h20``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from hlserve.cli import main
from hlserve.driver.tiers import BEST

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "docs" / "study" / "h20"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no headless browser: Debian's chromium is not installed "
                             "(apt-get install chromium; .ci/run installs it)")
SWEEP = ["sweep", "--sim", "H20", "--tp", "8", "--model", "Qwen2.5-32B", "--chunk-sizes",
         "2048,none", "--sessions", "4", "--rounds", "2", "--no-progress"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A simulated sweep of two points run with ``--report``: (its folder, its report)."""
    tmp = tmp_path_factory.mktemp("sweep")
    out, html = tmp / "sweep", tmp / "sweep.html"
    assert main([*SWEEP, "--out", str(out), "--report", str(html)]) == 0
    return out, html


# ---- the browser ----------------------------------------------------------------------------


class Dom(HTMLParser):
    """What the test reads back from the DOM the browser dumped: the root's attributes, the
    error box's text, and per chart its attributes and its point elements."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.root: dict[str, str] = {}
        self.errors = ""
        self.charts: list[dict] = []
        self._in_errors = False
        self.text = text
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        cls = a.get("class", "").split()
        if tag == "html":
            self.root = a
        elif tag == "pre" and a.get("id") == "report-errors":
            self._in_errors = True
        elif tag == "svg" and "chart" in cls:
            self.charts.append({**a, "items": []})
        elif self.charts and ("pt" in cls or "dist-row" in cls):
            self.charts[-1]["items"].append(a)

    def handle_endtag(self, tag: str) -> None:
        if tag == "pre":
            self._in_errors = False

    def handle_data(self, data: str) -> None:
        if self._in_errors:
            self.errors += data


def browse(html: Path, tmp: Path, name: str) -> Dom:
    """The page's DOM once its scripts ran, and its screenshot kept as an artefact."""
    args = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
            "--no-first-run", f"--user-data-dir={tmp / 'chromium-profile'}",
            "--window-size=1200,2400"]
    done = subprocess.run([*args, "--dump-dom", html.resolve().as_uri()], capture_output=True,
                          text=True, timeout=120, check=True)
    shot = tmp / f"{name}.png"
    subprocess.run([*args, f"--screenshot={shot}", html.resolve().as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 20_000  # a drawn page, not a blank one
    if os.environ.get("HLSERVE_TEST_ARTEFACTS"):
        dest = Path(os.environ["HLSERVE_TEST_ARTEFACTS"])
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, dest / shot.name)
        shutil.copy(html, dest / f"{name}.html")
    return Dom(done.stdout)


def check_page(dom: Dom) -> None:
    assert dom.root.get("data-status") == "ok", "the page's script did not run to its end"
    assert dom.root.get("data-errors") == "0" and not dom.errors.strip(), dom.errors


def frontiers(dom: Dom) -> list[dict]:
    return [c for c in dom.charts if "frontier" in c.get("class", "")]


def offline(html: Path) -> None:
    """Nothing the page would fetch: no script or image source, no stylesheet link."""
    text = html.read_text()
    assert "src=" not in text and "<link" not in text and "@import" not in text
    assert "https://" not in text


def served(m: dict) -> bool:
    return (m.get("completed") or 0) > 0 and not (m.get("failed") or 0) > 0


def drawable(metrics: list[dict], key: str) -> int:
    return sum(1 for m in metrics if served(m) and m.get(key) is not None
               and math.isfinite(m[key]))


# ---- tests ----------------------------------------------------------------------------------


@needs_browser
def test_sweep_report_in_a_browser(sweep: tuple[Path, Path], tmp_path: Path) -> None:
    out, html = sweep
    offline(html)
    summary = json.loads((out / "sweep.json").read_text())
    metrics = [p["metrics"] for p in summary["points"]]
    dom = browse(html, tmp_path, "sweep-report")
    check_page(dom)
    charts = {c["data-key"]: c for c in frontiers(dom)}
    assert set(charts) == {"p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms"}
    for key, c in charts.items():
        n = drawable(metrics, key)
        assert n == len(summary["points"]) == 2
        assert len(c["items"]) == n and c["data-drawn"] == str(n)  # laid out by the browser
        for item, p in zip(c["items"], sorted(summary["points"],
                                              key=lambda p: p["metrics"][key]), strict=True):
            tip = item["data-tip"]  # the hover: the point's configuration and its numbers
            assert tip.startswith(p["label"]) and "C (chunk size) = " in tip
            assert f"B (token budget) = {p['knobs']['token_budget'] or 'none'}" in tip
            assert "engine: " in tip and "total_token_throughput: " in tip
    dists = [c for c in dom.charts if "dist" in c.get("class", "").split()]
    assert {c["data-metric"] for c in dists} == {"ttft", "tpot", "itl", "e2el"}
    for c in dists:  # every point's distribution, from its per-request records
        assert [i["data-label"] for i in c["items"]] == ["C=2048", "C=none"]
        assert c["data-drawn"] == "2" and "from requests" in c["items"][0]["data-tip"]


@needs_browser
def test_study_report_in_a_browser(tmp_path: Path) -> None:
    html = tmp_path / "h20.html"
    assert main(["report", str(STUDY), "-o", str(html)]) == 0
    offline(html)
    recs = [json.loads(p.read_text()) for p in sorted((STUDY / "points").glob("*.json"))]
    dom = browse(html, tmp_path, "study-report")
    check_page(dom)
    charts = frontiers(dom)
    contexts = sorted({r["point"]["context"] for r in recs})
    for ctx in contexts:  # a group per context: each chart one marker per drawable point
        mine = [c for c in charts if c["id"].startswith(f"frontier-{contexts.index(ctx)}-")]
        at = [r["metrics"] for r in recs if r["point"]["context"] == ctx]
        assert {c["data-key"] for c in mine} >= {"p99_ttft_ms", "p99_tpot_ms"}
        for c in mine:
            n = drawable(at, c["data-key"])
            assert n > 0 and len(c["items"]) == n and c["data-drawn"] == str(n)
    assert sum(len(c["items"]) for c in charts if c["data-key"] == "p99_ttft_ms") == len(recs)
    tips = [i["data-tip"] for c in charts for i in c["items"]]
    assert all("sessions" in t and "options: " in t for t in tips)
    assert any(t.startswith("sarathi C=B=512 @ 16\nsarathi, knob 512, context 8192") for t in tips)
    # the tier table per context: the node's production tier as `study --tiers-only` wrote it
    stored = json.loads((STUDY / "tiers.json").read_text())
    for ctx in ("32768", "65536"):
        node = next(r for r in stored[ctx] if r["config"] == BEST and r["tier"] == "production")
        cell = "none meets it" if node["sessions"] is None else (
            f"{node['sessions']} sessions, {node['throughput']:,.0f}, "
            f"tax {100 * node['tax_vs_none']:.0f}%")
        assert cell in dom.text.split('id="tiers"')[1]
    tier_html = dom.text.split('id="tiers"')[1].split("<section")[0]
    configs = {r["config"] for rows in stored.values() for r in rows}
    assert " @ " not in tier_html  # a row per configuration, its concurrencies pooled
    assert tier_html.count("<tr>") == len(stored) * (len(configs) + 1)  # + a head per context


def test_study_report_flag(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``hlserve study --report-only --report FILE.html`` on one cell of the stored study."""
    from hlserve.cli.simulate import main as sim_main

    (tmp_path / "points").mkdir()
    cell = sorted((STUDY / "points").glob("ctx8192_n16_*.json"))
    for p in cell:
        shutil.copy(p, tmp_path / "points" / p.name)
    shutil.copy(STUDY / "spec.json", tmp_path / "spec.json")
    html = tmp_path / "study.html"
    assert sim_main(["study", "--out", str(tmp_path), "--report-only", "--report", str(html)]) == 0
    assert f"wrote {html}" in capsys.readouterr().out
    page = html.read_text()
    assert page.count('class="pt tip"') == 2 * len(cell)  # against p99 TTFT and p99 TPOT
    assert "Human tax, concurrency chosen freely" in page


def test_report_reads_the_records_as_the_result_summarized_them(sweep: tuple[Path, Path],
                                                                 tmp_path: Path) -> None:
    """A bench result (a sweep point's JSON) with its per-request file: the distribution's
    p99 is the result's own p99, so the records were read as the bench read them."""
    from hlserve.html_report.load import load

    out, _ = sweep
    point = out / "points" / "C=none.json"
    data = load(point)
    res = json.loads(point.read_text())
    by = {d.metric: d.rows[0] for d in data.distributions}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert by[metric].source == "requests"
        assert by[metric].stats["p99"] == pytest.approx(res[f"p99_{metric}_ms"], rel=1e-9)
        assert by[metric].stats["p50"] == pytest.approx(res[f"median_{metric}_ms"], rel=1e-9)
    assert main(["report", str(point), "-o", str(tmp_path / "b.html")]) == 0
    assert "One run, one configuration" in (tmp_path / "b.html").read_text()


def test_sweep_records_its_machine(sweep: tuple[Path, Path]) -> None:
    out, html = sweep
    machine = json.loads((out / "sweep.json").read_text())["machine"]
    assert machine["logical_cpus"] == os.cpu_count()
    if shutil.which("lscpu"):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        names = [ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                 if ln.strip().startswith("Model name:")]
        if names:
            assert machine["cpu_model"] == names[0]
    assert f"<td>{machine['cpu_model']}</td>" in html.read_text()


def test_a_repeated_sweeps_tax_shows_its_interval(sweep: tuple[Path, Path], tmp_path: Path) -> None:
    """Where the sweep was repeated, the tax row carries its 95% interval and verdict."""
    out, _ = sweep
    summary = json.loads((out / "sweep.json").read_text())
    row = {**summary["tax"][0], "best_config": "C=none", "human_tax": 0.2,
           "human_tax_ci95": [0.05, 0.31], "human_tax_within_noise": False}
    summary["tax"] = [row]
    (tmp_path / "sweep.json").write_text(json.dumps(summary))
    (tmp_path / "points").symlink_to(out / "points")
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.html").read_text()
    assert "<td>20%</td><td>[5%, 31%]</td><td>a tax beyond noise</td>" in text


@pytest.mark.parametrize("what, message", [
    ("missing", "no such file or folder"), ("folder", "not a sweep's folder"),
    ("text", "not JSON"), ("other.json", "not a sweep, study or bench result")])
def test_report_of_something_else_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                   what: str, message: str) -> None:
    path = tmp_path / what
    if what == "folder":
        path.mkdir()
    elif what == "text":
        path.write_text("hello")
    elif what == "other.json":
        path.write_text('{"runs": []}')
    assert main(["report", str(path)]) == 2
    assert message in capsys.readouterr().err
