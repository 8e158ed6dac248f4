"""The real runner: a PyTorch forward over a flattened batch, paged KV, and sampling."""

from __future__ import annotations

import logging
import time

import torch

from hlserve.config import EngineConfig
from hlserve.engine.batch import Batch, Runner, StepResult
from hlserve.models.attention import AttentionMetadata, KeptRows, kv_cache_shape
from hlserve.models.cpu_kernels import decode_op, prefill_op, supports, supports_prefill
from hlserve.models.llama import MLP, Attention, DecoderLayer
from hlserve.models.loader import load_model, resolve_dtype
from hlserve.models.model_config import ModelConfig
from hlserve.models.packed_linear import can_prepack, can_widen, prepack_linears, widen_linears
from hlserve.request import Request, TokenLogprobs
from hlserve.runner.batch_meta import MetaPaths, Span, build_meta, kept_rows
from hlserve.runner.cpu_alloc import keep_freed_memory
from hlserve.runner.logits import LogitsAdjuster, apply_min_p, apply_top_k_top_p
from hlserve.runner.speculative import draft_rows, verify
from hlserve.structured.grammar import apply_grammar_masks

log = logging.getLogger("hlserve.runner")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Heartbeat:
    """When the forward last began a layer, a sublayer or an attention segment: a long step
    that still progresses is told from a stuck one (the server's wedge check)."""

    def __init__(self) -> None:
        self.last = 0.0

    def beat(self, *_: object) -> None:
        self.last = time.monotonic()


class TorchRunner(Runner):
    supports_speculation = True

    def __init__(self, config: EngineConfig) -> None:
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            if config.cpu_threads is not None:
                torch.set_num_threads(config.cpu_threads)
        mc = ModelConfig.from_dir(config.model)
        self.dtype = resolve_dtype(config.dtype, mc, self.device)
        self.model, self.model_config = load_model(config.model, self.dtype, self.device)
        self.model.merge_projections()  # q/k/v and gate/up as one GEMM each
        if can_prepack(self.device, self.dtype):
            prepack_linears(self.model)
        elif can_widen(self.device, self.dtype):
            widen_linears(self.model)
        # a heartbeat per layer and sublayer (Runner.last_progress), and per segment inside
        # the attention (AttentionMetadata.progress); the hooks hold only the heartbeat, not
        # the runner: a runner <-> model cycle kept every dropped runner's KV pool alive
        # until a full garbage collection
        self._heartbeat = Heartbeat()
        for module in self.model.modules():
            if isinstance(module, (DecoderLayer, Attention, MLP)):  # not every Linear: a
                module.register_forward_pre_hook(self._heartbeat.beat)  # hook costs a call
        self.page_size = config.page_size
        per_token = mc.kv_bytes_per_token * torch.tensor([], dtype=self.dtype).element_size()
        self.num_pages = config.num_pages or max(
            1, int(config.kv_cache_gb * 2**30) // (per_token * self.page_size)
        )
        slots = self.num_pages * self.page_size
        shape = kv_cache_shape(self.num_pages, self.page_size, mc.num_key_value_heads,
                               mc.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(mc.num_hidden_layers)
        ]
        self.decode_path = self._decode_path(mc.head_dim)
        self.prefill_path = self._prefill_path(mc.head_dim)
        if self.prefill_path == "cpu_kernel":
            # decodes ride in the prefill kernel's call as chunks of one query: since the
            # decode kernel's page walk and prefetch the two are equal at 1.4-3.8K keys and
            # the prefill kernel's bf16 dot products are 1.27x faster at 4-8K (docs/bench_results.md)
            self.decode_path = "prefill_kernel"
        self._generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.adjuster = LogitsAdjuster(self.device)  # logit_bias and penalties
        log.info(
            "loaded %s (%s, %.1fM params) on %s; KV pool %d pages x %d tokens (%.2f GiB); "
            "decode attention: %s; prefill attention: %s", mc.architecture, self.dtype,
            mc.num_parameters() / 1e6, self.device, self.num_pages, self.page_size,
            slots * per_token / 2**30, self.decode_path, self.prefill_path,
        )

    def _decode_path(self, head_dim: int) -> str:
        """How decodes attend: one padded call on CUDA (a launch per sequence costs more
        than the padding), the in-place C++ kernel on the CPU where it builds, else one SDPA
        call per sequence over its gathered context."""
        if self.device.type == "cuda":
            return "padded"
        if supports(head_dim, self.dtype) and decode_op() is not None:
            return "cpu_kernel"
        return "per_sequence"

    def _prefill_path(self, head_dim: int) -> str:
        """How prompt chunks attend: the in-place C++ kernel on a CPU with AVX512_BF16 and a
        bf16 model (bf16 dot products: ~1.5x PyTorch's CPU flash kernel, which runs at fp32
        speed), else SDPA over the gathered context."""
        if (self.decode_path == "cpu_kernel" and supports_prefill(head_dim, self.dtype)
                and prefill_op() is not None):
            return "cpu_kernel"
        return "sdpa"

    # ---- batch -> tensors ----------------------------------------------------------------
    @property
    def _paths(self) -> MetaPaths:
        return MetaPaths(self.decode_path, self.prefill_path, self.page_size, self.device)

    def _prepare(self, batch: Batch
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, KeptRows | None]:
        """Token ids, positions, new tokens' slots and each sequence's context pages: plain
        lists over the batch (O(tokens + pages)), one host-to-device copy each; and the rows
        the last layer runs (``kept_rows``)."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq in batch.seqs:
            if seq.draft:  # the last known token, then the drafts
                ids.extend(seq.request.tokens(seq.start, seq.end - len(seq.draft)))
                ids.extend(seq.draft)
            else:
                ids.extend(seq.request.tokens(seq.start, seq.end))
            table = seq.page_table
            if seq.num_tokens == 1:  # a decode: no per-token ranges to build
                positions.append(seq.start)
                slots.append(table[seq.start // ps] * ps + seq.start % ps)
            else:
                rng = range(seq.start, seq.end)
                positions.extend(rng)
                slots.extend([table[p // ps] * ps + p % ps for p in rng])
        paths, beat = self._paths, self._heartbeat.beat
        meta = build_meta([Span.of(seq) for seq in batch.seqs], slots, paths, beat)
        dev = self.device
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta,
                kept_rows(batch, slots, paths, beat))

    # ---- execute ------------------------------------------------------------------------
    @property
    def last_progress(self) -> float:
        return self._heartbeat.last

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepResult:
        t0 = time.perf_counter()
        self._heartbeat.beat()
        input_ids, positions, meta, kept = self._prepare(batch)
        self._heartbeat.beat()
        hidden = self.model(input_ids, positions, self.kv_caches, meta, kept)
        rows, which, spec = draft_rows(batch.seqs)
        if kept is not None:  # hidden holds the kept rows only: batch rows -> its rows
            at = {r: i for i, r in enumerate(kept.row_list)}
            rows, spec = [at[r] for r in rows], [(seq, at[first]) for seq, first in spec]
        reqs = [batch.seqs[i].request for i in which]
        tokens: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        accepted: dict[str, list[int]] = {}
        if spec:  # every row of the speculating requests, one logits call with the rest
            at = len(rows)
            rows = rows + [r for seq, first in spec for r in range(first, first + seq.num_tokens)]
            all_logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
            for seq, _ in spec:
                out = verify(seq, all_logits[at : at + seq.num_tokens],
                             self._generator_for(seq.request))
                at += seq.num_tokens
                accepted[seq.request.request_id] = out[:-1]
                tokens[seq.request.request_id] = out[-1]
            rows = rows[: len(reqs)]
        if rows:
            logits = (all_logits[: len(rows)] if spec else
                      self.model.logits(hidden[torch.tensor(rows, device=self.device)]))
            want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
            # structured outputs first: logprobs are of what the grammar allows (vLLM masks
            # before its sampler), so no alternative shown is one the grammar forbids
            # (the one check is all an unconstrained batch pays)
            if any(r.grammar is not None for r in reqs):
                apply_grammar_masks(logits, reqs)
            # the model's raw distribution, before min_tokens masking and temperature
            raw = torch.log_softmax(logits[want].float(), dim=-1) if want else None
            sampled = self.sample(logits, reqs).tolist()
            tokens.update((r.request_id, t) for r, t in zip(reqs, sampled, strict=True))
            if raw is not None:
                logprobs = _token_logprobs(raw, [reqs[i] for i in want], [sampled[i] for i in want])
        return StepResult(tokens=tokens, elapsed=time.perf_counter() - t0, logprobs=logprobs,
                          accepted=accepted)

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Greedy at temperature 0, else temperature / min-p / top-k / top-p sampling (vLLM's
        order); EOS and stop ids are masked until ``min_tokens`` is reached (as vLLM and
        transformers do). Grammar masks are the caller's (``execute`` applies them first)."""
        for i, r in enumerate(reqs):
            p = r.params
            if len(r.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
                if banned:
                    logits[i, [b for b in banned if b < logits.shape[1]]] = -float("inf")
        # logit_bias and penalties, greedy rows included (as vLLM); no work when none asks
        self.adjuster.apply(logits, reqs)
        force_thinking_end(logits, reqs)
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if not random_rows:
            return greedy
        idx = torch.tensor(random_rows, device=logits.device)
        sub = logits[idx]
        params = [reqs[i].params for i in random_rows]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        sub = sub / temps.unsqueeze(1)
        min_p = [p.min_p for p in params]
        if max(min_p) > 0:
            sub = apply_min_p(sub, min_p)
        top_k = [p.top_k if p.top_k > 0 else sub.shape[1] for p in params]
        top_p = [p.top_p for p in params]
        if min(top_k) < sub.shape[1] or min(top_p) < 1.0:
            sub = apply_top_k_top_p(sub, top_k, top_p)
        # inverse CDF: one uniform draw per row picks the first token whose cumulative
        # probability exceeds it. Each seeded request draws from its own generator, so its
        # output is reproducible whatever else is in the batch. (An exponential race needs a
        # draw per vocabulary entry: 12% of a 16-sequence decode step of a 152K-vocab model.)
        cdf = torch.softmax(sub.float(), dim=-1).cumsum_(dim=-1)
        u = torch.empty(len(random_rows), 1, device=logits.device)
        for j, i in enumerate(random_rows):
            u[j].uniform_(generator=self._generator_for(reqs[i]))
        # right=True: the first index whose cdf is strictly above u x total, never a token of
        # zero probability (the cdf is flat across those)
        picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        greedy[idx] = picked.clamp_(max=cdf.shape[1] - 1)
        return greedy

    def _generator_for(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self._generator
        g = self._request_generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(req.params.seed)
            self._request_generators[req.request_id] = g
        return g

    def release(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)
        self.adjuster.release(request_id)


def force_thinking_end(logits: torch.Tensor, reqs: list[Request]) -> None:
    """A request past its thinking budget (``params.thinking``) emits the section's end
    token: its row keeps only that token (set to 0, so a grammar's or a bias's -inf cannot
    leave the row empty). After the penalties, as vLLM forces it."""
    for i, r in enumerate(reqs):
        if r.thinking is None:
            continue
        r.thinking.sync(r.output_token_ids)
        token = r.thinking.forced()
        if token is not None and token < logits.shape[1]:
            logits[i].fill_(-float("inf"))
            logits[i, token] = 0.0


def _token_logprobs(raw: torch.Tensor, reqs: list[Request], sampled: list[int]
                    ) -> dict[str, TokenLogprobs]:
    """Each row's sampled-token logprob and its request's top ``logprobs`` (best first)."""
    k = max(r.params.logprobs or 0 for r in reqs)
    top_v, top_i = raw.topk(k, dim=-1) if k > 0 else (raw[:, :0], raw[:, :0].long())
    chosen = raw.gather(1, torch.tensor(sampled, device=raw.device).unsqueeze(1)).squeeze(1)
    # one device-to-host copy each, then plain lists
    chosen_l, ids_l, vals_l = chosen.tolist(), top_i.tolist(), top_v.tolist()
    out = {}
    for j, r in enumerate(reqs):
        n = r.params.logprobs or 0
        top = tuple(zip(ids_l[j][:n], vals_l[j][:n], strict=True))
        out[r.request_id] = TokenLogprobs(chosen_l[j], top)
    return out
