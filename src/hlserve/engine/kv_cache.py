"""KV page accounting: a pool of fixed-size pages and a radix prefix cache over them.

Every page is in exactly one of three states:

- **free**: on the free list;
- **in use**: held by at least one live request (a private page, or a tree node with ref > 0);
- **cached**: a tree node nobody holds (ref == 0), kept for future prefix hits and evictable.

The radix tree is page-granular: each node stands for one full page of tokens and is keyed
by those tokens under its parent, so a path from the root spells a cached prefix. A request
holds (references) every node on its path, hence a parent's ref count is never below its
child's and the unreferenced nodes hang below referenced ones. They sit in one LRU list;
releases walk leaf to root, so a child always stands before its parent in that list and the
head of the list is always a leaf: eviction is O(1), no heap, no scan.

**Namespaces.** A request may carry a cache salt (vLLM's ``cache_salt``; the server sets it per
API key): a salted request's first page is keyed by ``(salt, *tokens)``, so it matches only
pages cached under the same salt, and every deeper page hangs below a salted first page.
Requests of different salts never share a page nor see each other's hits; unsalted requests
share the plain namespace. Nothing else changes: eviction and accounting are per node.

**Session retention.** A finished round of an agent session may release its pages as
*retained* until a deadline (``release(..., retain_until=t)``): they sit in a second LRU list,
cached and unreferenced like any other, but eviction takes every plain unreferenced page
before a retained one. ``expire(now)`` turns the retained pages whose deadline has passed into
plain ones. Retained pages still count as evictable (``available``): an allocation that needs
them takes them, so retention never blocks an admission that would fit without it and never
deadlocks the pool. A plain node above retained children cannot be evicted before them (only
leaves are); eviction moves it to the retained list's tail, where it waits behind them.

Pages stay private to a request until they are full; full pages enter the tree as soon as
their KV is computed (not only at the end), so concurrent requests with a shared prefix and
a retracted request coming back both hit them. Physical tensors live in the runner, indexed
by the page ids handed out here.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


class Node:
    """One cached page: ``key`` is its tokens (a first page's also its salt), unique among
    its parent's children.

    A plain slotted class, not a dataclass: a long prefill creates thousands per iteration
    and identity (not value) is what equality and hashing must mean here."""

    __slots__ = ("children", "evicted", "key", "page", "parent", "ref", "version")

    def __init__(self, page: int, key: tuple, parent: Node | None, ref: int = 0) -> None:
        self.page = page
        self.key = key
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.ref = ref
        self.evicted = False  # out of the tree; ``parent`` is kept so matchers can climb back
        self.version = 0  # children added so far: a matcher that found no child may skip
        # looking again until this changes (LPM at thousands waiting)


@dataclass(slots=True)
class TreeWatch:
    """Spots of the tree that a reader (the LPM order) keeps results about, so that it
    re-reads only those that changed instead of every spot on every pass.

    ``at[node][key]`` holds whatever the reader files under "``node`` has no child ``key``"
    (request ids whose walk missed there); ``at[node][None]`` under "a walk ended at
    ``node``". The tree adds ``(node, key)`` to ``changed`` when that child is added, and
    ``(node, None)`` when a watched node is evicted; the reader empties ``changed`` when it
    looks. Only watched spots are recorded, so ``changed`` stays small however long the
    reader does not look."""

    at: dict[Node, dict[tuple | None, set[str]]] = field(default_factory=dict)
    changed: set[tuple[Node, tuple | None]] = field(default_factory=set)


@dataclass
class SeqPages:
    """Pages of one live request: ``pages[:len(nodes)]`` are tree pages it references."""

    pages: list[int] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    salt: str | None = None  # the namespace its pages are committed under


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root = Node(page=-1, key=(), parent=None, ref=1)  # never evicted
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out 0 first
        self._lru: OrderedDict[Node, None] = OrderedDict()  # unreferenced tree nodes, oldest first
        # unreferenced nodes of finished session rounds -> their retention deadline, oldest first
        self._retained: OrderedDict[Node, float] = OrderedDict()
        # expire() pops due deadlines from a heap instead of scanning every retained page
        # each step (at 128 sessions of 32K that scan was most of a simulated step). One
        # entry per release, (deadline, first insertion number, [(number, node)]); a node in
        # it is live while it is still retained under that number (``_rnum``: each retained
        # node's current number)
        self._deadlines: list[tuple[float, int, list[tuple[int, Node]]]] = []
        self._rnum: dict[Node, int] = {}
        self._parked = 0  # retained entries that are plain parents parked behind children
        self._counter = itertools.count()
        self._seqs: dict[str, SeqPages] = {}
        self._watches: list[TreeWatch] = []
        self.num_tree_nodes = 0
        # counters for metrics: prefix-cache queries and hits, in tokens (vLLM's meaning)
        self.prefix_queries = 0
        self.prefix_hits = 0
        # session retention counters: retained pages found again by an admission (TTL hits),
        # retained pages whose deadline passed (expiries), retained pages evicted under pressure
        self.retained_hits = 0
        self.retained_expired = 0
        self.retained_evicted = 0
        self.num_evicted = 0  # cached pages evicted, plain or retained

    # ---- cheap queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._lru) + len(self._retained)

    @property
    def num_retained(self) -> int:
        """Cached pages of finished session rounds still under their retention deadline."""
        return len(self._retained)

    @property
    def num_pinned(self) -> int:
        """Retained pages under a deadline (not the plain parents parked among them)."""
        return len(self._retained) - self._parked

    def pinned_among(self, nodes: list[Node]) -> int:
        """How many of ``nodes`` (a matched prefix) are retained under a deadline."""
        retained = self._retained
        return sum(1 for n in nodes if n.ref == 0 and retained.get(n, -math.inf) != -math.inf)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free - self.num_evictable

    @property
    def usage(self) -> float:
        """Fraction of the pool held by live requests (vLLM's ``kv_cache_usage_perc``)."""
        return self.num_used / self.num_pages

    def available(self) -> int:
        """Pages that an allocation could get now: free plus evictable."""
        return len(self._free) + len(self._lru) + len(self._retained)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def page_table(self, req_id: str) -> list[int]:
        return self._seqs[req_id].pages

    def holds(self, req_id: str) -> bool:
        return req_id in self._seqs

    def page_key(self, parent: Node, page_tokens: Sequence[int], salt: str | None) -> tuple:
        """The key of the page spelling ``page_tokens`` under ``parent``: first pages carry
        the salt, so namespaces part at the root."""
        key = tuple(page_tokens)
        return (salt, *key) if salt is not None and parent is self.root else key

    def child(self, parent: Node, page_tokens: Sequence[int], salt: str | None = None) -> Node | None:
        """The cached page spelling ``page_tokens`` under ``parent`` in ``salt``'s namespace."""
        return parent.children.get(self.page_key(parent, page_tokens, salt))

    def match_prefix(self, tokens: list[int], max_tokens: int | None = None,
                     salt: str | None = None) -> list[Node]:
        """Tree nodes spelling the longest cached prefix of ``tokens`` in ``salt``'s
        namespace (no state change)."""
        if not self.enable_prefix_caching:
            return []
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        ps = self.page_size
        node, out = self.root, []
        for i in range(limit // ps):
            child = self.child(node, tokens[i * ps : (i + 1) * ps], salt)
            if child is None:
                break
            out.append(child)
            node = child
        return out

    def watch(self) -> TreeWatch:
        """A new watch over this tree (see ``TreeWatch``); it lives as long as the tree."""
        w = TreeWatch()
        self._watches.append(w)
        return w

    def _notify(self, node: Node, key: tuple | None) -> None:
        """``node`` gained child ``key`` (None: ``node`` was evicted): tell the watches that
        watch that spot."""
        for w in self._watches:
            spots = w.at.get(node)
            if spots is not None and (key is None or key in spots):
                w.changed.add((node, key))

    # ---- state changes ---------------------------------------------------------------------
    def admit(self, req_id: str, tokens: list[int], max_cached_tokens: int,
              matched: list[Node] | None = None, salt: str | None = None) -> int:
        """Start holding pages for a request; returns how many leading tokens are cached.

        ``max_cached_tokens`` is at most ``len(tokens) - 1``: the last token is always
        computed, because its logits are what the next token is sampled from. ``matched``
        is ``match_prefix(tokens, max_cached_tokens)`` when the caller just computed it
        (with no change to the tree since, and the same ``salt``): a long context is then
        not walked twice. The request's pages are committed under ``salt``'s namespace.
        """
        if req_id in self._seqs:
            raise RuntimeError(f"{req_id} already holds pages")
        nodes = self.match_prefix(tokens, max_cached_tokens, salt) if matched is None else matched
        for node in nodes:
            self._lock(node)
        self._seqs[req_id] = SeqPages(pages=[n.page for n in nodes], nodes=list(nodes), salt=salt)
        self.prefix_queries += len(tokens)
        self.prefix_hits += len(nodes) * self.page_size
        return len(nodes) * self.page_size

    def allocate(self, req_id: str, num_tokens: int) -> bool:
        """Make the request's pages cover ``num_tokens`` slots; False (and no change) if the
        pool cannot, even after evicting every cached page."""
        seq = self._seqs[req_id]
        need = self.pages_for(num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        if need > self.available():
            return False
        if need > len(self._free):
            self.evict(need - len(self._free))
        seq.pages.extend(self._free.pop() for _ in range(need))
        return True

    def trim(self, req_id: str, num_tokens: int) -> int:
        """Free the request's private pages beyond those ``num_tokens`` slots need (a
        speculating request's rejected drafts); tree pages are never freed here. Returns how
        many pages were freed."""
        seq = self._seqs[req_id]
        keep = max(self.pages_for(num_tokens), len(seq.nodes))
        extra = seq.pages[keep:]
        if extra:
            del seq.pages[keep:]
            self._free.extend(reversed(extra))
        return len(extra)

    def committed_tokens(self, req_id: str) -> int:
        """Leading tokens of the request already in the tree: ``commit`` needs only the
        tokens after these."""
        return len(self._seqs[req_id].nodes) * self.page_size

    def commit(self, req_id: str, tokens: list[int], num_computed: int, offset: int = 0) -> None:
        """Insert the request's full, computed pages into the tree (shareable from now on).

        ``tokens[0]`` is the request's token number ``offset`` (at most
        ``committed_tokens``): callers on the hot path pass only the tail, not a copy of a
        long context every time a page fills."""
        if not self.enable_prefix_caching:
            return
        seq = self._seqs[req_id]
        ps = self.page_size
        full = min(num_computed // ps, len(seq.pages))
        parent = seq.nodes[-1] if seq.nodes else self.root
        if offset > len(seq.nodes) * ps:
            raise ValueError(f"commit from token {offset}: tokens from {len(seq.nodes) * ps} are needed")
        start = len(seq.nodes)
        for i in range(start, full):
            a = i * ps - offset
            key = self.page_key(parent, tokens[a : a + ps], seq.salt)
            node = parent.children.get(key)
            if node is None:
                node = Node(seq.pages[i], key, parent, 1)
                parent.children[key] = node
                parent.version += 1
                if self._watches:
                    self._notify(parent, key)
                self.num_tree_nodes += 1
            else:
                # Another request computed the same page first: share its copy, free ours.
                self._free.append(seq.pages[i])
                seq.pages[i] = node.page
                self._lock(node)
            seq.nodes.append(node)
            parent = node

    def release(self, req_id: str, retain_until: float | None = None) -> None:
        """Stop holding a request's pages. Its committed pages stay cached (commit first to
        keep the computed full pages); the rest go back to the free list. With
        ``retain_until`` (a finished session round) the pages it leaves unreferenced are
        retained until then: evicted only after every plain cached page."""
        seq = self._seqs.pop(req_id)
        kept: list[Node] = []
        for node in reversed(seq.nodes):  # leaf first: keeps children ahead of parents in LRU
            node.ref -= 1
            if node.ref == 0:
                if retain_until is None:
                    self._lru[node] = None
                else:
                    kept.append(node)
        if kept:
            self._retain(kept, retain_until)
        self._free.extend(seq.pages[len(seq.nodes) :])

    def expire(self, now: float) -> int:
        """Retained pages whose deadline is ``now`` or past become plain cached pages (in
        their retained order, so children stay ahead of parents); returns how many."""
        due = []  # (insertion number, node, deadline): the retained order, as a scan gives
        heap, rnum = self._deadlines, self._rnum
        while heap and heap[0][0] <= now:
            until, _, group = heapq.heappop(heap)
            due.extend((num, node, until) for num, node in group if rnum.get(node) == num)
        due.sort(key=lambda d: d[0])
        for _, node, _ in due:
            self._unretain(node)
            self._lru[node] = None
        expired = sum(until != -math.inf for _, _, until in due)  # not the parents parked there
        self.retained_expired += expired
        return expired

    def _victim(self) -> Node | None:
        """The next leaf to evict: plain cached pages first, retained ones only when no plain
        one is left. A non-leaf head waits at the retained tail behind its children."""
        while self._lru:
            node, _ = self._lru.popitem(last=False)
            if not node.children:
                return node
            self._retain([node], -math.inf)  # its children are retained: evict it after them
        while self._retained:
            node, until = self._retained.popitem(last=False)
            del self._rnum[node]
            self._parked -= until == -math.inf
            if not node.children:
                if until != -math.inf:
                    self.retained_evicted += 1
                return node
            self._retain([node], until)  # an unreferenced leaf below it comes first
        return None

    def _retain(self, nodes: list[Node], until: float) -> None:
        """``nodes`` (listed nowhere) join the retained list's tail, in order, until
        ``until``."""
        group = [(next(self._counter), node) for node in nodes]
        for num, node in group:
            self._retained[node] = until
            self._rnum[node] = num
        if until == -math.inf:
            self._parked += len(nodes)
        heapq.heappush(self._deadlines, (until, group[0][0], group))

    def _unretain(self, node: Node) -> float:
        """Takes ``node`` off the retained list; its deadline."""
        del self._rnum[node]
        until = self._retained.pop(node)
        self._parked -= until == -math.inf
        return until

    def evict(self, num_pages: int) -> int:
        """Drop up to ``num_pages`` unreferenced leaves: least recently used plain ones
        first, then retained ones (oldest first)."""
        evicted = 0
        while evicted < num_pages:
            node = self._victim()
            if node is None:
                break
            assert not node.children, "an evicted node must be a leaf"
            assert node.parent is not None
            del node.parent.children[node.key]
            node.evicted = True
            if self._watches:
                self._notify(node, None)
            self._free.append(node.page)
            self.num_tree_nodes -= 1
            evicted += 1
        self.num_evicted += evicted
        return evicted

    def _lock(self, node: Node) -> None:
        # an unreferenced node is plain (in _lru, value None) or retained (its deadline;
        # -inf marks a plain parent parked behind retained children, no hit)
        if node.ref == 0 and self._lru.pop(node, 0) is not None \
                and self._unretain(node) != -math.inf:
            self.retained_hits += 1
        node.ref += 1

    # ---- checking ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every page is in exactly one place; ref counts equal the holders. Raises if not."""
        seen: dict[int, str] = {}

        def claim(page: int, where: str) -> None:
            if page in seen:
                raise AssertionError(f"page {page} is both {seen[page]} and {where}")
            seen[page] = where

        for p in self._free:
            claim(p, "free")
        refs: dict[int, int] = {}
        stack = list(self.root.children.values())
        n_nodes = 0
        while stack:
            node = stack.pop()
            n_nodes += 1
            claim(node.page, "tree")
            refs[id(node)] = 0
            stack.extend(node.children.values())
            if node.ref < 0:
                raise AssertionError(f"node of page {node.page} has ref {node.ref}")
            listed = (node in self._lru) + (node in self._retained)
            if listed > 1 or (node.ref == 0) != (listed == 1):
                raise AssertionError(f"node of page {node.page}: ref {node.ref} vs LRU membership")
        if n_nodes != self.num_tree_nodes:
            raise AssertionError(f"tree has {n_nodes} nodes, counter says {self.num_tree_nodes}")
        if self._rnum.keys() != self._retained.keys():
            raise AssertionError("the retained list and its deadline index disagree")
        if self._parked != sum(u == -math.inf for u in self._retained.values()):
            raise AssertionError("the parked count disagrees with the retained list")
        for rid, seq in self._seqs.items():
            for node in seq.nodes:
                refs[id(node)] = refs.get(id(node), 0) + 1
            for i, page in enumerate(seq.pages[len(seq.nodes) :]):
                claim(page, f"private to {rid} (#{i})")
            if [n.page for n in seq.nodes] != seq.pages[: len(seq.nodes)]:
                raise AssertionError(f"{rid}: page table disagrees with its tree path")
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if refs[id(node)] != node.ref:
                raise AssertionError(f"node of page {node.page}: ref {node.ref}, holders {refs[id(node)]}")
        if len(seen) != self.num_pages:
            raise AssertionError(f"{self.num_pages - len(seen)} pages are lost")
        if self.num_used + self.num_free + self.num_evictable != self.num_pages:
            raise AssertionError("used + free + cached != pool")
