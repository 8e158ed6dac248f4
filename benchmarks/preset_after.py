"""The `sglang` preset with SGLang 0.5.23's reservation of fixed-length requests
(``reserve_fixed_length_in_full``), on the study's headline cells: the "after" column of
docs/fidelity.md's policy side. Writes docs/study/h20-systems/preset-after/*.json in the
study's point format (the stored ``h20`` points are the "before": the preset as the study
ran it).

    python benchmarks/preset_after.py [--jobs 2]     # 6 points, ~5 core-minutes
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from hlserve.study.core import StudyPoint, StudySpec, run_point

OUT = Path(__file__).resolve().parents[1] / "docs" / "study" / "h20-systems" / "preset-after"
FIX = {"reserve_fixed_length_in_full": True}


def one(cell: tuple[int, int]) -> str:
    ctx, n = cell
    point = StudyPoint("sglang", 8192, ctx, n)
    rec = run_point(StudySpec(), point, options=FIX)
    path = OUT / f"{point.key}.json"
    path.write_text(json.dumps(rec, indent=1))
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    cells = [(c, n) for c in (65536, 32768) for n in (128, 64, 16)]
    with ProcessPoolExecutor(args.jobs) as ex:
        for path in ex.map(one, cells):
            print("wrote", path)


if __name__ == "__main__":
    main()
