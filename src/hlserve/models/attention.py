"""Paged attention in plain PyTorch: one code path for CPU and CUDA.

The KV cache of one layer is a flat tensor of slots, ``[num_pages * page_size, kv_heads,
head_dim]``; slot ``page * page_size + offset`` holds one token. A batch is a flat run of
tokens from many sequences, each continuing from whatever context it already has in the cache
(zero for a fresh prefill, a prefix-cache hit or earlier chunks, or the whole history for a
decode). Every new token's K/V is scattered into its slot first; attention then reads the
sequence's context back through its page table.

Each sequence runs one SDPA call over its own context, gathered through its page table:
a decode (one query) needs no mask, so it takes the fast kernel; a prefill chunk over cached
context masks causally past its offset; a fresh prompt attends to its own new K/V with
``is_causal`` and needs no gather at all. (A single padded, masked call over all decodes was
measured 1.45x slower per decode step on the CPU: padding and the mask cost more than the
per-call overhead saves.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Segment:
    """One sequence's new tokens in this batch (a prompt chunk, or one decode token)."""

    start: int  # index of its first token in the flat batch
    end: int  # one past its last token
    context_len: int  # tokens already in the cache before this batch
    slots: torch.Tensor | None  # [context_len + (end - start)] slot ids; None when context_len == 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    segments: list[Segment]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D] (already written to the cache)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for seg in meta.segments:
        qs = q[seg.start : seg.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seg.context_len == 0:
            ks = k[seg.start : seg.end]
            vs = v[seg.start : seg.end]
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=scale, enable_gqa=gqa,
            )
        else:
            assert seg.slots is not None
            ks = k_cache.index_select(0, seg.slots).transpose(0, 1).unsqueeze(0)
            vs = v_cache.index_select(0, seg.slots).transpose(0, 1).unsqueeze(0)
            n, total = seg.end - seg.start, seg.slots.shape[0]
            mask = None  # one query (a decode) sees every key: no mask, the fast kernel
            if n > 1:
                # query i sits at position context_len + i and sees keys 0..context_len + i
                qpos = torch.arange(n, device=q.device).unsqueeze(1) + seg.context_len
                mask = torch.arange(total, device=q.device).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        out[seg.start : seg.end] = o.squeeze(0).transpose(0, 1)
    return out
