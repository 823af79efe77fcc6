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


def test_requests_growing_side_by_side_keep_their_blocks_contiguous():
    """Given the length each may reach, requests that grow a block at a time, in turn, each keep
    one run of consecutive blocks (decode attention then reads a request's history as one run
    of memory); without it, blocks handed out in turn interleave."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    for rid in "abc":
        assert kv.allocate(rid, 6, expect_tokens=40)  # 2 blocks now, up to 10
    for n in range(7, 41):
        for rid in "abc":
            assert kv.allocate(rid, n, expect_tokens=40)
    for rid in "abc":
        t = kv.block_table(rid)
        assert len(t) == 10 and t == list(range(t[0], t[0] + 10)), (rid, t)
    assert kv.num_free_blocks == 64 - 30
    plain = KVCacheManager(num_blocks=64, block_size=4)
    for n in (6, *range(7, 41)):
        for rid in "abc":
            plain.allocate(rid, n)
    assert plain.block_table("a")[2:5] == [6, 9, 12]  # in turn: every third block
    for k in (kv, plain):
        for rid in "abc":
            k.free(rid)
        k.check_all_free()


def test_reservations_are_soft_capacity_is_the_pools():
    """Reserved blocks count as free: a request that needs them gets them (taken from the end of
    a reservation), allocation stays all or nothing, and the owner goes on from where its run
    was cut."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate("a", 4, expect_tokens=32)  # 1 block, 7 reserved: the whole pool
    assert kv.num_free_blocks == 7
    assert not kv.allocate("b", 32)  # 8 blocks: more than the 7 there are
    assert kv.block_table("b") == [] and kv.num_free_blocks == 7
    assert kv.allocate("b", 12)  # 3 blocks, from the end of a's reservation
    assert kv.block_table("b") == [7, 6, 5]
    assert kv.allocate("a", 16)  # a grows into what is left of its run
    assert kv.block_table("a") == [0, 1, 2, 3]
    assert kv.allocate("a", 20) and kv.block_table("a")[-1] == 4
    assert kv.num_free_blocks == 0 and not kv.allocate("a", 21)
    kv.free("b")
    assert kv.allocate("a", 24) and kv.block_table("a")[-1] in (5, 6, 7)
    kv.free("a")
    kv.check_all_free()


def test_freeing_returns_the_reservation_and_placement_avoids_others_runs():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    assert kv.allocate("a", 4, expect_tokens=24)  # block 0, 1-5 reserved
    assert kv.allocate("b", 4, expect_tokens=16)  # not inside a's run: block 6, 7-9 reserved
    assert kv.block_table("b") == [6]
    kv.free("a")
    assert kv.num_free_blocks == 15
    assert kv.allocate("c", 8, expect_tokens=24)  # a's whole run is free again
    assert kv.block_table("c") == [0, 1]
    for rid in "bc":
        kv.free(rid)
    kv.check_all_free()


def test_a_cached_prefix_outlives_reservations_under_pressure():
    """With nothing free, a reserved block (which holds no data) is taken before a cached prefix
    is evicted."""
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(9)))
    kv.match_prefix(a)
    assert kv.allocate("a", 9)
    a.num_computed_tokens = 9
    kv.commit(a)  # two full blocks named
    kv.free("a")  # cached, evictable
    assert kv.allocate("r", 4, expect_tokens=12)  # 1 block, 2 reserved: 1 free block left
    assert kv.allocate("x", 8)  # the free block and one reserved one, not a cached block
    assert kv.match_prefix(_req("y", list(range(9)))) == 8
    for rid in "rxy":
        kv.free(rid)
    kv.check_all_free()
