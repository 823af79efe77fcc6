from batchserve.core.kv_cache import KVCacheManager
from batchserve.request import Request, SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), 0.0)


def test_allocate_grows_and_free_returns_everything():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate("a", 5)  # 2 blocks
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate("a", 8)  # still 2
    assert len(kv.block_table("a")) == 2
    assert kv.allocate("a", 9)  # 3
    assert kv.num_free_blocks == 5
    assert kv.allocate("b", 20)  # 5 more: pool exhausted
    assert kv.num_free_blocks == 0
    assert kv.usage == 1.0
    kv.free("a")
    kv.free("b")
    kv.free("b")  # idempotent
    kv.check_all_free()


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 8)
    assert not kv.allocate("b", 12)  # needs 3, only 2 free
    assert kv.block_table("b") == []
    assert kv.num_free_blocks == 2
    kv.free("a")
    kv.check_all_free()


def test_prefix_blocks_shared_by_refcount_and_evicted_lru():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(10)))
    assert kv.match_prefix(a) == 0
    assert kv.allocate("a", 10)
    a.num_computed_tokens = 10
    kv.commit(a)  # two full blocks named
    b = _req("b", list(range(9)) + [99, 100])
    assert kv.match_prefix(b) == 8  # shares both full blocks
    assert kv.block_table("b") == kv.block_table("a")[:2]
    assert kv.allocate("b", 11)
    assert kv.num_free_blocks == 6 - 3 - 1
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 6  # cached blocks count as free
    # a prompt that is entirely cached still leaves its last token to compute
    c = _req("c", list(range(8)))
    assert kv.match_prefix(c) == 4
    kv.free("c")
    # pressure evicts cached blocks
    assert kv.allocate("d", 24)
    d = _req("d", list(range(8)))
    kv.free("d")
    assert kv.match_prefix(d) == 0
    kv.free("d")
    kv.check_all_free()
    assert 0 < kv.prefix_hit_rate < 1
