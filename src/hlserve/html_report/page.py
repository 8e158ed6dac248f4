"""The HTML report: one self-contained page (inline CSS, SVG and a little vanilla JavaScript;
nothing fetched, so it opens offline), one function per section (:data:`SECTIONS`: add a
section by adding a function that takes the :class:`ReportData` and returns its HTML).

The page's script turns each chart element's ``<title>`` into a hover tooltip, sorts a table
by a clicked column, writes any script error (``window.onerror``, ``console.error``) into
``#report-errors``, and, once drawn, marks every chart with how many of its points the
browser laid out (``data-drawn``) and the page with ``data-status="ok"``: what a headless
browser's test reads back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from html import escape
from pathlib import Path

from hlserve.driver.tiers import BEST, DEFAULT_TIERS, tier_rows
from hlserve.html_report.model import ReportData, Table, fmt
from hlserve.html_report.svg import colors, dist_chart, frontier_chart


def _palette(data: ReportData) -> dict[str, str]:
    return colors([p.series for p in data.points])


def table_html(t: Table, sortable: bool = True) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in t.header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>"
                   for row in t.rows)
    note = f'<p class="note">{escape(t.note)}</p>' if t.note else ""
    cls = ' class="sortable"' if sortable else ""
    return (f"<h3>{escape(t.title)}</h3>{note}<div class=\"scroll\"><table{cls}><thead><tr>"
            f"{head}</tr></thead><tbody>{body}</tbody></table></div>")


# ---- sections -------------------------------------------------------------------------------


def section_frontier(data: ReportData) -> str:
    """Throughput against each p99 latency, per group, every point's configuration on hover."""
    pal = _palette(data)
    out = ['<p class="note">Each marker is one configuration (hover for it); the black step '
           "line is the frontier: the best throughput among the configurations whose latency "
           "is at most x. Error bars: 95% intervals over repeats.</p>"]
    for gi, g in enumerate(data.groups):
        charts = [frontier_chart(g, key, f"SLO target: {title}", data.metric, data.metric_title,
                                 pal, f"frontier-{gi}-{key}") for key, title in g.frontier_keys()]
        series = list(dict.fromkeys(p.series for p in g.points))
        legend = "".join(f'<span class="swatch" style="background:{pal[s]}"></span>'
                         f"{escape(s)} " for s in series)
        left = [p.label for p in g.points if not p.served]
        miss = (f'<p class="note">Not drawn (served nothing or failed requests): '
                f"{escape(', '.join(left))}</p>" if left else "")
        out.append(f"<h3>{escape(g.name)}</h3><div class=\"charts\">{''.join(charts)}</div>"
                   f'<p class="legend">{legend}</p>{miss}')
    return "".join(out)


def section_tax(data: ReportData) -> str:
    """The human tax per SLO pair, with its interval where the result was repeated."""
    if not data.tax:
        return "".join(f'<p class="note">{escape(n)}</p>' for n in data.notes[:1]) or \
            '<p class="note">No tax in this result.</p>'
    return "".join(table_html(t) for t in data.tax)


def section_points(data: ReportData) -> str:
    """Every point's throughput and latencies (click a column's head to sort by it)."""
    return table_html(data.points_table)


def section_distributions(data: ReportData) -> str:
    """A latency's distribution per point, one chart per latency (and per group)."""
    if not data.distributions:
        return '<p class="note">This result holds no latency distribution.</p>'
    out = ['<p class="note">Per point: the line spans the lowest to the highest quantile '
           "shown (p1 to p99 from per-request records), the box p25 to p75, the bar the median, "
           "the dot p99; hover a row for the numbers. Where the result stored only "
           "percentiles, those are drawn.</p>"]
    groups = list(dict.fromkeys(d.group for d in data.distributions))
    for gi, name in enumerate(groups):
        charts = "".join(dist_chart(d, f"dist-{gi}-{d.metric}")
                         for d in data.distributions if d.group == name)
        body = f'<div class="charts">{charts}</div>'
        if len(groups) > 1:  # many groups (a study's cells): folded, the first open
            out.append(f"<details{' open' if gi == 0 else ''}><summary>{escape(name)}"
                       f"</summary>{body}</details>")
        else:
            out.append(body)
    return "".join(out)


def section_settings(data: ReportData) -> str:
    """How the result was made, and on what machine."""
    def dl(rows: tuple[tuple[str, str], ...]) -> str:
        return "<table class=\"kv\">" + "".join(
            f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows) + "</table>"

    return f"<h3>Settings</h3>{dl(data.settings)}<h3>Machine</h3>{dl(data.machine)}"


def section_tiers(data: ReportData) -> str:
    """Agents per node at SLO tiers (:mod:`hlserve.driver.tiers`), per frontier group: the most
    sessions each configuration serves within each tier, the throughput there, the tax."""
    out = []
    for g in data.groups:
        recs = [{**p.record, "label": p.record.get("config_label", p.label)} for p in g.points]
        rows = tier_rows(recs, DEFAULT_TIERS, data.metric)
        if not rows:
            continue
        cells: dict[str, dict[str, str]] = {}
        for r in rows:
            text = "none meets it" if r["sessions"] is None else \
                f"{r['sessions']} sessions, {fmt(r['throughput'])}"
            if r["sessions"] is not None and r["tier"] != "none" and \
                    math.isfinite(r["tax_vs_none"]):
                text += f", tax {100 * r['tax_vs_none']:.0f}%"
            cells.setdefault(r["config"], {})[r["tier"]] = text
        head = ("config", *(f"{t.name} ({t.describe()})" for t in DEFAULT_TIERS))
        body = tuple((c, *(by.get(t.name, "—") for t in DEFAULT_TIERS))
                     for c, by in sorted(cells.items(), key=lambda kv: kv[0] == BEST))
        out.append(table_html(Table(g.name, head, body)))
    if not out:
        return '<p class="note">No point of this result names its concurrency.</p>'
    return ('<p class="note">Per tier (p99 TTFT / p99 TPOT): the most concurrent sessions a '
            "configuration serves meeting it, its throughput there, and the tax against no "
            "target.</p>" + "".join(out))


SECTIONS: list[tuple[str, str, Callable[[ReportData], str]]] = [
    ("frontier", "Frontier", section_frontier),
    ("tax", "Human tax", section_tax),
    ("tiers", "Agents per node at SLO tiers", section_tiers),
    ("points", "Points", section_points),
    ("distributions", "Latency distributions", section_distributions),
    ("settings", "Settings and machine", section_settings),
]


# ---- the page -------------------------------------------------------------------------------

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1180px;padding:0 1em;
color:#222}
h1{font-size:1.5em;margin-bottom:.2em}h2{border-bottom:1px solid #ccc;margin-top:1.6em}
h3{font-size:1.05em;margin:1.1em 0 .4em}nav a{margin-right:1em}
.note{color:#555;font-size:.92em;margin:.3em 0}.charts{display:flex;flex-wrap:wrap;gap:12px}
.scroll{overflow-x:auto}table{border-collapse:collapse;font-size:.9em}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:right;white-space:nowrap}
td:first-child,th:first-child{text-align:left}th{background:#f4f4f4}
table.sortable th{cursor:pointer}table.kv th{text-align:left;vertical-align:top}
table.kv td{text-align:left;white-space:normal;word-break:break-word}
.swatch{display:inline-block;width:10px;height:10px;border-radius:5px;margin:0 4px 0 10px}
svg .frame{fill:#fff;stroke:#999}svg .grid{stroke:#eee}svg .tick{font-size:10px;fill:#444}
svg .axis{font-size:11px;fill:#222}svg .front{fill:none;stroke:#000;stroke-width:1.3;
opacity:.7}svg .pt{stroke:#fff;stroke-width:1;cursor:pointer}svg .pt:hover{stroke:#000}
svg .err{stroke-width:1.2;opacity:.8}svg .mark{stroke:#c00;stroke-dasharray:4 3}
svg .marktext{font-size:9px;fill:#c00}svg .whisker{stroke:#555}svg .box{fill:#9ecae1;
stroke:#3182bd}svg .median{stroke:#08306b;stroke-width:2}svg .p99{fill:#d62728}
svg .rowbg{fill:transparent}svg .dist-row:hover .rowbg{fill:#f3f3f3}
#tooltip{position:fixed;pointer-events:none;background:#fffff0;border:1px solid #999;
padding:4px 7px;font-size:12px;white-space:pre-line;max-width:520px;display:none;
box-shadow:1px 1px 4px rgba(0,0,0,.2);z-index:9}
#report-errors{color:#b00;white-space:pre-wrap}
"""

# before the body, so that an error anywhere on the page is caught
JS_HEAD = """
(function(){
  var errs = [];
  function show(){
    var e = document.getElementById('report-errors');
    if (e) { e.textContent = errs.join('\\n'); e.hidden = errs.length === 0; }
    document.documentElement.setAttribute('data-errors', String(errs.length));
  }
  window.__reportError = function(msg){ errs.push(String(msg)); show(); };
  window.addEventListener('error', function(ev){
    window.__reportError('error: ' + ev.message + ' (' + ev.filename + ':' + ev.lineno + ')');
  });
  window.addEventListener('unhandledrejection', function(ev){
    window.__reportError('unhandled rejection: ' + ev.reason);
  });
  var ce = console.error;
  console.error = function(){
    window.__reportError('console.error: ' + Array.prototype.join.call(arguments, ' '));
    return ce.apply(console, arguments);
  };
  document.addEventListener('DOMContentLoaded', show);
})();
"""

JS_BODY = """
(function(){
  var tipBox = document.getElementById('tooltip');
  document.querySelectorAll('.tip').forEach(function(el){
    var t = el.querySelector(':scope > title');
    if (!t) return;
    el.setAttribute('data-tip', t.textContent);
    t.remove();  // the browser's own tooltip would show too
    el.addEventListener('mousemove', function(ev){
      tipBox.textContent = el.getAttribute('data-tip');
      tipBox.style.display = 'block';
      tipBox.style.left = Math.min(ev.clientX + 14, window.innerWidth - 540) + 'px';
      tipBox.style.top = (ev.clientY + 14) + 'px';
    });
    el.addEventListener('mouseleave', function(){ tipBox.style.display = 'none'; });
  });
  document.querySelectorAll('table.sortable').forEach(function(tab){
    tab.querySelectorAll('th').forEach(function(th, i){
      th.addEventListener('click', function(){
        var rows = Array.from(tab.tBodies[0].rows), up = th.getAttribute('data-up') !== '1';
        function key(r){
          var s = r.cells[i].textContent.replace(/,/g, ''), v = parseFloat(s);
          return isNaN(v) ? s : v;
        }
        rows.sort(function(a, b){
          var x = key(a), y = key(b);
          var c = (typeof x === typeof y) ? (x < y ? -1 : x > y ? 1 : 0)
                                          : (typeof x === 'number' ? -1 : 1);
          return up ? c : -c;
        });
        th.setAttribute('data-up', up ? '1' : '0');
        rows.forEach(function(r){ tab.tBodies[0].appendChild(r); });
      });
    });
  });
  var charts = document.querySelectorAll('svg.chart'), drawn = 0, items = 0;
  charts.forEach(function(svg){
    if (svg.closest('details:not([open])')) return;  // folded: not laid out
    var n = 0;
    svg.querySelectorAll('.pt, .dist-row').forEach(function(el){
      var r = el.getBoundingClientRect();
      if (r.width > 0 && r.height > 0) n++;
    });
    svg.setAttribute('data-drawn', String(n));
    if (svg.getBoundingClientRect().width > 0) drawn++;
    items += n;
  });
  var st = document.getElementById('report-status');
  st.textContent = drawn + ' of ' + charts.length + ' charts laid out, ' + items + ' points';
  document.documentElement.setAttribute('data-status', 'ok');
})();
"""


def render(data: ReportData) -> str:
    """The page's HTML."""
    nav = "".join(f'<a href="#{sid}">{escape(title)}</a>' for sid, title, _ in SECTIONS)
    body = "".join(f'<section id="{sid}"><h2>{escape(title)}</h2>{fn(data)}</section>'
                   for sid, title, fn in SECTIONS)
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in data.notes)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{escape(data.title)}</title><style>{CSS}</style>"
            f"<script>{JS_HEAD}</script></head><body>"
            f"<h1>{escape(data.title)}</h1><p class=\"note\">hlserve "
            f"{escape(data.kind)} report of {escape(data.source)}; "
            f"{len(data.points)} points. <span id=\"report-status\"></span></p>{notes}"
            f'<pre id="report-errors" hidden></pre><nav>{nav}</nav>{body}'
            f'<div id="tooltip"></div><script>{JS_BODY}</script></body></html>\n')


def write(data: ReportData, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(data), encoding="utf-8")
    return out
