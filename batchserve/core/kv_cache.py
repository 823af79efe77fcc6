"""Paged KV-cache bookkeeping: a pool of fixed-size blocks with reference counts.

Plain Python, no torch: the runner owns the tensors, this owns which block holds what.
With prefix caching on, every full block is named by a hash chain over the tokens it and
all blocks before it hold; a new request reuses the longest chain already cached, and
blocks nobody references stay cached (LRU) until their space is needed.
"""
from __future__ import annotations

from collections import OrderedDict

from batchserve.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self._ref = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        # prefix cache: hash -> block, block -> hash, and unreferenced cached blocks in LRU order
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._req_hashes: dict[str, list[int]] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found cached

    # --- capacity ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

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

    # --- allocate / free ---------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to cover `num_tokens`. All or nothing: on False nothing changed."""
        table = self._tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens:
            return True  # the common decode step: its block is already there
        need = self.num_blocks_needed(request_id, num_tokens)
        if need > self.num_free_blocks:
            return False
        table = self._tables.setdefault(request_id, [])
        for _ in range(need):
            block = self._take_block()
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
        if table is None:
            return
        for block in reversed(table):  # tail first, so a prefix's head stays cached longest
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def _take_block(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)  # least recently used
        del self._by_hash[self._hash_of.pop(block)]
        return block

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
        if leaked or self._tables:
            raise AssertionError(f"KV leak: {len(leaked)} blocks referenced, tables for {list(self._tables)[:5]}")
        assert len(self._free) + len(self._evictable) == self.num_blocks


def prefix_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The chain of block hashes prefix caching names `tokens`' full blocks by (the same that
    match_prefix looks up), for a router that asks which replica holds a prompt's prefix."""
    out: list[int] = []
    parent = 0
    for i in range((len(tokens) - 1) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out
