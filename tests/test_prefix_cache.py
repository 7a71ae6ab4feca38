"""The radix tree of KV pages (rlvr.rollout.pages.PrefixCache): matching, sharing, reference
counts and least-recently-used eviction of unlocked leaves, checked against hand-worked cases."""

from rlvr.rollout.pages import PagePool, PrefixCache

P = 2


def _cache(capacity=16):
    pool = PagePool(capacity)
    return pool, PrefixCache(pool, P)


def test_match_returns_the_longest_run_of_full_cached_pages():
    pool, cache = _cache()
    a = pool.allocate(3)
    cache.insert([1, 2, 3, 4, 5, 6, 7], a)  # 3 full pages; the 7th token's page is not full: not cached
    assert cache.pages == 3 and all(pool.refs[p] == 2 for p in a)
    assert [n.page for n in cache.match([1, 2, 3, 4, 9, 9])] == a[:2]
    assert [n.page for n in cache.match([1, 2, 3, 4, 5, 6, 7, 8])] == a
    assert cache.match([2, 1]) == [] and cache.match([1]) == []
    b = pool.allocate(2)  # same first page's tokens, another owner: the cached page stays, no new ref
    nodes = cache.insert([1, 2, 8, 8], b)
    assert [n.page for n in nodes] == [a[0], b[1]] and pool.refs[b[0]] == 1 and pool.refs[b[1]] == 2


def test_eviction_is_lru_leaves_first_and_skips_locked_or_shared_pages():
    pool, cache = _cache()
    old, new = pool.allocate(2), pool.allocate(2)
    cache.insert([1, 1, 2, 2], old)
    cache.insert([3, 3, 4, 4], new)
    pool.release(old + new)  # owners finished: only the tree holds them
    assert cache.evictable() == 4
    locked = cache.match([3, 3, 4, 4])  # also makes [3 3 4 4] the most recently used
    cache.lock(locked)
    assert cache.evictable() == 2
    free = len(pool.free)
    assert cache.evict(1) == 1 and old[1] in pool.free[free:]  # the LRU leaf, not its parent
    assert cache.evict(10) == 1 and old[0] in pool.free  # then the parent, now a leaf; locked ones stay
    assert [n.page for n in cache.match([3, 3, 4, 4])] == new
    cache.lock(locked, -1)
    assert cache.evict(10) == 2 and cache.pages == 0 and pool.used == 0


def test_hit_rate():
    _, cache = _cache()
    cache.record(10, 0)
    cache.record(10, 8)
    assert cache.stats()["prefix_cache_hit_rate"] == 0.4


def test_engine_hit_rate_is_the_hand_counted_share_of_cached_prompt_tokens():
    """A real engine (tiny random model, pages of 4 tokens): A (10 tokens) alone, then B = A[:8] + 3 and
    C = A[:4] + 5 together. B reuses A's two full prompt pages (8 tokens), C one (4): 12 of the 30 prompt
    tokens admitted are hits, a rate of 0.4."""
    import jax

    from rlvr import sharding
    from rlvr.models.config import ModelConfig
    from rlvr.models.params import init_params
    from rlvr.rollout.engine import Engine
    from rlvr.rollout.types import Request, SamplingParams

    cfg = ModelConfig(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16,
                      vocab_size=100, rope_theta=10000.0)
    params = init_params(cfg, jax.random.key(0), sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    engine = Engine(cfg, params, max_len=32, max_slots=4, page_size=4)
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    a = list(range(1, 11))
    engine.generate([Request("a", a, greedy)])
    engine.generate([Request("b", a[:8] + [50, 51, 52], greedy), Request("c", a[:4] + [60, 61, 62, 63, 64], greedy)])
    stats = engine.metrics()
    assert (stats["prefix_cache_prompt_tokens"], stats["prefix_cache_hit_tokens"]) == (10 + 11 + 9, 0 + 8 + 4)
    assert stats["prefix_cache_hit_rate"] == 0.4
