"""A batch's attention metadata: which kernel attends each sequence's rows, and over which pages.

:func:`build_meta` turns :class:`Span` s (a sequence's new rows and its page table) into the
:class:`AttentionMetadata` every layer reads. :func:`kept_rows` describes the rows whose hidden
state a step uses, for the last layer: each sampling sequence's last row and every row of a
speculating one. The last layer's output feeds only the logits, so of a prompt chunk's other
rows it needs only K and V (written to the cache before attention); it attends, projects and
runs its MLP on the kept rows only (``CausalLM.forward``), 1/num_layers of a prompt token's
work saved (4% at the 0.5B shape's 24 layers). The kept rows attend as decodes do: one query
row over its context, whose keys include the chunk's other rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hlserve.engine.batch import Batch, ScheduledSeq
from hlserve.models.attention import (
    AttentionMetadata,
    KeptRows,
    PaddedDecodes,
    PagedDecodes,
    PagedPrefills,
    Segment,
)


@dataclass(frozen=True, slots=True)
class Span:
    """One sequence's rows in a forward: positions ``[start, end)`` over its cached context
    (``start`` tokens); the first ``decode_rows`` of them attend as decodes."""

    start: int
    end: int
    decode_rows: int
    page_table: list[int]

    @classmethod
    def of(cls, seq: ScheduledSeq) -> Span:
        return cls(seq.start, seq.end, seq.decode_rows, seq.page_table)


@dataclass(frozen=True, slots=True)
class MetaPaths:
    """How this runner attends: its decode and prefill paths (``TorchRunner``'s), page size and
    device."""

    decode: str  # "padded", "cpu_kernel", "prefill_kernel" or "per_sequence"
    prefill: str  # "cpu_kernel" or "sdpa"
    page_size: int
    device: torch.device


def build_meta(spans: list[Span], slots: list[int], paths: MetaPaths,
               progress: Callable[[], None] | None) -> AttentionMetadata:
    """Segments, the context pages of every segment no batched call attends, and the batched
    calls' tables: plain lists over the spans, one host-to-device copy each."""
    ps = paths.page_size
    segments: list[Segment] = []
    ctx_pages: list[int] = []
    t0 = 0
    for span in spans:
        seg = Segment(t0, t0 + span.end - span.start, span.start)
        t0 = seg.end
        # a speculating decode's rows run as decodes too: one batched call for all rows,
        # not a prefill-over-context per request (on the CPU that was ~0.1 ms of Python and
        # small SDPA calls per request per layer)
        seg.batched = (paths.decode != "per_sequence" if span.decode_rows
                       else paths.prefill == "cpu_kernel")
        # a sequence with context that no batched call attends reads it back through its
        # pages, in the per-layer gather
        if span.start > 0 and not seg.batched:
            seg.page_lo = len(ctx_pages)
            ctx_pages.extend(span.page_table[: -(-span.end // ps)])
            seg.page_hi = len(ctx_pages)
        segments.append(seg)
    dev = paths.device
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), segments=segments,
        context_pages=torch.tensor(ctx_pages, dtype=torch.long, device=dev)
        if ctx_pages else None, progress=progress)
    if paths.decode == "padded":
        meta.padded_decodes = _padded_decodes(spans, segments, paths)
    elif paths.decode == "cpu_kernel":
        meta.paged_decodes = _paged_decodes(spans, segments, ps)
    if paths.prefill == "cpu_kernel":
        meta.paged_prefills = _paged_prefills(spans, segments, paths)
    return meta


def kept_rows(batch: Batch, slots: list[int], paths: MetaPaths,
              progress: Callable[[], None] | None) -> KeptRows | None:
    """The rows the step reads hidden states of, with metadata over them alone (``slots``:
    every row's pool slot); None when that is every row (a batch of decodes), so the last
    layer runs as the others do."""
    rows: list[int] = []
    spans: list[Span] = []
    first = 0
    for seq in batch.seqs:
        keep = seq.logit_rows
        if keep == seq.num_tokens:
            spans.append(Span.of(seq))
        elif keep:  # a prompt's last row: a decode over the rest of the prompt
            spans.append(Span(seq.end - keep, seq.end, keep, seq.page_table))
        rows.extend(range(first + seq.num_tokens - keep, first + seq.num_tokens))
        first += seq.num_tokens
    if len(rows) == first:
        return None
    return KeptRows(torch.tensor(rows, dtype=torch.long, device=paths.device), rows,
                    build_meta(spans, [slots[r] for r in rows], paths, progress))


def _padded_decodes(spans: list[Span], segments: list[Segment], paths: MetaPaths
                    ) -> PaddedDecodes | None:
    decodes = [(seg.start, span) for span, seg in zip(spans, segments, strict=True)
               if span.decode_rows]
    if not decodes:
        return None
    width = max(-(-span.end // paths.page_size) for _, span in decodes)
    rows: list[int] = []
    pages: list[list[int]] = []
    lengths: list[int] = []
    for first, span in decodes:
        table = span.page_table[:width]
        table = table + [0] * (width - len(table))
        for i in range(span.decode_rows):  # row i: a decode of length start + i + 1
            rows.append(first + i)
            pages.append(table)
            lengths.append(span.start + i + 1)
    dev = paths.device
    return PaddedDecodes(torch.tensor(rows, device=dev), torch.tensor(pages, device=dev),
                         torch.tensor(lengths, device=dev))


def _paged_decodes(spans: list[Span], segments: list[Segment], page_size: int
                   ) -> PagedDecodes | None:
    rows: list[int] = []
    pages: list[int] = []
    lo: list[int] = []
    lengths: list[int] = []
    for span, seg in zip(spans, segments, strict=True):
        n = span.decode_rows
        if n:
            at = len(pages)  # the rows of a speculating decode share its table
            pages.extend(span.page_table[: -(-span.end // page_size)])
            rows.extend(range(seg.start, seg.start + n))
            lo.extend([at] * n)
            lengths.extend(range(span.start + 1, span.start + n + 1))
    if not rows:
        return None
    return PagedDecodes(*(torch.tensor(x, dtype=torch.long) for x in (rows, pages, lo,
                                                                      lengths)))


def _paged_prefills(spans: list[Span], segments: list[Segment], paths: MetaPaths
                    ) -> PagedPrefills | None:
    pages: list[int] = []
    cols: list[list[int]] = [[], [], [], []]  # page_lo, starts, num_new, context
    with_decodes = paths.decode == "prefill_kernel"
    for span, seg in zip(spans, segments, strict=True):
        if with_decodes or not span.decode_rows:
            for col, x in zip(cols, (len(pages), seg.start, seg.num_new, seg.context_len),
                              strict=True):
                col.append(x)
            pages.extend(span.page_table[: -(-span.end // paths.page_size)])
    if not cols[0]:
        return None
    return PagedPrefills(*(torch.tensor(x, dtype=torch.long) for x in (pages, *cols)))
