"""What differs between the vLLM series the plugin supports (0.32, 0.33, 0.34), each
difference in one function, found by what vLLM's classes offer rather than by version
number. Nothing else in the plugin or the harness looks at vLLM's version.

| seam | 0.32 | 0.33 | 0.34 |
|---|---|---|---|
| ``runner_output``: ``ModelRunnerOutput`` | takes ``req_id_to_index`` | same | dropped |
| ``cache_read_limit``: how much prefix cache a request may read | ``skip_reading_prefix_cache`` | same | ``get_prefix_cache_hit_limit()`` (0, a token count, or unbounded) |
| ``session_of``: a request's agent session | ``vllm_xargs`` | same | ``Request.session_id`` (the OpenAI API's ``session_id``), else ``vllm_xargs`` |
| ``session_hints``: orchestrator hints | ``vllm_xargs`` | same | ``Request.kv_hints`` (``KvHintsEnvelope``), else ``vllm_xargs`` |
| ``resumed_ids``: preempted requests scheduled again | ``scheduled_cached_reqs.resumed_req_ids`` | same | sent as new requests (``scheduled_new_reqs``) |
| ``request_fields``: building a ``Request`` (the harness) | ``vllm_xargs`` | same | ``session_id``, ``kv_hints`` |
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from hlserve.engine.sessions import session_key

# vllm_xargs keys read where the version has no field of its own (and as a fallback)
SESSION_KEY = "session_id"
TTL_KEY = "session_ttl"
# the kv_hints action hlserve implements: {"action_type": HINT_ACTION, "action_version": "1",
# "payload": {"ttl": seconds}}
HINT_ACTION = "hlserve.retain"
HINT_VERSION = "1"

_RUNNER_FIELDS = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
_REQUEST_PARAMS = set(inspect.signature(Request.__init__).parameters)


def runner_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """A runner's output for one step: ``sampled[i]`` are the tokens request ``req_ids[i]``
    produced (empty for a prefill chunk that ends mid-prompt)."""
    extra: dict[str, Any] = {}
    if "req_id_to_index" in _RUNNER_FIELDS:  # 0.32, 0.33
        extra["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)


def cache_read_limit(req: Request) -> int | None:
    """Leading tokens ``req`` may read from the prefix cache: None for no limit, 0 for none."""
    if hasattr(req, "get_prefix_cache_hit_limit"):  # 0.34
        return req.get_prefix_cache_hit_limit()
    return 0 if req.skip_reading_prefix_cache else None  # 0.32, 0.33


def _xargs(req: Request) -> Mapping[str, Any]:
    sp = req.sampling_params
    return (sp.extra_args or {}) if sp is not None else {}


def session_of(req: Request) -> str | None:
    """The agent session ``req`` is a round of: vLLM's own ``session_id`` where the version has
    it (0.34), else ``vllm_xargs.session_id``; scoped by the request's ``cache_salt`` (a
    tenant's), so two tenants naming the same session are two sessions. The key is
    hlserve's fixed-size digest (engine/sessions.py:session_key): the state kept per
    session after its request is gone costs the same whatever the name's length."""
    # the digest is taken once per request and kept on it: the order asks every pass, and a
    # long name would be hashed again each time on the scheduler's path
    key = getattr(req, _SESSION_MEMO, _UNSET)
    if key is _UNSET:
        name = getattr(req, "session_id", None) or _xargs(req).get(SESSION_KEY)
        key = session_key(name, salt=getattr(req, "cache_salt", None) or None) \
            if isinstance(name, str) and name else None
        setattr(req, _SESSION_MEMO, key)
    return key


_SESSION_MEMO = "_hlserve_session_key"
_UNSET = object()


def session_hints(req: Request) -> dict[str, Any]:
    """The retention hints a request carries: ``{"ttl": seconds}`` from a ``kv_hints`` action
    ``hlserve.retain`` (0.34), else ``vllm_xargs.session_ttl``. A hint hlserve cannot read
    is an error here (the caller logs it and goes on without it)."""
    hints = getattr(req, "kv_hints", None)
    for action in (hints.actions if hints is not None else ()):
        if action.action_type != HINT_ACTION:
            continue  # another component's action
        if action.action_version != HINT_VERSION:
            raise ValueError(f"kv_hints action {HINT_ACTION} version "
                             f"{action.action_version!r}: hlserve reads version {HINT_VERSION}")
        return {"ttl": _seconds(action.payload.get("ttl"), f"kv_hints {HINT_ACTION} ttl")}
    if (ttl := _xargs(req).get(TTL_KEY)) is not None:
        return {"ttl": _seconds(ttl, f"vllm_xargs {TTL_KEY}")}
    return {}


def _seconds(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
        raise ValueError(f"{where} must be a number of seconds >= 0, got {v!r}")
    return float(v)


def request_fields(session_id: str | None, ttl: float | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A session and its TTL hint on a ``Request`` the harness builds: (keyword arguments for
    ``Request(...)``, ``vllm_xargs`` entries), each where the version takes it: 0.34's
    ``session_id`` and ``kv_hints``, else ``vllm_xargs``."""
    kwargs: dict[str, Any] = {}
    xargs: dict[str, Any] = {}
    if session_id is not None:
        if "session_id" in _REQUEST_PARAMS:  # 0.34
            kwargs["session_id"] = session_id
        else:
            xargs[SESSION_KEY] = session_id
    if ttl is not None:
        if "kv_hints" in _REQUEST_PARAMS:  # 0.34
            from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

            kwargs["kv_hints"] = KvHintsEnvelope(
                protocol_version="1", message_id="hlserve", actions=[KvHintAction(
                    action_id="retain", action_type=HINT_ACTION, action_version=HINT_VERSION,
                    payload={"ttl": ttl})])
        else:
            xargs[TTL_KEY] = ttl
    return kwargs, xargs


def resumed_ids(out: Any) -> tuple[str, ...]:
    """Preempted requests a ``SchedulerOutput`` schedules again, where the version lists them
    apart from its new requests (0.32, 0.33); 0.34 sends them as new requests."""
    resumed = getattr(out.scheduled_cached_reqs, "resumed_req_ids", None) or ()
    return tuple(sorted(resumed))
