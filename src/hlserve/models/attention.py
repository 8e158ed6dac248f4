"""Paged attention in plain PyTorch: one interface for CPU and CUDA.

The KV cache of one layer is a pair of tensors ``[kv_heads, num_pages, page_size, head_dim]``
(head-major, so that a gathered context is one contiguous ``[context, head_dim]`` matrix per
KV head); token ``page * page_size + offset`` of the pool is one row of each head. A batch is a
flat run of tokens from many sequences, each continuing from whatever context it already has
in the cache (zero for a fresh prefill; a prefix-cache hit, earlier chunks or the whole
history otherwise). Every new token's K/V is scattered into its slot first; attention then
reads the sequence's context back through its page table.

Three cases, each on the kernel that suits it (measured on the CPU, 0.5B shape, bf16; see
docs/bench_results.md, "Engine speed"):

- **Decode** (one new token over its context): the query heads that share a KV head are the
  rows of one query matrix, ``[kv_heads, group, head_dim]`` against that head's
  ``[context, head_dim]``. That is exact for one query position, needs no mask, no GQA
  expansion and no single-query kernel (SDPA with one query and ``enable_gqa`` was 4-5x
  slower here). The context pages of every sequence that reads context are gathered once per
  layer with one ``index_select``. On CUDA the decodes run as one padded, masked SDPA call (a
  kernel launch per sequence costs more there than the padding); on the CPU one call per
  sequence over its own context wins (padding and the mask cost more than the calls).
- **Prefill over a cached context** (a later chunk, or a prompt after a prefix-cache hit):
  attention to the cached part needs no mask and attention to the new part is square causal;
  the two are computed separately and merged by their log-sum-exp, so no ``[new, context]``
  mask is ever built. Without a mask the cached part groups heads as a decode does (G x n
  query rows per KV head, no K/V expansion). On CUDA a lower-right causal bias does the same
  inside one kernel.
- **Fresh prefill** (no context): causal SDPA over the new K/V, no gather.

On the CPU, two C++ kernels (``models/cpu_kernels.py``) replace these where they are built:
every decode of the batch in one call, and (bf16, AVX512_BF16) every prompt chunk, fresh or
over a context, in one flash-style call with bf16 dot products. Both read the pages in place,
so a batch that only they attend gathers nothing. A segment they cover is marked ``batched``
and skipped by the per-segment loop below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hlserve.models.cpu_kernels import decode_op, prefill_op


@dataclass(slots=True)
class Segment:
    """One sequence's new tokens in this batch (a prompt chunk, or one decode token)."""

    start: int  # index of its first token in the flat batch
    end: int  # one past its last token
    context_len: int  # tokens already in the cache before this batch
    # its pages in AttentionMetadata.context_pages: [page_lo, page_hi); empty for a fresh prompt
    page_lo: int = 0
    page_hi: int = 0
    batched: bool = False  # attended by a call over the whole batch (padded or a CPU kernel)

    @property
    def num_new(self) -> int:
        return self.end - self.start

    @property
    def total_len(self) -> int:
        return self.context_len + self.end - self.start


@dataclass(slots=True)
class PaddedDecodes:
    """Every decode of the batch as one padded call (CUDA): rows, page tables, lengths."""

    rows: torch.Tensor  # [B] index of each decode token in the flat batch
    pages: torch.Tensor  # [B, max_pages] page ids, padded with page 0
    lengths: torch.Tensor  # [B] keys each decode sees (its context + itself)


@dataclass(slots=True)
class PagedDecodes:
    """Every decode of the batch read in place by the CPU kernel: rows and page tables."""

    rows: torch.Tensor  # [B] index of each decode token in the flat batch
    pages: torch.Tensor  # [N] the B page tables, concatenated
    page_lo: torch.Tensor  # [B] where decode b's table starts in ``pages``
    lengths: torch.Tensor  # [B] keys each decode sees (its context + itself)


@dataclass(slots=True)
class PagedPrefills:
    """Every prompt chunk of the batch read in place by the CPU prefill kernel."""

    pages: torch.Tensor  # [N] the C chunks' page tables, concatenated
    page_lo: torch.Tensor  # [C] where chunk c's table starts in ``pages``
    starts: torch.Tensor  # [C] its first token in the flat batch
    num_new: torch.Tensor  # [C] its new tokens
    context: torch.Tensor  # [C] tokens cached before it


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] pool slot (page * page_size + offset) of every new token
    segments: list[Segment]
    # the page tables of every segment with context, concatenated (one gather per layer)
    context_pages: torch.Tensor | None = None
    padded_decodes: PaddedDecodes | None = None  # set: decodes run batched (see module doc)
    paged_decodes: PagedDecodes | None = None  # set: decodes run in the CPU kernel
    paged_prefills: PagedPrefills | None = None  # set: prompt chunks run in the CPU kernel
    # called before each segment's own attention call: one layer's attention over many long
    # prompts can take seconds, and the server's wedge check must see it progress
    progress: Callable[[], None] | None = None


@dataclass(slots=True)
class KeptRows:
    """The rows of a batch whose hidden state the step uses (the last layer runs only them;
    ``runner/batch_meta.py``), and attention metadata over those rows alone: their contexts
    hold the batch's other rows, whose K and V the last layer still writes."""

    rows: torch.Tensor  # [R] indices into the flat batch, ascending
    row_list: list[int]  # the same, on the host
    meta: AttentionMetadata  # segments over the R rows


def kv_cache_shape(num_pages: int, page_size: int, kv_heads: int, head_dim: int
                   ) -> tuple[int, int, int, int]:
    return (kv_heads, num_pages, page_size, head_dim)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Scatter new K/V (``[T, kv_heads, head_dim]``) into their pool slots."""
    kvh, pages, ps, d = k_cache.shape
    k_cache.view(kvh, pages * ps, d).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(kvh, pages * ps, d).index_copy_(1, slots, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D] new keys (already written to the cache)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [KVH, pages, page_size, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    kvh, _, _, d = k_cache.shape
    group = q.shape[1] // kvh
    kc = vc = None
    if meta.context_pages is not None:
        # [KVH, P, page_size, D]: one copy per layer of every context this batch reads
        kc = k_cache.index_select(1, meta.context_pages)
        vc = v_cache.index_select(1, meta.context_pages)
    batched = meta.padded_decodes
    if batched is not None:
        out[batched.rows] = _padded_decode(q[batched.rows], k_cache, v_cache, batched, scale)
    paged = meta.paged_decodes
    if paged is not None:
        op = decode_op()
        assert op is not None, "paged_decodes set without the CPU kernel"
        out[paged.rows] = op(q[paged.rows].contiguous(), k_cache, v_cache, paged.pages,
                             paged.page_lo, paged.lengths, scale)
    chunks = meta.paged_prefills
    if chunks is not None:
        op = prefill_op()
        assert op is not None, "paged_prefills set without the CPU kernel"
        op(out, q.contiguous(), k_cache, v_cache, chunks.pages, chunks.page_lo, chunks.starts,
           chunks.num_new, chunks.context, scale)
    for seg in meta.segments:
        if seg.batched:
            continue  # done above
        if meta.progress is not None:
            meta.progress()
        if seg.context_len == 0:
            out[seg.start : seg.end] = _fresh_prefill(q[seg.start : seg.end],
                                                      k[seg.start : seg.end],
                                                      v[seg.start : seg.end], scale)
            continue
        assert kc is not None and vc is not None
        ks = kc[:, seg.page_lo : seg.page_hi].reshape(kvh, -1, d)[:, : seg.total_len]
        vs = vc[:, seg.page_lo : seg.page_hi].reshape(kvh, -1, d)[:, : seg.total_len]
        if seg.num_new == 1:
            qs = q[seg.start].view(1, kvh, group, d)  # the group's heads as query rows
            o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), scale=scale)
            out[seg.start] = o.view(-1, d)
        else:
            qs = q[seg.start : seg.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            o = _prefill_over_context(qs, ks.unsqueeze(0), vs.unsqueeze(0), seg.context_len,
                                      scale)
            out[seg.start : seg.end] = o.squeeze(0).transpose(0, 1)
    return out


def _fresh_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                   ) -> torch.Tensor:
    """A prompt with nothing cached: causal attention over its own new K/V."""
    gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)


def _padded_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   batch: PaddedDecodes, scale: float) -> torch.Tensor:
    """All decodes in one SDPA call: contexts padded to the longest, padding masked."""
    kvh, _, ps, d = k_cache.shape
    b, max_pages = batch.pages.shape
    group = q.shape[1] // kvh
    # [KVH, B, max_pages, ps, D] -> [B, KVH, max_pages * ps, D]
    ks = k_cache[:, batch.pages].transpose(0, 1).reshape(b, kvh, max_pages * ps, d)
    vs = v_cache[:, batch.pages].transpose(0, 1).reshape(b, kvh, max_pages * ps, d)
    keep = torch.arange(max_pages * ps, device=q.device).unsqueeze(0) < batch.lengths.unsqueeze(1)
    o = F.scaled_dot_product_attention(q.view(b, kvh, group, d), ks, vs,
                                       attn_mask=keep[:, None, None, :], scale=scale)
    return o.reshape(b, kvh * group, d)


def _prefill_over_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                          scale: float) -> torch.Tensor:
    """``q`` [1, H, n, D] at positions context_len..context_len+n-1, over ``k``/``v``
    [1, KVH, context_len + n, D]: query i sees keys 0..context_len+i (lower-right causal)."""
    n, total = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, total),
                                              scale=scale, enable_gqa=gqa)
    if _LSE_OP is None:  # no LSE kernel in this torch: one masked call
        qpos = torch.arange(n, device=q.device).unsqueeze(1) + context_len
        mask = torch.arange(total, device=q.device).unsqueeze(0) <= qpos
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    heads, kvh, d = q.shape[1], k.shape[1], q.shape[3]
    group = heads // kvh
    # the cached part has no mask, so every query of the group's heads is a row of one query
    # matrix against that KV head's context: G x n rows, no K/V expansion, bigger GEMMs
    o1, lse1 = _sdpa_lse(q.reshape(1, kvh, group * n, d), k[:, :, :context_len],
                         v[:, :, :context_len], False, scale)
    o1, lse1 = o1.reshape(1, heads, n, d), lse1.reshape(1, heads, n)
    # the new part is square causal; the LSE kernel takes equal head counts (small copies)
    k_new, v_new = k[:, :, context_len:], v[:, :, context_len:]
    if gqa:
        k_new, v_new = k_new.repeat_interleave(group, 1), v_new.repeat_interleave(group, 1)
    o2, lse2 = _sdpa_lse(q, k_new, v_new, True, scale)
    # softmax over the union = each part's softmax weighted by its share of the total mass
    w1 = torch.sigmoid(lse1 - lse2).unsqueeze(-1)  # e^lse1 / (e^lse1 + e^lse2)
    return (o1.float() * w1 + o2.float() * (1 - w1)).to(q.dtype)


_LSE_OP = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _sdpa_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and the log-sum-exp of its scores per query row (CPU flash kernel)."""
    assert _LSE_OP is not None
    out, lse = _LSE_OP(q, k, v, 0.0, causal, scale=scale)[:2]
    return out, lse.float()
