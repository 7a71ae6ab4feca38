"""Host-side bookkeeping of KV pages: a free list with reference counts, and the prefix cache.

`PrefixCache` is a radix tree over full pages (SGLang's RadixAttention at page granularity):
a node holds one page whose KV belongs to exactly the tokens on the path from the root, so a
prompt that starts with cached pages (a shared system prompt, a few-shot block, a group's
prompt, the previous turns of a conversation) reuses them instead of prefilling them again.
Finished sequences insert their pages; pages stay while the pool has room and are evicted
least recently used first, leaves before their parents, never while a running sequence holds
them. The cache counts hits (prompt tokens reused) against prompt tokens admitted.
"""

from __future__ import annotations

import heapq
import itertools


class PagePool:
    """Pages 1..capacity-1 are allocatable; page 0 is a scratch page that unused page-table
    entries point at (it is never read unmasked and never written by a live row)."""

    def __init__(self, capacity: int):
        if capacity < 2:
            raise ValueError("a page pool needs at least 2 pages")
        self.capacity = capacity
        self.reset()

    def reset(self) -> None:
        self.refs = [0] * self.capacity
        self.free = list(range(self.capacity - 1, 0, -1))

    def can_allocate(self, count: int) -> bool:
        return len(self.free) >= count

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"KV page pool exhausted: need {count}, {len(self.free)} free; "
                               "raise num_pages or lower max_slots/max_len")
        pages = [self.free.pop() for _ in range(count)]
        for page in pages:
            self.refs[page] = 1
        return pages

    def share(self, pages: list[int]) -> list[int]:
        for page in pages:
            self.refs[page] += 1
        return list(pages)

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)

    @property
    def used(self) -> int:
        return self.capacity - 1 - len(self.free)


class _Node:
    __slots__ = ("key", "page", "parent", "children", "last_used", "users")

    def __init__(self, key: tuple[int, ...], page: int, parent: _Node | None):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_used = 0
        self.users = 0  # running sequences reading this page


class PrefixCache:
    """Radix tree of full KV pages over a `PagePool` (see the module docstring). The tree holds
    one pool reference per cached page."""

    def __init__(self, pool: PagePool, page_size: int, enabled: bool = True):
        """`enabled=False` (SGLang's --disable-radix-cache): nothing is cached or matched; every
        request prefills its whole prompt."""
        self.pool, self.page_size, self.enabled = pool, page_size, enabled
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self.root = _Node((), 0, None)
        self.pages = 0
        self.hit_tokens = self.prompt_tokens = self.evicted = 0

    def forget(self) -> None:
        """Drops every cached page (their KV was computed with weights that are gone), releasing the
        tree's references; running sequences keep the pages they share. Counters are kept."""
        self.pool.release([node.page for node in self._walk()])
        self.root = _Node((), 0, None)
        self.pages = 0

    def _keys(self, tokens: list[int]):
        """The full pages' token tuples of `tokens`, which `match` and `insert` walk (none when disabled)."""
        p = self.page_size
        return (tuple(tokens[i:i + p]) for i in range(0, len(tokens) - p + 1 if self.enabled else 0, p))

    def match(self, tokens: list[int], touch: bool = True) -> list[_Node]:
        """The cached pages that start `tokens` (full pages only), in order; marks them used
        (`touch`; a look that places nothing does not)."""
        nodes, node, now = [], self.root, next(self._clock)
        for key in self._keys(tokens):
            node = node.children.get(key)
            if node is None:
                break
            if touch:
                node.last_used = now
            nodes.append(node)
        return nodes

    def lock(self, nodes: list[_Node], delta: int = 1) -> None:
        for node in nodes:
            node.users += delta

    def insert(self, tokens: list[int], pages: list[int]) -> list[_Node]:
        """Caches the full pages of `tokens` (whose KV `pages` hold, in order); a page already
        cached for the same tokens is kept and the new one left to its owner. Returns the nodes
        on the path (the caller's to lock while it reads them)."""
        nodes, node, now = [], self.root, next(self._clock)
        for key, page in zip(self._keys(tokens), pages, strict=False):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, page, node)
                self.pool.share([page])
                self.pages += 1
            child.last_used = now
            nodes.append(child)
            node = child
        return nodes

    def evictable(self) -> int:
        """Pages eviction could free now: cached, unused by running sequences, in no one else's hands."""
        return sum(1 for n in self._walk() if n.users == 0 and self.pool.refs[n.page] == 1)

    def evict(self, count: int) -> int:
        """Frees up to `count` pages, least recently used leaves first; returns how many."""
        heap = [(n.last_used, id(n), n) for n in self._walk() if not n.children and n.users == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < count:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self.pages -= 1
            before = len(self.pool.free)
            self.pool.release([node.page])
            freed += len(self.pool.free) - before
            self.evicted += 1
            if parent is not self.root and not parent.children and parent.users == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def stats(self) -> dict[str, float]:
        rate = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"prefix_cache_hit_rate": round(rate, 4), "prefix_cache_hit_tokens": self.hit_tokens,
                "prefix_cache_prompt_tokens": self.prompt_tokens, "prefix_cache_pages": self.pages,
                "prefix_cache_evicted_pages": self.evicted}

    def _walk(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node
