"""Paged KV-cache bookkeeping: a pool of fixed-size blocks with reference counts.

Plain Python, no torch: the runner owns the tensors, this owns which block holds what.
With prefix caching on, every full block is named by a hash chain over the tokens it and
all blocks before it hold; a new request reuses the longest chain already cached, and
blocks nobody references stay cached (LRU) until their space is needed.

Placement: a request's blocks are kept next to each other in the pool where possible, so that
decode attention reads its history as one run of memory, not a block here and a block there.
Given the length a request may reach (`expect_tokens`: prompt + max_tokens), its first block
goes at the start of a free run that long and the rest of the run is reserved for it; it grows
into its reservation a block at a time. Reservations are soft: they count as free, and when no
block is free one is taken from the end of a reservation (before evicting a cached prefix), so
the capacity, admission and preemption behaviour are those of an unreserved pool. Decode attention
reads a request's history faster when its blocks are contiguous (long sequential runs) than
when they are scattered over the pool, as blocks handed out one at a time to requests growing
side by side end up (measured in docs/performance.md, "The KV cache: dtype, layout and placement").

Sharing: copies of one prompt (n > 1, best_of) fork a copy's table (`fork`): the first full
blocks are the same block ids in both tables, each reference counted, so every request frees
exactly its own references and a block returns to the pool (or the prefix cache) when the last
one goes. A shared block is read-only: it holds only prompt positions before a request's first
computed token, and a request writes KV only from its computed count on.
"""
from __future__ import annotations

from collections import OrderedDict

from batchserve.request import Request

_FREE, _RESERVED = 1, 2  # block states in KVCacheManager._state; 0: held, or cached (evictable)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self._state = bytearray([_FREE]) * num_blocks
        self._num_free = num_blocks  # blocks in state _FREE
        self._num_reserved = 0  # blocks in state _RESERVED
        self._reserved: dict[str, list[int]] = {}  # request -> [next, end): the run kept for its growth
        self._ref = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        # prefix cache: hash -> block, block -> hash, and unreferenced cached blocks in LRU order
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._req_hashes: dict[str, list[int]] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found cached
        self.forked_tokens = 0  # prompt tokens a copy took from another copy's blocks (fork)

    # --- capacity ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, reserved and evictable cached ones)."""
        return self._num_free + self._num_reserved + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks the request needs so that its table covers `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)  # blocks_for, inlined

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def ref_count(self, block: int) -> int:
        """How many requests' tables hold `block` (0: free or only cached)."""
        return self._ref[block]

    # --- allocate / free ---------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, expect_tokens: int = 0) -> bool:
        """Grow the request's table to cover `num_tokens`. All or nothing: on False nothing changed.
        `expect_tokens`: how long the request may get (prompt + max_tokens), for placing it
        where it can grow without leaving its run of blocks."""
        table = self._tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens:
            return True  # the common decode step: its block is already there
        need = self.num_blocks_needed(request_id, num_tokens)
        if need > self.num_free_blocks:
            return False
        table = self._tables.setdefault(request_id, [])
        want = max(need, self.blocks_for(expect_tokens) - len(table))
        for i in range(need):
            block = self._take_block(request_id, table, want - i)
            self._ref[block] = 1
            table.append(block)
        return True

    def grow(self, request_id: str, num_tokens: int) -> list[int] | None:
        """`allocate`, answering with the request's block table (the live list), or None
        when the blocks don't fit (nothing changed)."""
        table = self._tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens:
            return table
        return self._tables[request_id] if self.allocate(request_id, num_tokens) else None

    def free(self, request_id: str) -> None:
        """Release every block of the request (finish, abort or preemption). Idempotent."""
        table = self._tables.pop(request_id, None)
        self._req_hashes.pop(request_id, None)
        res = self._reserved.pop(request_id, None)
        if res is not None:  # the unused rest of its run: still reserved, all of it
            nxt, end = res
            self._state[nxt:end] = bytes([_FREE]) * (end - nxt)
            self._num_reserved -= end - nxt
            self._num_free += end - nxt
        if table is None:
            return
        for block in reversed(table):  # tail first, so a prefix's head stays cached longest
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._state[block] = _FREE
                    self._num_free += 1

    def _take_block(self, request_id: str, table: list[int], want: int) -> int:
        """A block for the request's next position: the next of its reserved run; else the
        block after its last one, if free; else the start of the first free run of `want`
        blocks (or half that, ...), the rest of the run reserved for it; else one taken from
        the end of another request's reservation; else the least recently used cached block."""
        st = self._state
        res = self._reserved.get(request_id)
        if res is not None:
            block = res[0]
            res[0] = block + 1
            if res[0] >= res[1]:
                del self._reserved[request_id]
            st[block] = 0
            self._num_reserved -= 1
            return block
        if table:
            block = table[-1] + 1
            if block < self.num_blocks and st[block] == _FREE:
                st[block] = 0
                self._num_free -= 1
                return block
        if self._num_free:
            n = min(want, self._num_free)
            block = st.find(bytes([_FREE]) * n)
            while block < 0:  # no run that long: settle for a shorter one
                n //= 2
                block = st.find(bytes([_FREE]) * n)
            st[block] = 0
            self._num_free -= 1
            if n > 1:
                st[block + 1:block + n] = bytes([_RESERVED]) * (n - 1)
                self._num_free -= n - 1
                self._num_reserved += n - 1
                self._reserved[request_id] = [block + 1, block + n]
            return block
        if self._num_reserved:  # nothing free: shorten someone's reservation (it holds no data)
            for owner, r in self._reserved.items():
                r[1] -= 1
                block = r[1]
                if r[0] >= r[1]:
                    del self._reserved[owner]
                st[block] = 0
                self._num_reserved -= 1
                return block
        block, _ = self._evictable.popitem(last=False)  # least recently used
        del self._by_hash[self._hash_of.pop(block)]
        return block

    def fork(self, src_id: str, dst_id: str, num_tokens: int) -> int:
        """Start `dst_id`'s table with the blocks of `src_id`'s that hold its first `num_tokens`
        tokens, full blocks only (a partial block is never shared: its owner still writes to
        it). Each shared block gains a reference; `free(dst_id)` drops exactly those. Returns
        the tokens the shared blocks cover, which the caller counts as computed for `dst_id`
        (it must then compute from there on, and `src_id` must have computed them). 0, with
        nothing changed, when `dst_id` already has a table or `src_id` none."""
        src = self._tables.get(src_id)
        if src is None or dst_id in self._tables:
            return 0
        k = min(num_tokens // self.block_size, len(src))
        table = src[:k]
        for block in table:
            self._ref[block] += 1
        self._tables[dst_id] = table
        if self.prefix_caching:  # the same chain names the same blocks; commit() goes on from it
            self._req_hashes[dst_id] = self._req_hashes.get(src_id, [])[:k]
        self.forked_tokens += k * self.block_size
        return k * self.block_size

    # --- prefix caching ----------------------------------------------------------------
    def match_prefix(self, request: Request) -> int:
        """At admission: attach the longest cached prefix of the request's tokens to its table
        and return how many tokens it covers (0 without prefix caching). At least one token
        is always left to compute, so the step still produces logits."""
        if not self.prefix_caching or request.request_id in self._tables:
            return 0
        n = request.num_tokens
        self.prefix_queries += request.num_prompt_tokens
        hashes: list[int] = []
        table: list[int] = []
        parent = 0
        for i in range((n - 1) // self.block_size):
            h = hash((parent, tuple(request.tokens_slice(i * self.block_size, (i + 1) * self.block_size))))
            block = self._by_hash.get(h)
            if block is None:
                break
            hashes.append(h)
            table.append(block)
            parent = h
        for block in table:
            if self._ref[block] == 0:
                self._evictable.pop(block, None)
            self._ref[block] += 1
        self._tables[request.request_id] = table
        self._req_hashes[request.request_id] = hashes
        matched = len(table) * self.block_size
        self.prefix_hits += min(matched, request.num_prompt_tokens)
        return matched

    def commit(self, request: Request) -> None:
        """After a step: name the request's newly filled blocks so later requests can share them."""
        if not self.prefix_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        hashes = self._req_hashes.setdefault(rid, [])
        full = min(request.num_computed_tokens // self.block_size, len(table))
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else 0
            h = hash((parent, tuple(request.tokens_slice(i * self.block_size, (i + 1) * self.block_size))))
            hashes.append(h)
            block = table[i]
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h

    def cached_hashes(self) -> frozenset[int]:
        """The hash of every block the prefix cache holds (for prefix-aware routing)."""
        return frozenset(self._by_hash)

    # --- invariants (tests) ------------------------------------------------------------
    def check_all_free(self) -> None:
        """Raise if any block is still referenced: the no-leak invariant."""
        leaked = [b for b in range(self.num_blocks) if self._ref[b] != 0]
        if leaked or self._tables or self._reserved:
            raise AssertionError(f"KV leak: {len(leaked)} blocks referenced, tables for {list(self._tables)[:5]}, "
                                 f"reservations for {list(self._reserved)[:5]}")
        assert self._num_reserved == 0 and self._num_free + len(self._evictable) == self.num_blocks
        assert self._state.count(_FREE) == self._num_free


def prefix_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The chain of block hashes prefix caching names `tokens`' full blocks by (the same that
    match_prefix looks up), for a router that asks which replica holds a prompt's prefix."""
    out: list[int] = []
    parent = 0
    for i in range((len(tokens) - 1) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out
