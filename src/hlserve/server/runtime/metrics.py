"""Prometheus metrics under ``hlserve:``, with vLLM's names and meanings.

Every metric carries ``model_name`` (vLLM's label); per-request quantities also carry
``request_class`` (``interactive`` | ``agent``). Pool-wide quantities (KV usage) have no
class: a page shared through the prefix cache belongs to no single class.

Counters and histograms are updated by the engine thread as outputs arrive; gauges are set
by it after every loop iteration, so a scrape never touches the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hlserve.request import REQUEST_CLASSES

if TYPE_CHECKING:
    from hlserve.engine.counters import EngineStats
    from hlserve.engine.spec_decode import SpecStats

PREFIX = "hlserve:"
# every family whose name and meaning are vLLM's is also exposed under vLLM's prefix, so
# vLLM's Grafana dashboards and alerts work unchanged; hlserve's own are not
VLLM_PREFIX = "vllm:"
HLSERVE_ONLY = ("requests_rejected", "engine_step_errors", "spec_decode_adaptive")

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")

CONTENT_TYPE = CONTENT_TYPE_LATEST

SESSION_GAUGES = {
    "retained_pages": "KV pages of finished agent-session rounds kept under their TTL.",
    "ttl_hits": "Retained pages found again by the session's next round (running total).",
    "ttl_expiries": "Retained pages whose TTL passed before reuse (running total).",
    "retained_evicted": "Retained pages evicted under pressure before their TTL (total).",
    "reprefilled_tokens": "Retained context tokens a session's next round computed again "
                          "(running total).",
}

# speculative decoding, vLLM's names and meanings (engine/spec_decode.py:SpecStats)
SPEC_COUNTERS = {
    "num_drafts": "Drafts proposed and verified (one request's proposal in one step).",
    "num_draft_tokens": "Draft tokens proposed and verified.",
    "num_accepted_tokens": "Draft tokens accepted.",
}


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # as vLLM: no *_created series (process-wide setting)
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, PREFIX
        per_class = ["model_name", "request_class"]
        self.running = Gauge(m + "num_requests_running", "Requests in the running batch.",
                             per_class, registry=r)
        self.waiting = Gauge(m + "num_requests_waiting", "Requests waiting to be scheduled "
                             "(retracted ones included).", per_class, registry=r)
        self.kv_usage = Gauge(m + "kv_cache_usage_perc", "Fraction of the KV pool held by live "
                              "requests (1 = full).", ["model_name"], registry=r)
        self.preemptions = Counter(m + "num_preemptions", "Requests retracted (preempted).",
                                   per_class, registry=r)
        self.prompt_tokens = Counter(m + "prompt_tokens", "Prompt tokens of prefilled requests.",
                                     per_class, registry=r)
        self.generation_tokens = Counter(m + "generation_tokens", "Generated tokens.", per_class,
                                         registry=r)
        self.prefix_queries = Counter(m + "prefix_cache_queries", "Prefix-cache queries, in "
                                      "tokens.", per_class, registry=r)
        self.prefix_hits = Counter(m + "prefix_cache_hits", "Prefix-cache hits, in tokens.",
                                   per_class, registry=r)
        self.request_success = Counter(m + "request_success", "Finished requests, by finish "
                                       "reason.", [*per_class, "finished_reason"], registry=r)
        self.requests_rejected = Counter(m + "requests_rejected", "Requests answered with an "
                                         "error before reaching the engine's queue, by reason.",
                                         ["model_name", "reason"], registry=r)
        self.ttft = Histogram(m + "time_to_first_token_seconds", "Time to first token.",
                              per_class, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(m + "inter_token_latency_seconds", "Time between two output tokens "
                             "of a request.", per_class, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(m + "e2e_request_latency_seconds", "Arrival to last token.",
                             per_class, buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram(m + "request_queue_time_seconds", "Arrival to first "
                                    "scheduling.", per_class, buckets=REQUEST_BUCKETS, registry=r)
        # agent sessions (engine/sessions.py): the engine's running totals, published per step
        self.sessions = {name: Gauge(m + "session_" + name, text, ["model_name"], registry=r)
                         for name, text in SESSION_GAUGES.items()}
        self.spec = {name: Counter(m + "spec_decode_" + name, text, ["model_name"], registry=r)
                     for name, text in SPEC_COUNTERS.items()}
        self.spec_per_pos = Counter(m + "spec_decode_num_accepted_tokens_per_pos", "Draft "
                                    "tokens accepted, by position in the draft.",
                                    ["model_name", "position"], registry=r)
        # throughput mode's per-step k (engine/spec_adaptive.py), hlserve's own
        self.spec_steps_by_k = Counter(m + "spec_decode_adaptive_steps", "Steps with decodes, "
                                       "by the number of draft tokens chosen (k).",
                                       ["model_name", "k"], registry=r)
        self.spec_probes = Counter(m + "spec_decode_adaptive_probes", "Drafts of k_max tokens "
                                   "while k was 0, to measure acceptance.", ["model_name"],
                                   registry=r)
        self.spec_accept = Gauge(m + "spec_decode_adaptive_acceptance", "EMA of the probability "
                                 "that a draft token is accepted when those before it were, "
                                 "by position.", ["model_name", "position"], registry=r)
        self._spec_seen: dict[str, int] = {}  # the engine's totals already counted
        self.engine_step_errors = Counter(m + "engine_step_errors", "Engine steps that raised "
                                          "(their requests failed).", ["model_name"], registry=r)
        # every series exists from the start, so a scrape shows zeros rather than nothing
        for cls in REQUEST_CLASSES:
            for metric in (self.running, self.waiting, self.preemptions, self.prompt_tokens,
                           self.generation_tokens, self.prefix_queries, self.prefix_hits,
                           self.ttft, self.itl, self.e2e, self.queue_time):
                metric.labels(model_name, cls)
            for reason in FINISH_REASONS:
                self.request_success.labels(model_name, cls, reason)
        self.kv_usage.labels(model_name).set(0)
        self.engine_step_errors.labels(model_name)
        # children by class, resolved once (labels() takes a lock and a dict lookup)
        self.c = {cls: _ClassMetrics(self, cls) for cls in REQUEST_CLASSES}

    def publish_sessions(self, stats: EngineStats) -> None:
        """The session-retention gauges from the engine's stats (``Engine.stats``)."""
        values = {"retained_pages": stats.retained_pages, "ttl_hits": stats.retained_hits,
                  "ttl_expiries": stats.retained_expired,
                  "retained_evicted": stats.retained_evicted,
                  "reprefilled_tokens": stats.reprefilled_tokens}
        for name, value in values.items():
            self.sessions[name].labels(self.model_name).set(value)

    def publish_spec(self, stats: SpecStats | None) -> None:
        """Speculative decoding's counters from the engine's running totals
        (``Engine.spec_stats``: what grew since the last call); nothing when it is off."""
        if stats is None:
            return
        for name in SPEC_COUNTERS:
            self._grow(self.spec[name].labels(self.model_name), name, getattr(stats, name))
        for i, n in enumerate(stats.accepted_per_pos):
            self._grow(self.spec_per_pos.labels(self.model_name, str(i)), f"pos{i}", n)
        adaptive = stats.adaptive
        if adaptive is not None:
            for k, n in enumerate(adaptive.steps_by_k):
                self._grow(self.spec_steps_by_k.labels(self.model_name, str(k)), f"k{k}", n)
            self._grow(self.spec_probes.labels(self.model_name), "probes", adaptive.probes)
            for i, a in enumerate(adaptive.accept):
                self.spec_accept.labels(self.model_name, str(i)).set(a)

    def _grow(self, counter: Any, key: str, total: int) -> None:
        """Count what a running total grew by since it was last seen (zero creates the
        series, so a scrape shows it from the start)."""
        counter.inc(total - self._spec_seen.get(key, 0))
        self._spec_seen[key] = total

    def reject(self, reason: str) -> None:
        self.requests_rejected.labels(self.model_name, reason).inc()

    def exposition(self) -> bytes:
        text = generate_latest(self.registry)
        return text + vllm_aliases(text)


def vllm_aliases(text: bytes) -> bytes:
    """The ``hlserve:`` families of an exposition again under ``vllm:`` (same samples)."""
    out = []
    mine = tuple(f"{PREFIX}{n}".encode() for n in HLSERVE_ONLY)
    for line in text.splitlines(keepends=True):
        name = line.split(b" ", 3)[2] if line.startswith(b"# ") else line
        if name.startswith(PREFIX.encode()) and not name.startswith(mine):
            out.append(line.replace(PREFIX.encode(), VLLM_PREFIX.encode(), 1))
    return b"".join(out)


class _ClassMetrics:
    def __init__(self, m: ServerMetrics, cls: str) -> None:
        n = m.model_name
        self.running = m.running.labels(n, cls)
        self.waiting = m.waiting.labels(n, cls)
        self.preemptions = m.preemptions.labels(n, cls)
        self.prompt_tokens = m.prompt_tokens.labels(n, cls)
        self.generation_tokens = m.generation_tokens.labels(n, cls)
        self.prefix_queries = m.prefix_queries.labels(n, cls)
        self.prefix_hits = m.prefix_hits.labels(n, cls)
        self.ttft = m.ttft.labels(n, cls)
        self.itl = m.itl.labels(n, cls)
        self.e2e = m.e2e.labels(n, cls)
        self.queue_time = m.queue_time.labels(n, cls)
        self.success = {r: m.request_success.labels(n, cls, r) for r in FINISH_REASONS}
