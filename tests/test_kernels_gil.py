"""The CPU kernels run without the GIL, as torch's own operators do. Held, every kernel call
(a step's linears and attention) stopped the server's event loop and its prep threads for
its whole length: /health waited behind steps, and a CI run failed on it."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hlserve.models.cpu_kernels import decode_op, prefill_op

BINDINGS = Path(__file__).parents[1] / "src/hlserve/models/csrc/bindings.cpp"


def longest_wait(call: Callable[[], object]) -> tuple[float, float]:
    """(seconds ``call`` took on a thread of its own, the longest gap between two turns of a
    Python loop on this thread meanwhile). A call that holds the GIL stops the loop for its
    whole length; one that releases it, for about the interpreter's switch interval."""
    took: list[float] = []
    done = threading.Event()

    def work() -> None:
        t0 = time.perf_counter()
        call()
        took.append(time.perf_counter() - t0)
        done.set()

    worker = threading.Thread(target=work)
    last, gap = time.perf_counter(), 0.0
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    worker.join()
    return took[0], gap


def assert_releases(call: Callable[[], object]) -> None:
    call()  # warm: first-touch page faults are not the kernel
    took, gap = longest_wait(call)
    assert took > 0.05, f"the call took {took:.3f}s: too short to tell"
    assert gap < took / 3, f"the loop waited {gap:.3f}s of a {took:.3f}s kernel call"


@pytest.mark.skipif(decode_op() is None, reason="the CPU decode kernel did not build")
def test_decode_attention_releases_the_gil() -> None:
    # 96 decodes over one 4,096-token context (the same pages): ~3 GB read from cache, one call
    op = decode_op()
    kvh, pages, size, d = 8, 256, 16, 128
    kc, vc = torch.randn(kvh, pages, size, d), torch.randn(kvh, pages, size, d)
    seqs = 96
    q = torch.randn(seqs, kvh, d)
    table, lo = torch.arange(pages), torch.zeros(seqs, dtype=torch.long)
    lens = torch.full((seqs,), pages * size, dtype=torch.long)
    assert_releases(lambda: op(q, kc, vc, table, lo, lens, d ** -0.5))


@pytest.mark.skipif(prefill_op() is None, reason="the CPU prefill kernel is not built")
def test_prefill_attention_releases_the_gil() -> None:
    # one 4,096-token prompt, 8 heads of 128: ~34 GFLOP in one call
    op = prefill_op()
    heads, size, d, n = 8, 16, 128, 4096
    kc = torch.randn(heads, n // size, size, d).bfloat16()
    vc = torch.randn(heads, n // size, size, d).bfloat16()
    q = torch.randn(n, heads, d).bfloat16()
    out = torch.empty_like(q)
    one = lambda x: torch.tensor([x], dtype=torch.long)  # noqa: E731
    assert_releases(lambda: op(out, q, kc, vc, torch.arange(n // size), one(0), one(0), one(n),
                               one(0), d ** -0.5))


def test_every_kernel_binding_releases_the_gil() -> None:
    """Each bound function that takes a tensor is bound with nogil() (the two tests above
    run two of them; this one keeps a new kernel from coming in with the GIL held)."""
    source = BINDINGS.read_text()
    takes_tensor = {name for name, args in re.findall(r"\b(\w+)\(([^;{]*?)\);", source)
                    if "Tensor" in args}
    bound = dict(re.findall(r'm\.def\("(\w+)", &\w+,\s*(nogil\(\))?', source))
    assert takes_tensor and takes_tensor <= bound.keys(), takes_tensor - bound.keys()
    assert all(bound[name] for name in takes_tensor), \
        [name for name in takes_tensor if not bound[name]]
