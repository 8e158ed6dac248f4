"""The HTML report of a sweep, a study or a bench result (``hlserve report RESULT``, and
``--report FILE.html`` on ``hlserve sweep``, ``study`` and ``bench``): one self-contained file
(inline SVG charts, a little vanilla JavaScript, nothing fetched) that opens offline.

:mod:`~hlserve.html_report.load` reads a result, :mod:`~hlserve.html_report.model` holds what the page
shows, :mod:`~hlserve.html_report.svg` draws the charts, :mod:`~hlserve.html_report.page` writes the
page, a function per section.
"""

from __future__ import annotations

from pathlib import Path


def write_report(result: str | Path, out: str | Path) -> Path:
    """The report of the result at ``result`` (a sweep's or study's folder, a sweep.json or a
    bench result JSON), written to ``out``."""
    from hlserve.html_report.load import load
    from hlserve.html_report.page import write

    return write(load(result), out)
