"""Two cost-model tables quoted in docs/study.md: the cost of chunking a prefill, and the
decode slowdown of mixing a prefill chunk into a decode iteration.

    python benchmarks/sim_cost_tables.py chunking    # Yi-34B on 2x A100
    python benchmarks/sim_cost_tables.py mixing      # Qwen2.5-32B on 8x H20
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hlserve.sim.cost import CostModel
from hlserve.sim.hardware import get_hardware
from hlserve.sim.model_specs import resolve_model_spec


def cost_model(model: str, hardware: str, tp: int) -> CostModel:
    _, mc = resolve_model_spec(model)
    return CostModel(mc, get_hardware(hardware), tp)


def chunking_cost(model: str = "Yi-34B", hardware: str = "A100", tp: int = 2,
                  prompts: tuple[int, ...] = (2048, 4096, 8192, 16384),
                  chunks: tuple[int, ...] = (512, 1024, 2048)) -> list[dict[str, Any]]:
    """Prefill time with chunk C relative to unchunked, prompt by prompt."""
    cm = cost_model(model, hardware, tp)
    rows = []
    for n in prompts:
        ref = cm.prefill(n)
        row: dict[str, Any] = {"prompt": n, "unchunked_ms": 1e3 * ref.total}
        for c in chunks:
            bd = cm.prefill(n, c)
            row[f"C={c}"] = bd.total / ref.total - 1
            row[f"C={c} parts"] = {k: 1e3 * (bd.parts.get(k, 0) - ref.parts.get(k, 0))
                                   for k in set(bd.parts) | set(ref.parts)}
        rows.append(row)
    return rows


def mixing_slowdown(model: str = "Qwen2.5-32B", hardware: str = "H20", tp: int = 8,
                    batches: tuple[int, ...] = (16, 64), contexts: tuple[int, ...] = (32768, 65536),
                    chunks: tuple[int, ...] = (512, 2048, 8192)) -> list[dict[str, Any]]:
    """Decode throughput in a mixed iteration against a pure-decode one of the same batch."""
    cm = cost_model(model, hardware, tp)
    rows = []
    for b in batches:
        for ctx in contexts:
            pure = cm.decode(b, ctx).total
            for c in chunks:
                mixed = cm.decode(b, ctx, c, prefill_context=ctx // 2).total
                rows.append({"batch": b, "context": ctx, "chunk": c, "pure_ms": 1e3 * pure,
                             "mixed_ms": 1e3 * mixed, "decode_throughput_loss": 1 - pure / mixed})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", choices=("chunking", "mixing"))
    args = ap.parse_args()
    rows = chunking_cost() if args.table == "chunking" else mixing_slowdown()
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
