"""The cost model: predicted time of one iteration of a model on a hardware profile.

Per iteration, per layer, on one of ``tp`` devices (docs/fidelity.md checks each term):

- linear layers (qkv, o, gate+up, down): ``max(FLOPs / (eta_c(n) * peak), bytes /
  (eta_m * BW)) + t_kernel`` each, n = tokens in the iteration;
- elementwise ops (norms, rope, activation, residual adds, KV write): bytes / (eta_e * BW);
- prefill attention: FLOPs of ``new x context`` (causal) against the KV bytes it reads;
  decode attention: the KV bytes read (``batch x longest`` when the runner pads), both
  through one ``max(compute, memory)``; decode attention in an iteration that also holds
  prefill is slowed by the contention factor;
- tensor parallelism: two all-reduces of ``n x hidden`` per layer, ``alpha + size / algbw``.

Once per iteration: the LM head on the sampled rows (and a logits gather under TP), the host
overhead (per iteration and per sequence), and, for shapes outside the captured graphs (any
prefill, decode batches above the graph limit), the launch penalty: the device cannot run
faster than the host launches its kernels.

Every term is attributed to what bounds it (compute, memory, communication, overhead), which
is what ``hlserve cost`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hlserve.models.model_config import ModelConfig
from hlserve.sim.hardware import GIB, Hardware


@dataclass
class Breakdown:
    """Seconds, by what bounds them. ``parts`` names the components."""

    compute: float = 0.0
    memory: float = 0.0
    communication: float = 0.0
    overhead: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    iterations: int = 0

    @property
    def total(self) -> float:
        return self.compute + self.memory + self.communication + self.overhead

    @property
    def bound(self) -> str:
        shares = {"compute": self.compute, "memory": self.memory,
                  "communication": self.communication, "overhead": self.overhead}
        return max(shares, key=shares.__getitem__)

    def add(self, other: Breakdown) -> None:
        self.compute += other.compute
        self.memory += other.memory
        self.communication += other.communication
        self.overhead += other.overhead
        self.iterations += other.iterations
        for k, v in other.parts.items():
            self.parts[k] = self.parts.get(k, 0.0) + v

    def _put(self, part: str, value: float, kind: str) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + value
        setattr(self, kind, getattr(self, kind) + value)

    def as_dict(self) -> dict:
        return {"total_ms": 1e3 * self.total, "bound": self.bound,
                "compute_ms": 1e3 * self.compute, "memory_ms": 1e3 * self.memory,
                "communication_ms": 1e3 * self.communication, "overhead_ms": 1e3 * self.overhead,
                "iterations": self.iterations,
                "parts_ms": {k: 1e3 * v for k, v in self.parts.items()}}


@dataclass(frozen=True)
class IterationShape:
    """What the cost of an iteration depends on (a Batch reduced to numbers)."""

    num_tokens: int
    num_seqs: int
    num_samples: int  # rows that reach the LM head
    prefill: tuple[tuple[int, int], ...] = ()  # (new tokens, cached context before them)
    num_decodes: int = 0
    decode_ctx_sum: int = 0  # sum of decode context lengths (new token included)
    decode_ctx_max: int = 0


class CostModel:
    def __init__(self, model: ModelConfig, hardware: Hardware, tp: int = 1) -> None:
        if tp < 1:
            raise ValueError("tp must be >= 1")
        if model.num_attention_heads % tp:
            raise ValueError(f"{model.num_attention_heads} attention heads do not split over tp={tp}")
        self.model, self.hw, self.tp = model, hardware, tp
        hw, b = hardware, hardware.dtype_bytes
        h, d, L = model.hidden_size, model.head_dim, model.num_hidden_layers
        self.layers = L
        self.hq = model.num_attention_heads // tp
        self.hkv = -(-model.num_key_value_heads // tp)  # replicated when tp > kv heads
        inter = -(-model.intermediate_size // tp)
        self.gemms = (  # (K, N) per layer
            (h, (self.hq + 2 * self.hkv) * d), (self.hq * d, h), (h, 2 * inter), (inter, h),
        )
        self.vocab_per_device = -(-model.vocab_size // tp)
        self.b = b
        self.kv_bytes_per_token = 2 * L * self.hkv * d * b  # one device's share
        self.weight_bytes = model.num_parameters() * b / tp
        # elementwise bytes per token per layer: 2 norms (r+w), rope on q,k (r+w), activation
        # (2 reads, 1 write), 2 residual adds (2 reads, 1 write), KV write
        self.elem_bytes = b * (2 * 2 * h + 2 * (self.hq + self.hkv) * d + 3 * inter + 2 * 3 * h
                               + 2 * self.hkv * d)
        self.elem_kernels = 6
        self.attn_flops_per_pair = 4 * self.hq * d  # QK^T and PV, per (query, key) pair
        self.kv_read_per_token = 2 * self.hkv * d * b
        group, per_read = max(1, self.hq // self.hkv), hw.decode_heads_per_kv_read
        self.kv_decode_read_per_token = self.kv_read_per_token * (
            -(-group // per_read) if per_read > 0 else 1)
        self.q_bytes_per_token = 2 * self.hq * d * b  # Q read and O written
        self.alpha, self.algbw = hw.allreduce_params(tp)
        self.act_bytes_per_token = b * (4 * h + (self.hq + 2 * self.hkv) * d + 3 * inter)
        self._peak, self._bw = hw.peak_flops, hw.mem_bw
        self._n_half = hw.gemm_n_half
        self._linear_cache: dict[int, tuple[float, float, float, float]] = {}
        self._launch = L * hw.kernels_per_layer * hw.launch_time

    # ---- pieces ----------------------------------------------------------------------------
    def gemm(self, n: int, k: int, m: int) -> tuple[float, float, float]:
        """(compute-bound seconds, memory-bound seconds, kernel seconds) of one GEMM: only
        one of the first two is non-zero, the one that bounds it."""
        hw = self.hw
        eta_c = hw.gemm_eta_max * n / (n + self._n_half)
        tc = 2.0 * n * k * m / (eta_c * self._peak)
        tm = self.b * (k * m + n * k + n * m) / (hw.gemm_eta_mem * self._bw)
        return (tc, 0.0, hw.kernel_time) if tc >= tm else (0.0, tm, hw.kernel_time)

    def linear(self, n: int) -> tuple[float, float, float, float]:
        """All layers' linear layers and elementwise ops for ``n`` tokens: (compute, memory,
        kernel overhead, total), memoised by ``n``."""
        got = self._linear_cache.get(n)
        if got is not None:
            return got
        c = m = o = 0.0
        for k, nn in self.gemms:
            gc, gm, go = self.gemm(n, k, nn)
            c, m, o = c + gc, m + gm, o + go
        m += n * self.elem_bytes / (self.hw.elem_eta_mem * self._bw)
        o += self.elem_kernels * self.hw.elem_kernel_time
        L = self.layers
        got = (L * c, L * m, L * o, L * (c + m + o))
        if len(self._linear_cache) < 1 << 16:
            self._linear_cache[n] = got
        return got

    def _prefill_attn_by_length(self, prefill: tuple[tuple[int, int], ...]) -> float:
        """Compute-bound seconds of one layer's prefill attention, each segment at the
        efficiency of its length (short segments fill fewer tiles per head)."""
        hw, t = self.hw, 0.0
        for q, ctx in prefill:
            n = ctx + q
            eta = hw.attn_eta_compute * n / (n + hw.attn_len_half)
            t += self.attn_flops_per_pair * q * (ctx + (q + 1) / 2) / (eta * self._peak)
        return t

    def allreduce(self, nbytes: float) -> float:
        return 0.0 if self.tp == 1 else self.alpha + nbytes / self.algbw

    # ---- one iteration ---------------------------------------------------------------------
    def iteration(self, s: IterationShape, detail: bool = False) -> tuple[float, Breakdown | None]:
        """Predicted seconds of one iteration (and the breakdown when ``detail``)."""
        hw, L = self.hw, self.layers
        lin_c, lin_m, lin_o, lin_t = self.linear(s.num_tokens) if s.num_tokens else (0, 0, 0, 0)
        # prefill attention: one batched kernel per layer
        ap_c = ap_m = 0.0
        nseg = len(s.prefill)
        if nseg:
            pairs = kv = 0.0
            for q, ctx in s.prefill:
                pairs += q * (ctx + (q + 1) / 2)
                kv += ctx + q
            f = self.attn_flops_per_pair * pairs
            by = self.kv_read_per_token * kv + self.q_bytes_per_token * sum(q for q, _ in s.prefill)
            tc, tm = f / (hw.attn_eta_compute * self._peak), by / (hw.attn_eta_mem * self._bw)
            if hw.attn_len_half > 0:
                tc = self._prefill_attn_by_length(s.prefill)
            ap_c, ap_m = (L * tc, 0.0) if tc >= tm else (0.0, L * tm)
        ap_o = L * (hw.kernel_time + nseg * hw.prefill_seg_overhead) if nseg else 0.0
        # decode attention
        ad_c = ad_m = ad_o = 0.0
        if s.num_decodes:
            keys = s.num_decodes * s.decode_ctx_max if hw.decode_attn_padded else s.decode_ctx_sum
            tc = self.attn_flops_per_pair * keys / (hw.attn_eta_compute * self._peak)
            by = self.kv_decode_read_per_token * keys + self.q_bytes_per_token * s.num_decodes
            # one bandwidth for MHA and GQA alike: a grouped decode kernel (FlashAttention /
            # FlashInfer class, and hlserve's own, models/attention.py) reads each KV head once
            # for its whole query group (``decode_heads_per_kv_read`` 0). docs/fidelity.md: the
            # engines whose GQA decode ran slower split the group (TurboMind v0.1, 4 heads per
            # block) or predate a grouped kernel (TensorRT-LLM v0.6.1, before XQA)
            eta_m = hw.attn_eta_mem
            if hw.cache_bytes > 0 and by > 0:
                hit = min(by, hw.cache_bytes)
                tm = hit / (hw.attn_eta_cache * self._bw) + (by - hit) / (eta_m * self._bw)
            else:
                tm = by / (eta_m * self._bw)
            slow = 1.0 + (hw.mix_contention if nseg else 0.0)
            ad_c, ad_m = (L * tc * slow, 0.0) if tc >= tm else (0.0, L * tm * slow)
            ad_o = L * hw.kernel_time
        # tensor parallel communication
        comm = 2 * L * self.allreduce(s.num_tokens * self.model.hidden_size * self.b)
        # LM head on the sampled rows, and the logits gather
        lm_c = lm_m = lm_o = 0.0
        if s.num_samples:
            lm_c, lm_m, lm_o = self.gemm(s.num_samples, self.model.hidden_size, self.vocab_per_device)
            comm += self.allreduce(s.num_samples * self.vocab_per_device * self.b)
        device = lin_t + ap_c + ap_m + ap_o + ad_c + ad_m + ad_o + comm + lm_c + lm_m + lm_o
        host = (hw.iter_overhead + hw.host_overhead
                + (hw.seq_overhead + hw.host_seq_overhead) * s.num_seqs)
        graphed = nseg == 0 and s.num_decodes <= hw.graph_max_batch
        launch = 0.0 if graphed else max(0.0, self._launch - device)
        total = device + host + launch
        if not detail:
            return total, None
        bd = Breakdown(iterations=1)
        bd._put("linear", lin_c, "compute")
        bd._put("linear", lin_m, "memory")
        bd._put("kernel latency", lin_o + ap_o + ad_o + lm_o, "overhead")
        bd._put("attention prefill", ap_c, "compute")
        bd._put("attention prefill", ap_m, "memory")
        bd._put("attention decode", ad_c, "compute")
        bd._put("attention decode", ad_m, "memory")
        bd._put("all-reduce", comm, "communication")
        bd._put("lm head", lm_c, "compute")
        bd._put("lm head", lm_m, "memory")
        bd._put("host", host, "overhead")
        bd._put("launch", launch, "overhead")
        bd.parts = {k: v for k, v in bd.parts.items() if v > 0}
        return total, bd

    # ---- calculators (hlserve cost) ----------------------------------------------------------
    def prefill(self, n: int, chunk: int | None = None, context: int = 0) -> Breakdown:
        """A whole prefill of ``n`` new tokens after ``context`` cached ones, in chunks of
        ``chunk`` tokens (one iteration each), alone on the device."""
        if n < 1:
            raise ValueError("prefill needs at least one token")
        step = n if chunk is None else max(1, chunk)
        total = Breakdown()
        done = 0
        while done < n:
            q = min(step, n - done)
            last = done + q == n
            shape = IterationShape(num_tokens=q, num_seqs=1, num_samples=1 if last else 0,
                                   prefill=((q, context + done),))
            _, bd = self.iteration(shape, detail=True)
            assert bd is not None
            total.add(bd)
            done += q
        return total

    def decode(self, batch: int, context: int, prefill_tokens: int = 0,
               prefill_context: int = 0) -> Breakdown:
        """One decode iteration of ``batch`` sequences at ``context`` tokens each, optionally
        mixed with a prefill chunk."""
        if batch < 0 or (batch == 0 and prefill_tokens == 0):
            raise ValueError("need a decode batch or a prefill chunk")
        pf = ((prefill_tokens, prefill_context),) if prefill_tokens else ()
        shape = IterationShape(
            num_tokens=batch + prefill_tokens, num_seqs=batch + (1 if pf else 0),
            num_samples=batch, prefill=pf, num_decodes=batch, decode_ctx_sum=batch * context,
            decode_ctx_max=context if batch else 0,
        )
        _, bd = self.iteration(shape, detail=True)
        assert bd is not None
        return bd

    # ---- memory ------------------------------------------------------------------------------
    def kv_pool_tokens(self, max_tokens_per_iter: int, max_seqs: int = 256,
                       mem_util: float = 0.9, reserve_gib: float = 2.0) -> int:
        """Tokens of KV one device holds: memory x utilisation, minus its share of the
        weights, a fixed reserve (context, communication buffers, graphs) and the
        activations of the largest iteration (and its logits)."""
        hw = self.hw
        act = max_tokens_per_iter * self.act_bytes_per_token + max_seqs * self.vocab_per_device * 4
        free = hw.mem_gib * GIB * mem_util - self.weight_bytes - reserve_gib * GIB - act
        return max(0, int(free // self.kv_bytes_per_token))


def shape_of(batch, sampled: list | None = None) -> IterationShape:
    """Reduce a scheduler Batch to the numbers the cost depends on; the sequences that sample
    a token are appended to ``sampled`` when given (the same single pass)."""
    prefill: list[tuple[int, int]] = []
    n_tok = n_dec = ctx_sum = ctx_max = samples = 0
    for s in batch.seqs:
        q = s.num_tokens
        n_tok += q
        end = s.start + q
        if q == 1 and s.start > 0:
            n_dec += 1
            ctx_sum += end
            if end > ctx_max:
                ctx_max = end
        else:
            prefill.append((q, s.start))
        if end - len(s.draft) == s.request.num_tokens:  # ScheduledSeq.samples, inlined
            samples += 1
            if sampled is not None:
                sampled.append(s)
    return IterationShape(n_tok, len(batch.seqs), samples, tuple(prefill), n_dec, ctx_sum, ctx_max)



def shape_from(segments: list[tuple[int, int, bool]]) -> IterationShape:
    """An iteration's shape from its segments as another engine's scheduler reports them:
    (new tokens, tokens computed before them, whether the segment samples a token). One new
    token after a context is a decode, as in :func:`shape_of`; the other engines' steps
    (``hlserve.integrations.sim_engine``) are priced by the same cost model this way."""
    prefill: list[tuple[int, int]] = []
    n_tok = n_dec = ctx_sum = ctx_max = samples = 0
    for q, start, samples_one in segments:
        n_tok += q
        if q == 1 and start > 0:
            n_dec += 1
            end = start + 1
            ctx_sum += end
            ctx_max = max(ctx_max, end)
        else:
            prefill.append((q, start))
        samples += samples_one
    return IterationShape(n_tok, len(segments), samples, tuple(prefill), n_dec, ctx_sum, ctx_max)
