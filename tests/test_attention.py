"""The paged attention paths against a plain dense reference, and end to end against
transformers on contexts that span many pages, with and without GQA, page sizes 1 and 16.

Unit level: random K/V scattered into a shuffled pool, batches that mix fresh prompts,
chunks over a cached context and decodes; every path (per-sequence decode, the padded decode
that CUDA uses, the LSE-merged prefill and its masked fallback) gives the reference's output.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hlserve import LLM, SamplingParams
from hlserve.models import attention as attn
from hlserve.models import tiny
from hlserve.models.cpu_kernels import decode_op, linear_op, prefill_op
from hlserve.models.packed_linear import (
    KERNEL_ROWS,
    PackedLinear,
    WideLinear,
    can_prepack,
    can_widen,
    prepack_linears,
)
from support import assert_bf16_linear, hf_greedy, load_benchmark


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int,
              scale: float) -> torch.Tensor:
    """Dense attention in fp64: q [n, H, D] at positions first_pos.., k/v [L, KVH, D]."""
    h, kvh = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(h // kvh, 1).transpose(0, 1)  # [H, L, D]
    vv = v.double().repeat_interleave(h // kvh, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ kk.transpose(1, 2) * scale  # [H, n, L]
    qpos = torch.arange(q.shape[0]).unsqueeze(1) + first_pos
    s = s.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > qpos, float("-inf"))
    return (torch.softmax(s, -1) @ vv).transpose(0, 1)  # [n, H, D]


def build_case(heads: int, kv_heads: int, page_size: int, seqs: list[tuple[int, int]],
               seed: int = 0, d: int = 16, tables: list[list[int]] | None = None):
    """seqs: (context_len, new_tokens) each. Returns the inputs, metadata and references;
    each sequence's page table is appended to ``tables`` when given."""
    g = torch.Generator().manual_seed(seed)
    total_pages = sum(-(-(c + n) // page_size) for c, n in seqs) + 3
    k_cache = torch.zeros(attn.kv_cache_shape(total_pages, page_size, kv_heads, d))
    v_cache = torch.zeros_like(k_cache)
    order = list(range(total_pages))
    random.Random(seed).shuffle(order)  # no sequence's pages are contiguous
    qs, ks, vs, slots, segments, ctx_pages, refs = [], [], [], [], [], [], []
    t = 0
    scale = d**-0.5
    for ctx, n in seqs:
        length = ctx + n
        pages = [order.pop() for _ in range(-(-length // page_size))]
        if tables is not None:
            tables.append(pages)
        full_k = torch.randn(length, kv_heads, d, generator=g)
        full_v = torch.randn(length, kv_heads, d, generator=g)
        pos = torch.arange(length)
        seq_slots = torch.tensor(pages)[pos // page_size] * page_size + pos % page_size
        if ctx:  # the cached context is already in the pool
            attn.write_kv(k_cache, v_cache, full_k[:ctx], full_v[:ctx], seq_slots[:ctx])
        q = torch.randn(n, heads, d, generator=g)
        qs.append(q)
        ks.append(full_k[ctx:])
        vs.append(full_v[ctx:])
        slots.append(seq_slots[ctx:])
        seg = attn.Segment(t, t + n, ctx)
        if ctx:
            seg.page_lo = len(ctx_pages)
            ctx_pages.extend(pages)
            seg.page_hi = len(ctx_pages)
        segments.append(seg)
        refs.append(reference(q, full_k, full_v, ctx, scale))
        t += n
    meta = attn.AttentionMetadata(torch.cat(slots), segments,
                                  torch.tensor(ctx_pages) if ctx_pages else None)
    return (torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, scale,
            torch.cat(refs))


MIXED = [(0, 9), (37, 1), (0, 1), (100, 13), (5, 1), (64, 64), (250, 1)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_attention_matches_dense_reference(heads, kv_heads, page_size) -> None:
    q, k, v, kc, vc, meta, scale, ref = build_case(heads, kv_heads, page_size, MIXED)
    attn.write_kv(kc, vc, k, v, meta.slot_mapping)
    out = attn.paged_attention(q, k, v, kc, vc, meta, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def padded(meta: attn.AttentionMetadata, seqs: list[tuple[int, int]], page_size: int,
           ctx_pages: list[int]) -> attn.PaddedDecodes:
    rows, tables, lengths = [], [], []
    for seg, (ctx, n) in zip(meta.segments, seqs, strict=True):
        if n == 1 and ctx > 0:
            seg.batched = True
            rows.append(seg.start)
            tables.append(ctx_pages[seg.page_lo : seg.page_hi])
            lengths.append(ctx + 1)
    width = max(len(t) for t in tables)
    return attn.PaddedDecodes(torch.tensor(rows),
                              torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                              torch.tensor(lengths))


@pytest.mark.parametrize("page_size", [1, 16])
def test_padded_decode_path_matches_reference(page_size) -> None:
    """The batched decode (the CUDA path) on the CPU: same result as per sequence."""
    q, k, v, kc, vc, meta, scale, ref = build_case(4, 2, page_size, MIXED, seed=3)
    attn.write_kv(kc, vc, k, v, meta.slot_mapping)
    assert meta.context_pages is not None
    meta.padded_decodes = padded(meta, MIXED, page_size, meta.context_pages.tolist())
    out = attn.paged_attention(q, k, v, kc, vc, meta, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def paged(meta: attn.AttentionMetadata, seqs: list[tuple[int, int]], page_size: int,
          ctx_pages: list[int]) -> attn.PagedDecodes:
    """The decodes of ``seqs`` as the CPU kernel reads them: concatenated page tables."""
    rows, pages, lo, lengths = [], [], [], []
    for seg, (ctx, n) in zip(meta.segments, seqs, strict=True):
        if n == 1 and ctx > 0:
            seg.batched = True
            rows.append(seg.start)
            lo.append(len(pages))
            pages.extend(ctx_pages[seg.page_lo : seg.page_hi])
            lengths.append(ctx + 1)
    return attn.PagedDecodes(*(torch.tensor(x) for x in (rows, pages, lo, lengths)))


needs_kernel = pytest.mark.skipif(decode_op() is None, reason="the CPU decode kernel did not build")


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cpu_kernel_decode_matches_reference(heads, kv_heads, page_size) -> None:
    """The in-place C++ decode (the CPU path): same result as the dense reference, in a
    batch that also holds fresh prompts and chunks over a context."""
    q, k, v, kc, vc, meta, scale, ref = build_case(heads, kv_heads, page_size, MIXED, seed=7)
    attn.write_kv(kc, vc, k, v, meta.slot_mapping)
    assert meta.context_pages is not None
    meta.paged_decodes = paged(meta, MIXED, page_size, meta.context_pages.tolist())
    out = attn.paged_attention(q, k, v, kc, vc, meta, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_decode_half_precision(dtype) -> None:
    """bf16 / fp16 pools: within the rounding of the output's own dtype, on contexts that
    span many pages (up to 3,000 keys over shuffled 16-token pages)."""
    seqs = [(3000, 1), (1, 1), (777, 1), (2048, 1)]
    q, k, v, kc, vc, meta, scale, ref = build_case(14, 2, 16, seqs, seed=11)
    attn.write_kv(kc, vc, k, v, meta.slot_mapping)
    assert meta.context_pages is not None
    meta.paged_decodes = paged(meta, seqs, 16, meta.context_pages.tolist())
    out = attn.paged_attention(q.to(dtype), k.to(dtype), v.to(dtype), kc.to(dtype),
                               vc.to(dtype), meta, scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("d", [8, 64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cpu_kernel_decode_head_sizes(d, page_size) -> None:
    """The vector paths at the head sizes models use (8 lanes per slice on AVX2, 16 on
    AVX-512), G = 7 query heads per KV head, contexts across many shuffled pages."""
    seqs = [(700, 1), (1, 1), (129, 1), (16, 1)]
    q, k, v, kc, vc, meta, scale, ref = build_case(14, 2, page_size, seqs, seed=d, d=d)
    attn.write_kv(kc, vc, k, v, meta.slot_mapping)
    assert meta.context_pages is not None
    meta.paged_decodes = paged(meta, seqs, page_size, meta.context_pages.tolist())
    out = attn.paged_attention(q, k, v, kc, vc, meta, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("sharp", [1.0, 40.0], ids=["plain", "sharp"])
def test_cpu_kernel_decode_softmax_edges(sharp) -> None:
    """The vector softmax and the paged row walk: every context length around the 8-lane
    width (1-17 keys; 8k + 0..7 past one and many pages) and, with ``sharp``, scores that
    span hundreds, so most weights fall below e^-87 where the vector exp clamps its argument:
    equal to an fp64 softmax over the same keys."""
    op = decode_op()
    g = torch.Generator().manual_seed(5)
    lens = [*range(1, 18), *range(64, 72), *range(1000, 1008)]
    S, D, H, KVH = 16, 64, 4, 2
    counts = [-(-n // S) for n in lens]
    kc = torch.randn(KVH, sum(counts), S, D, generator=g)
    vc = torch.randn(KVH, sum(counts), S, D, generator=g)
    pages = torch.randperm(sum(counts), generator=g)
    lo = [sum(counts[:i]) for i in range(len(lens))]
    q = torch.randn(len(lens), H, D, generator=g)
    scale = sharp * D ** -0.5
    out = op(q, kc, vc, pages, torch.tensor(lo), torch.tensor(lens), scale)
    for b, n in enumerate(lens):
        table = pages[lo[b] : lo[b] + counts[b]]
        keys = kc[:, table].reshape(KVH, -1, D)[:, :n].double()
        values = vc[:, table].reshape(KVH, -1, D)[:, :n].double()
        kv = torch.arange(H) // (H // KVH)
        w = torch.softmax(torch.einsum("hd,hld->hl", q[b].double(), keys[kv]) * scale, -1)
        ref = torch.einsum("hl,hld->hd", w, values[kv])
        torch.testing.assert_close(out[b].double(), ref, atol=1e-5 * sharp, rtol=1e-5)


needs_prefill_kernel = pytest.mark.skipif(
    prefill_op() is None, reason="the CPU prefill kernel is not built (no AVX512_BF16)")


def prefills(meta: attn.AttentionMetadata, seqs: list[tuple[int, int]],
             tables: list[list[int]], page_size: int, decodes: bool = False
             ) -> attn.PagedPrefills:
    """Every segment that is not a decode (every one with ``decodes``), as the CPU prefill
    kernel reads it."""
    pages, cols = [], [[], [], [], []]  # page_lo, starts, num_new, context
    for seg, (ctx, n), table in zip(meta.segments, seqs, tables, strict=True):
        if decodes or not (n == 1 and ctx > 0):
            seg.batched = True
            for col, x in zip(cols, (len(pages), seg.start, n, ctx), strict=True):
                col.append(x)
            pages.extend(table[: -(-(ctx + n) // page_size)])
    return attn.PagedPrefills(*(torch.tensor(x) for x in (pages, *cols)))


# chunk and tile edges: 31 / 32 / 33 keys (the kernel's 32-key tiles), 8-query blocks, one-token
# prompts, a chunk of one token over a context that is a decode, a chunk over a long context
PREFILL_MIX = [(0, 9), (37, 1), (0, 1), (100, 13), (31, 2), (0, 33), (64, 64), (250, 1),
               (1, 31), (500, 77)]


@needs_prefill_kernel
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("decodes_in", ["decode_kernel", "prefill_kernel"])
def test_cpu_kernel_prefill_matches_reference(heads, kv_heads, page_size, d, decodes_in
                                              ) -> None:
    """The in-place bf16 prefill kernel, with the decodes in the decode kernel beside it or
    in its own call (as the runner does in bf16), every segment in a batched call: the dense
    fp64 reference over the same bf16 inputs, within bf16 rounding (the kernel rounds the
    softmax weights to bf16 for the value product, as flash attention does on GPUs)."""
    tables: list[list[int]] = []
    q, k, v, kc, vc, meta, scale, _ = build_case(heads, kv_heads, page_size, PREFILL_MIX,
                                                 seed=d, d=d, tables=tables)
    q, k, v, kc, vc = (x.to(torch.bfloat16) for x in (q, k, v, kc, vc))
    attn.write_kv(kc, vc, k, v, meta.slot_mapping)
    assert meta.context_pages is not None
    if decodes_in == "decode_kernel":
        meta.paged_decodes = paged(meta, PREFILL_MIX, page_size, meta.context_pages.tolist())
    meta.paged_prefills = prefills(meta, PREFILL_MIX, tables, page_size,
                                   decodes=decodes_in == "prefill_kernel")
    meta.context_pages = None  # nothing may fall back to the gather
    out = attn.paged_attention(q, k, v, kc, vc, meta, scale)
    t = 0
    for (ctx, n), table in zip(PREFILL_MIX, tables, strict=True):
        slots = torch.tensor(table)[torch.arange(ctx + n) // page_size] * page_size
        slots += torch.arange(ctx + n) % page_size
        keys = kc.view(kv_heads, -1, d)[:, slots].transpose(0, 1)  # [L, KVH, D]
        vals = vc.view(kv_heads, -1, d)[:, slots].transpose(0, 1)
        ref = reference(q[t : t + n], keys, vals, ctx, scale)
        torch.testing.assert_close(out[t : t + n].double(), ref, atol=2e-2, rtol=2e-2)
        t += n


@needs_prefill_kernel
def test_cpu_kernel_prefill_long_contexts() -> None:
    """The 0.5B model's attention shape (14 query heads over 2 KV heads, head_dim 64) over
    contexts of thousands of keys on shuffled 16-token pages: the error stays at bf16
    rounding (no drift of the online softmax across ~100 tiles)."""
    seqs = [(3000, 40), (0, 700), (1500, 9)]
    tables: list[list[int]] = []
    q, k, v, kc, vc, meta, scale, _ = build_case(14, 2, 16, seqs, seed=4, d=64, tables=tables)
    q, k, v, kc, vc = (x.to(torch.bfloat16) for x in (q, k, v, kc, vc))
    attn.write_kv(kc, vc, k, v, meta.slot_mapping)
    meta.paged_prefills = prefills(meta, seqs, tables, 16)
    meta.context_pages = None
    out = attn.paged_attention(q, k, v, kc, vc, meta, scale)
    t = 0
    for (ctx, n), table in zip(seqs, tables, strict=True):
        slots = torch.tensor(table)[torch.arange(ctx + n) // 16] * 16 + torch.arange(ctx + n) % 16
        keys = kc.view(2, -1, 64)[:, slots].transpose(0, 1)
        vals = vc.view(2, -1, 64)[:, slots].transpose(0, 1)
        ref = reference(q[t : t + n], keys, vals, ctx, scale)
        torch.testing.assert_close(out[t : t + n].double(), ref, atol=1e-2, rtol=1e-2)
        t += n


# the tiled kernel's edges: 64-key tiles, 16-key score vectors, register blocks of up to 6
# rows, tasks of ~64 rows; chunks over cached contexts that end mid-page (a later chunk of a
# prompt), one-token chunks (decodes), contexts of thousands of keys
TILED_MIX = [(0, 1), (0, 63), (0, 64), (0, 65), (15, 1), (17, 47), (63, 2), (64, 64),
             (129, 7), (1000, 130), (2047, 1), (0, 200), (3001, 19)]


@needs_prefill_kernel
@pytest.mark.parametrize("kernel", ["tiled", "rowpair"])
@pytest.mark.parametrize("heads,kv_heads", [(14, 2), (6, 6), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_kernels_over_many_pages_and_chunk_edges(kernel, heads, kv_heads, page_size
                                                         ) -> None:
    """Both prefill kernels, called directly with every segment of a 13-sequence batch (up
    to 3,020 keys: 3,020 pages at page size 1, shuffled in the pool): the dense fp64
    reference over the same bf16 inputs, within bf16 rounding."""
    op = prefill_op(kernel)
    assert op is not None
    tables: list[list[int]] = []
    q, k, v, kc, vc, meta, scale, _ = build_case(heads, kv_heads, page_size, TILED_MIX,
                                                 seed=page_size, d=64, tables=tables)
    q, k, v, kc, vc = (x.to(torch.bfloat16) for x in (q, k, v, kc, vc))
    attn.write_kv(kc, vc, k, v, meta.slot_mapping)
    chunks = prefills(meta, TILED_MIX, tables, page_size, decodes=True)
    out = torch.zeros_like(q)
    op(out, q, kc, vc, chunks.pages, chunks.page_lo, chunks.starts, chunks.num_new,
       chunks.context, scale)
    t = 0
    for (ctx, n), table in zip(TILED_MIX, tables, strict=True):
        slots = torch.tensor(table)[torch.arange(ctx + n) // page_size] * page_size
        slots += torch.arange(ctx + n) % page_size
        keys = kc.view(kv_heads, -1, 64)[:, slots].transpose(0, 1)  # [L, KVH, D]
        vals = vc.view(kv_heads, -1, 64)[:, slots].transpose(0, 1)
        ref = reference(q[t : t + n], keys, vals, ctx, scale)
        torch.testing.assert_close(out[t : t + n].double(), ref, atol=1e-2, rtol=1e-2,
                                   msg=lambda m, c=ctx, n=n: f"context {c}, {n} new: {m}")
        t += n


@needs_prefill_kernel
@pytest.mark.parametrize("kernel", ["tiled", "rowpair"])
@pytest.mark.parametrize("ramp", ["rising", "falling"])
def test_prefill_kernels_rescale_as_the_maximum_moves(kernel: str, ramp: str) -> None:
    """Keys scaled by a ramp along the context, so that each row's largest score keeps
    rising from tile to tile (the online softmax rescales its sums many times, the tiled
    kernel's 2^8 rule included) or falls (it never does after the first tile): the fp64
    reference over the same bf16 inputs, within bf16 rounding."""
    op = prefill_op(kernel)
    assert op is not None
    seqs = [(0, 300), (1000, 50), (700, 1)]
    tables: list[list[int]] = []
    q, k, v, kc, vc, meta, scale, _ = build_case(14, 2, 16, seqs, seed=9, d=64, tables=tables)
    q, k, v, kc, vc = (x.to(torch.bfloat16) for x in (q, k, v, kc, vc))
    attn.write_kv(kc, vc, k, v, meta.slot_mapping)
    pool = kc.view(2, -1, 64)
    for (ctx, n), table in zip(seqs, tables, strict=True):
        slots = torch.tensor(table)[torch.arange(ctx + n) // 16] * 16 + torch.arange(ctx + n) % 16
        factor = torch.linspace(0.2, 6.0, ctx + n)  # scores' spread grows 30-fold
        if ramp == "falling":
            factor = factor.flip(0)
        pool[:, slots] = (pool[:, slots].float() * factor[None, :, None]).to(torch.bfloat16)
    chunks = prefills(meta, seqs, tables, 16, decodes=True)
    out = torch.zeros_like(q)
    op(out, q, kc, vc, chunks.pages, chunks.page_lo, chunks.starts, chunks.num_new,
       chunks.context, scale)
    t = 0
    for (ctx, n), table in zip(seqs, tables, strict=True):
        slots = torch.tensor(table)[torch.arange(ctx + n) // 16] * 16 + torch.arange(ctx + n) % 16
        ref = reference(q[t : t + n], pool[:, slots].transpose(0, 1),
                        vc.view(2, -1, 64)[:, slots].transpose(0, 1), ctx, scale)
        torch.testing.assert_close(out[t : t + n].double(), ref, atol=2e-2, rtol=2e-2)
        t += n


@needs_prefill_kernel
@pytest.mark.parametrize("d", [32, 128, 256])
def test_tiled_prefill_chunked_prompt_matches_one_call(d: int) -> None:
    """One 300-token prompt attended in one call and as three chunks of 37, 100 and 163
    tokens (each over the cache the earlier ones wrote; none ends on a page or tile edge),
    GQA 4 / 2, every head size the kernel is built for but 64 (above): both the fp64
    reference's output within bf16 rounding."""
    op = prefill_op("tiled")
    assert op is not None
    tables: list[list[int]] = []
    q, k, v, kc, vc, meta, scale, _ = build_case(4, 2, 16, [(0, 300)], seed=d, d=d,
                                                 tables=tables)
    q, k, v, kc, vc = (x.to(torch.bfloat16) for x in (q, k, v, kc, vc))
    attn.write_kv(kc, vc, k, v, meta.slot_mapping)
    pages = torch.tensor(tables[0])
    zero = torch.tensor([0])
    whole = torch.zeros_like(q)
    op(whole, q, kc, vc, pages, zero, zero, torch.tensor([300]), zero, scale)
    chunked = torch.zeros_like(q)
    for start, end in [(0, 37), (37, 137), (137, 300)]:  # one call per chunk, as the engine
        op(chunked, q, kc, vc, pages, zero, torch.tensor([start]), torch.tensor([end - start]),
           torch.tensor([start]), scale)
    slots = pages[torch.arange(300) // 16] * 16 + torch.arange(300) % 16
    keys = kc.view(2, -1, d)[:, slots].transpose(0, 1)
    vals = vc.view(2, -1, d)[:, slots].transpose(0, 1)
    ref = reference(q, keys, vals, 0, scale)
    torch.testing.assert_close(whole.double(), ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(chunked.double(), ref, atol=1e-2, rtol=1e-2)


@needs_prefill_kernel
def test_prefill_kernel_is_chosen_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HLSERVE_PREFILL_KERNEL`` picks the kernel the engine runs; an argument overrides it;
    an unknown name is an error, not a silent default."""
    from hlserve.models import cpu_kernels

    module = cpu_kernels._module()
    assert prefill_op() is module.prefill_attention  # type: ignore[union-attr]
    monkeypatch.setenv("HLSERVE_PREFILL_KERNEL", "rowpair")
    assert prefill_op() is module.prefill_attention_rowpair  # type: ignore[union-attr]
    assert prefill_op("tiled") is module.prefill_attention  # type: ignore[union-attr]
    monkeypatch.setenv("HLSERVE_PREFILL_KERNEL", "fast")
    with pytest.raises(ValueError, match="unknown prefill kernel"):
        prefill_op()


def test_kernel_switch_off_gives_the_pytorch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """HLSERVE_CPU_KERNELS=0: no kernel is loaded (the runner then gathers and calls SDPA)."""
    from hlserve.models import cpu_kernels

    monkeypatch.setenv("HLSERVE_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    assert cpu_kernels.decode_op() is None
    assert cpu_kernels.prefill_op() is None


def test_cpu_arch_picks_the_target_and_its_own_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """HLSERVE_CPU_ARCH=x86-64-v3 compiles for AVX2 without AVX-512 (the AVX2 paths, testable
    on an AVX-512 host) into a cache directory of its own, never the native build's."""
    from hlserve.models import cpu_kernels

    monkeypatch.delenv("HLSERVE_CPU_ARCH", raising=False)
    native = cpu_kernels.build_dir()
    assert "-march=native" in cpu_kernels._flags()
    monkeypatch.setenv("HLSERVE_CPU_ARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in cpu_kernels._flags()
    assert cpu_kernels.build_dir() != native


def test_masked_fallback_matches_lse_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the CPU LSE kernel, prefill over a context falls back to one masked call."""
    seqs = [(40, 17), (3, 30)]
    q, k, v, kc, vc, meta, scale, ref = build_case(4, 2, 16, seqs, seed=5)
    attn.write_kv(kc, vc, k, v, meta.slot_mapping)
    merged = attn.paged_attention(q, k, v, kc, vc, meta, scale)
    monkeypatch.setattr(attn, "_LSE_OP", None)
    masked = attn.paged_attention(q, k, v, kc, vc, meta, scale)
    torch.testing.assert_close(merged.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(masked.double(), ref, atol=1e-5, rtol=1e-5)


# ---- end to end: greedy tokens against transformers ---------------------------------------

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)



@pytest.fixture(scope="module")
def mha_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model without GQA (as many KV heads as query heads)."""
    shape = tiny._Shape(128, 2, 4, 4, 32, 256, None, 32768)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny.SIZES, "mha", shape)
        return tiny.make_tiny_model(tmp_path_factory.mktemp("mha"), arch="qwen2", size="mha",
                                    seed=2)


@pytest.mark.parametrize("decode_path", ["cpu_kernel", "per_sequence"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("which", ["gqa", "mha"])
def test_long_contexts_match_transformers(which, page_size, decode_path, tiny_model_dirs,
                                          mha_model, monkeypatch) -> None:
    """Prompts of up to 700 tokens (700 pages at page size 1), chunked so that later chunks
    read a long cached context, then decodes over it; a shared prefix hits the cache. Both
    CPU decode paths: the in-place C++ kernel and the gather + SDPA fallback."""
    if decode_path == "cpu_kernel" and decode_op() is None:
        pytest.skip("the CPU decode kernel did not build")
    if decode_path == "per_sequence":
        monkeypatch.setattr("hlserve.runner.torch_runner.decode_op", lambda: None)
    path = tiny_model_dirs["qwen2"] if which == "gqa" else mha_model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(13)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(300)]
    prompts = [[rng.randrange(3, vocab) for _ in range(700)],
               shared + [rng.randrange(3, vocab) for _ in range(90)],
               shared + [rng.randrange(3, vocab) for _ in range(7)],
               [rng.randrange(3, vocab) for _ in range(5)]]
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), dtype="float32", page_size=page_size, chunk_size=128,
              check_invariants=True)
    assert llm.engine.runner.decode_path == decode_path
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == refs
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # from the prefix cache
    assert [o.token_ids for o in again] == refs
    assert sum(o.num_cached_tokens for o in again) > 0


@needs_prefill_kernel
def test_bf16_prefill_kernel_keeps_the_pytorch_paths_logits(tiny_model_dirs, monkeypatch) -> None:
    """End to end in bf16 (the only dtype the prefill kernel serves): chunked prompts of up to
    700 tokens, a shared prefix served from the cache, through the runner's kernel path and
    through gather + SDPA. The first token of each answer comes from the prefill alone: its
    top log-probabilities agree within bf16 noise."""
    path = tiny_model_dirs["qwen2"]
    rng = random.Random(21)
    shared = [rng.randrange(3, 1000) for _ in range(300)]
    prompts = [[rng.randrange(3, 1000) for _ in range(700)],
               shared + [rng.randrange(3, 1000) for _ in range(90)],
               shared + [rng.randrange(3, 1000) for _ in range(7)],
               [rng.randrange(3, 1000) for _ in range(5)]]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
    # then decodes: through the prefill kernel on one path, the decode kernel on the other
    decodes = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)

    def first_tokens(llm: LLM) -> list[tuple[int, dict[int, float]]]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        outs += llm.generate(prompts, params, use_tqdm=False)  # again, from the prefix cache
        return [(o.token_ids[0], dict(o.logprobs[0].top)) for o in outs]

    def decoded(llm: LLM) -> list[tuple[list[int], list[float]]]:
        outs = llm.generate(prompts, decodes, use_tqdm=False)
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]

    kernel = LLM(str(path), dtype="bfloat16", page_size=16, chunk_size=128)
    assert kernel.engine.runner.prefill_path == "cpu_kernel"
    assert kernel.engine.runner.decode_path == "prefill_kernel"
    got, got_dec = first_tokens(kernel), decoded(kernel)
    monkeypatch.setattr("hlserve.runner.torch_runner.prefill_op", lambda: None)
    plain = LLM(str(path), dtype="bfloat16", page_size=16, chunk_size=128)
    assert plain.engine.runner.prefill_path == "sdpa"
    assert plain.engine.runner.decode_path == "cpu_kernel"
    want, want_dec = first_tokens(plain), decoded(plain)
    # decoded tokens: equal up to the first near-tie, each token's logprob within noise
    for (toks_got, lps_got), (toks_want, lps_want) in zip(got_dec, want_dec, strict=True):
        for a, b, la, lb in zip(toks_got, toks_want, lps_got, lps_want, strict=True):
            assert abs(la - lb) < 0.05
            if a != b:
                assert abs(la - lb) < 0.02  # a tie broken differently: nothing after compares
                break
    # a random tiny model's logits are nearly flat (exact bf16 ties occur, and the PyTorch
    # path itself picks differently from the cache), so the check is on log-probabilities:
    # each path's pick is the other's best within noise, and shared entries agree
    for (tok, lp_got), (_, lp_want) in zip(got, want, strict=True):
        assert lp_want.get(tok, -1e9) >= max(lp_want.values()) - 0.05
        shared = lp_got.keys() & lp_want.keys()
        assert len(shared) >= 3
        for t in shared:
            assert abs(lp_got[t] - lp_want[t]) < 0.05, (t, lp_got[t], lp_want[t])


# ---- prepacked bf16 linears --------------------------------------------------------------

needs_pack = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.bfloat16),
                                reason="this CPU's oneDNN has no bf16 kernels")


@needs_pack
@pytest.mark.parametrize("rows", [1, 3, 16, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical(rows: int, bias: bool) -> None:
    lin = torch.nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(lin)(x), lin(x))


@needs_pack
def test_bf16_engine_prepacks_and_keeps_its_tokens(tiny_model_dirs) -> None:
    """The runner packs every linear in bf16 on the CPU; the tokens equal an unpacked run."""
    path = tiny_model_dirs["qwen2"]
    prompts = [[5, 9, 33, 4] * 10, [7] * 3]
    llm = LLM(str(path), dtype="bfloat16")
    model = llm.engine.runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, PackedLinear)  # merged, then packed
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)
    packed = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("hlserve.runner.torch_runner.can_prepack", lambda *a: False)
        plain_llm = LLM(str(path), dtype="bfloat16")
    assert not isinstance(plain_llm.engine.runner.model.lm_head, PackedLinear)
    assert [o.token_ids for o in plain_llm.generate(prompts, GREEDY, use_tqdm=False)] == packed


# ---- bf16 linears in fp32, where oneDNN has no bf16 kernels ------------------------------


@pytest.mark.parametrize("rows", [1, 3, 16, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_wide_linear_gives_the_bf16_linear(rows: int, bias: bool) -> None:
    """fp32 math over the bf16 values, rounded once, as PyTorch's bf16 linear (fp32
    accumulation) does: the same tensor but for summation order; one row to the bit."""
    torch.manual_seed(rows)
    lin = torch.nn.Linear(896, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 896, dtype=torch.bfloat16)
    with torch.inference_mode():
        got, want = WideLinear(lin)(x), lin(x)
        if rows == 1:
            assert torch.equal(got, want)
        assert_bf16_linear(got, want, x, lin.weight)


needs_linear_kernel = pytest.mark.skipif(
    linear_op() is None, reason="the AVX2 linear kernel is not built (no AVX2/FMA)")


@needs_linear_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 33])
@pytest.mark.parametrize("k,n", [(896, 80), (100, 7), (4864, 898)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_kernel_gives_the_bf16_linear(rows, k, n, bias) -> None:
    """The AVX2 kernel: row counts across its 4-row tiles, weight rows across its 3-row
    tiles, K with and without an 8-lane tail."""
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    op = linear_op()
    with torch.inference_mode():
        got, want = op(x, w, b), F.linear(x, w, b)
    assert_bf16_linear(got, want, x, w)


@needs_linear_kernel
def test_wide_linear_takes_the_kernel_for_few_rows_and_the_gemm_past_them() -> None:
    lin = torch.nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    calls = []

    def op(x, w, b):
        calls.append(x.shape[0])
        return linear_op()(x, w, b)
    wide = WideLinear(lin, op)
    with torch.inference_mode():
        for shape in [(1, 256), (2, 3, 256), (KERNEL_ROWS, 256), (KERNEL_ROWS + 1, 256)]:
            x = torch.randn(*shape).to(torch.bfloat16)
            assert_bf16_linear(wide(x).reshape(-1, 96), lin(x).reshape(-1, 96),
                               x.reshape(-1, 256), lin.weight)
    assert calls == [1, 6, KERNEL_ROWS]


def test_the_runner_widens_bf16_linears_only_where_onednn_has_no_bf16() -> None:
    cpu = torch.device("cpu")
    assert can_widen(cpu, torch.bfloat16) == (not can_prepack(cpu, torch.bfloat16))
    assert not can_widen(cpu, torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HLSERVE_CPU_WIDE_LINEAR", "0")
        assert not can_widen(cpu, torch.bfloat16)


def test_bf16_engine_widened_keeps_its_tokens(tiny_model_dirs) -> None:
    """With every linear widened (what a CPU without bf16 GEMMs runs), a bf16 engine's greedy
    tokens equal those of plain bf16 linears."""
    path = tiny_model_dirs["qwen2"]
    prompts = [[5, 9, 33, 4] * 10, [7] * 3]
    runs = {}
    for wide in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("hlserve.runner.torch_runner.can_prepack", lambda *a: False)
            mp.setattr("hlserve.runner.torch_runner.can_widen", lambda *a, w=wide: w)
            llm = LLM(str(path), dtype="bfloat16")
        model = llm.engine.runner.model
        assert isinstance(model.model.layers[0].mlp.down_proj, WideLinear) == wide
        assert isinstance(model.lm_head, WideLinear) == wide
        runs[wide] = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert runs[True] == runs[False]


@needs_linear_kernel
def test_linear_benchmark_runs_its_table(capsys, monkeypatch) -> None:
    """benchmarks/linear_avx2.py, one row count, one repeat: a row per shape, each way timed."""
    bench = load_benchmark("linear_avx2")
    monkeypatch.setattr(bench, "SHAPES", {"small": (256, 96)})
    monkeypatch.setattr("sys.argv", ["linear_avx2.py", "--rows", "4", "--repeats", "1"])
    bench.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| small")]
    assert len(rows) == 1 and rows[0].count("|") == 8 and " - " not in rows[0]


# ---- q/k/v and gate/up merged into one GEMM each --------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merged_projections_give_the_same_hidden_states(tiny_model_dirs, arch: str,
                                                        dtype: torch.dtype) -> None:
    """merge_projections (what the runner does after loading) changes no output bit: q/k/v
    bias (qwen2), q/k norms (qwen3) and the CPU MLP's row passes (a prompt 88 rows past one pass)
    included; packed for oneDNN as the runner packs bf16."""
    from hlserve.models.llama import CPU_MLP_ROWS
    from hlserve.models.loader import load_model

    separate, _ = load_model(str(tiny_model_dirs[arch]), dtype, torch.device("cpu"))
    merged, _ = load_model(str(tiny_model_dirs[arch]), dtype, torch.device("cpu"))
    merged.merge_projections()
    layer = merged.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
    if dtype == torch.bfloat16 and can_prepack(torch.device("cpu"), dtype):
        prepack_linears(separate)
        prepack_linears(merged)
    n = CPU_MLP_ROWS + 88
    ids = torch.randint(0, separate.config.vocab_size, (n,),
                        generator=torch.Generator().manual_seed(3))
    meta, caches = _fresh_prompt_meta(separate, n, dtype)
    with torch.inference_mode():
        want = separate(ids, torch.arange(n), caches, meta)
        meta, caches = _fresh_prompt_meta(merged, n, dtype)
        got = merged(ids, torch.arange(n), caches, meta)
    assert torch.equal(got, want)


def _fresh_prompt_meta(model: torch.nn.Module, n: int, dtype: torch.dtype):
    """KV pages and attention metadata for one fresh prompt of ``n`` tokens (page size 16)."""
    cfg = model.config
    pages = -(-n // 16)
    caches = [tuple(torch.zeros(attn.kv_cache_shape(pages, 16, cfg.num_key_value_heads,
                                                    cfg.head_dim), dtype=dtype)
                    for _ in range(2)) for _ in range(cfg.num_hidden_layers)]
    seg = attn.Segment(start=0, end=n, context_len=0)  # fresh: nothing cached
    meta = attn.AttentionMetadata(slot_mapping=torch.arange(n), segments=[seg])
    return meta, caches
