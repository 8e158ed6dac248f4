"""Agent sessions: which session a request belongs to, and how long its KV is kept after a round.

**Which session.** A request names its session by the first of these that is set (a non-empty
string): ``session_id`` (hlserve's own field), ``prompt_cache_key`` (OpenAI's cache-routing
key), ``user`` (OpenAI's end-user id). The key is scoped by the request's cache salt (the
server sets one per API key), so two tenants that pick the same session name are two
sessions, and their pages never meet anyway (the salt parts the prefix tree).

**How long.** When a session's round ends, its pages are released as *retained*
(``KVCacheManager.release(retain_until=...)``): evicted only after every plain cached page,
and plain again at the deadline. The TTL policy:

- ``fixed``: ``session_ttl`` seconds after every round;
- ``learned``: the Continuum trade-off (arXiv 2511.02230), per session. Keeping the context
  pays when the next round comes back before the deadline; then it saves re-prefilling the
  context, ``R`` seconds at the measured time per token. Keeping it costs pool time: the
  session's share of the pool (``pages / num_pages``) for as long as it is held. With the
  session's own past tool gaps (the time between a round's end and its next round's
  arrival), the TTL is 1.25 x their 90th percentile, kept only if that holding cost, in
  pool-seconds, is below the saving ``R``, and never above ``4 x session_ttl``. Before a
  session has two gaps, the fixed TTL.

**Holding.** Retention alone yields to every admission: retained pages are evicted last, but
an admission that needs them gets them. In a closed loop where every cached page is some
session's, "last" is plain LRU order and retention changes nothing (docs/study.md). With
``session_hold`` a request that is not a started session's next round (a new session's first
round, or no session) is admitted only if it fits without the live retained pages of other
sessions, while other requests run: Continuum's pinning. It waits at most until those
requests finish or the retained pages expire (an idle engine admits it), so it never
deadlocks; running requests' growth still takes retained pages (no retraction is added).

``session_ttl`` None (the default) turns all of this off: requests release as before, and
the stored zero-gap study is unchanged.

**Memory.** What a client names a session with costs nothing past its request: the key is
a 16-byte BLAKE2b digest of the salt-scoped name (32 hex characters), whatever the name's
length, so every remembered session costs the same, at most ``SESSION_ENTRY_BYTES`` (its
key, its ``SessionState`` with a full ``array`` of gaps, and its dict slot; measured with
``tracemalloc`` in tests/test_session_memory.py). At most ``MAX_SESSIONS`` are remembered,
so the state is bounded by ``SESSIONS_MAX_BYTES`` (40 MiB) however many sessions
clients invent, and a session is forgotten ``LEARNED_CAP`` x ``session_ttl`` after its last
round ended (the longest deadline either policy gives), so idle sessions do not stay.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from hashlib import blake2b

SESSION_TTL_POLICIES = ("fixed", "learned")
MAX_GAPS = 32  # past tool gaps kept per session
MAX_SESSIONS = 65536  # sessions remembered; the least recently ended are forgotten past this
LEARNED_MARGIN, LEARNED_QUANTILE, LEARNED_CAP = 1.25, 0.9, 4.0
SESSION_KEY_BYTES = 16  # of the digest a session is keyed by (hex: twice as many characters)
# one remembered session, measured (tests/test_session_memory.py): its key, its state with
# MAX_GAPS gaps, and its share of the dict; entries are this size whatever the name was
SESSION_ENTRY_BYTES = 640  # 611 measured
SESSIONS_MAX_BYTES = MAX_SESSIONS * SESSION_ENTRY_BYTES  # 40 MiB


def session_key(session_id: str | None = None, prompt_cache_key: str | None = None,
                user: str | None = None, salt: str | None = None) -> str | None:
    """A request's session: the first non-empty of ``session_id``, ``prompt_cache_key``,
    ``user``, scoped by the tenant's cache ``salt``; None when none is set. The key is a
    digest of that (:func:`name_digest`): its size does not depend on the name's."""
    for name in (session_id, prompt_cache_key, user):
        if isinstance(name, str) and name:
            return name_digest(name if salt is None else f"{salt}\x00{name}")
    return None


def name_digest(name: str) -> str:
    """A fixed-size key for a client's name of any length (32 hex characters); lone
    surrogates, which JSON can carry, are hashed as they are rather than refused."""
    return blake2b(name.encode("utf-8", "surrogatepass"), digest_size=SESSION_KEY_BYTES
                   ).hexdigest()


@dataclass(slots=True)
class SessionState:
    last_end: float | None = None  # when its last round ended (None: a round is running)
    ended: float = 0.0  # when its last round ended, kept while the next runs: for expiry
    # past tool gaps, seconds, newest last: an array of doubles (8 bytes each, not a float
    # object's 24 plus a list slot), so that a full history costs what the budget says
    gaps: array = field(default_factory=lambda: array("d"))
    rounds: int = 0
    retained_tokens: int = 0  # context tokens its last round left retained
    reprefilled_tokens: int = 0  # context tokens its rounds had to compute again


@dataclass(slots=True)
class SessionStats:
    rounds: int = 0
    reprefilled_tokens: int = 0  # of retained context, computed again (evicted before reuse)


class Sessions:
    """Per-session state and the TTL of a finished round."""

    def __init__(self, ttl: float | None, policy: str = "fixed") -> None:
        if policy not in SESSION_TTL_POLICIES:
            raise ValueError(f"session_ttl_policy must be one of {SESSION_TTL_POLICIES}")
        self.ttl = ttl
        self.policy = policy
        # by session key, least recently ended first (a round's end moves it to the back)
        self.state: dict[str, SessionState] = {}
        self.stats = SessionStats()
        self.per_token: float | None = None  # prefill seconds per token, measured (EMA)

    @property
    def enabled(self) -> bool:
        return self.ttl is not None and self.ttl > 0

    def known(self, key: str) -> bool:
        """Whether the session has finished a round (while retention is on)."""
        return key in self.state

    def observe(self, elapsed: float, tokens: int) -> None:
        """A step's time: the per-token cost that the learned TTL prices a reload at."""
        if tokens >= 64 and elapsed > 0:
            sample = elapsed / tokens
            self.per_token = sample if self.per_token is None else 0.8 * self.per_token + 0.2 * sample
        # fewer tokens measure the step's fixed cost, not its tokens

    def on_admit(self, key: str, arrival: float, cached_tokens: int) -> None:
        """A round of ``key`` was admitted with ``cached_tokens`` of its prompt found cached:
        record its tool gap, and what of the retained context it had to compute again."""
        st = self.state.get(key)
        if st is None:
            return
        if st.last_end is not None:
            st.gaps.append(max(0.0, arrival - st.last_end))
            del st.gaps[:-MAX_GAPS]
            st.last_end = None
        lost = max(0, st.retained_tokens - cached_tokens)
        st.reprefilled_tokens += lost
        self.stats.reprefilled_tokens += lost
        st.retained_tokens = 0

    def retain_until(self, key: str, now: float, context_tokens: int, pages: int,
                     num_pages: int) -> float | None:
        """The deadline of a finished round's pages (None: release them plainly)."""
        if not self.enabled:
            return None
        self._forget_idle(now)
        st = self.state.pop(key, None)
        if st is None:
            if len(self.state) >= MAX_SESSIONS:
                del self.state[next(iter(self.state))]
            st = SessionState()
        self.state[key] = st  # the most recently ended last
        st.rounds += 1
        self.stats.rounds += 1
        st.last_end = st.ended = now
        ttl = self._ttl(st, context_tokens, pages, num_pages)
        if ttl <= 0:
            return None
        st.retained_tokens = context_tokens
        return now + ttl

    @property
    def horizon(self) -> float:
        """How long after its last round ended a session is remembered: the longest
        deadline either policy gives (the learned one's cap)."""
        assert self.ttl is not None
        return LEARNED_CAP * self.ttl

    def _forget_idle(self, now: float) -> None:
        """Forget the sessions whose last round ended over ``horizon`` ago: their pages are
        plain again, and an id a client used once must not stay (the oldest are first)."""
        state, cutoff = self.state, now - self.horizon
        while state and next(iter(state.values())).ended < cutoff:
            del state[next(iter(state))]

    def _ttl(self, st: SessionState, context_tokens: int, pages: int, num_pages: int) -> float:
        assert self.ttl is not None
        if self.policy == "fixed" or len(st.gaps) < 2:
            return self.ttl
        gaps = sorted(st.gaps)
        q = gaps[min(len(gaps) - 1, int(LEARNED_QUANTILE * len(gaps)))]
        ttl = min(LEARNED_MARGIN * q, LEARNED_CAP * self.ttl)
        if self.per_token is not None:
            saving = context_tokens * self.per_token  # seconds of prefill a hit saves
            holding = ttl * pages / max(1, num_pages)  # pool-seconds it holds meanwhile
            if holding > saving:
                return 0.0
        return ttl
