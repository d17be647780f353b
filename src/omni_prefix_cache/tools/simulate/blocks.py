"""A vLLM-like KV block allocator with prefix hashes and an LRU free list.

Rules mirrored from vLLM v1's block pool:

- A full block's hash is ``hash(parent block hash, its token ids)``; it is
  registered when the scheduler allocates the slots that fill the block (at
  schedule time, before the forward that computes it runs).
- A prefix hit is the longest run of a request's leading full blocks whose
  hashes are cached, capped so at least one token is always recomputed.
- Freed blocks go to the tail of an LRU free list and keep their hash; a hit
  may revive them. Allocation pops the head, and evicts the popped block's
  hash at that moment. A request's blocks are freed tail first, so its last
  blocks are evicted before its shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class AllocatorStats:
    """Counters the simulation summary reports."""

    allocated: int = 0
    freed: int = 0
    evicted_hashes: int = 0
    revived_from_free: int = 0
    cached: int = 0


@dataclass
class BlockAllocator:
    """Reference-counted blocks, hash -> blocks map and an LRU free list."""

    num_blocks: int
    block_size: int
    stats: AllocatorStats = field(default_factory=AllocatorStats)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.num_blocks))
        self._ref = [0] * self.num_blocks
        self._hash: list[int | None] = [None] * self.num_blocks
        # hash -> blocks holding that content, first registered first (vLLM keeps several).
        self._by_hash: dict[int, dict[int, None]] = {}
        # Step at which each block's current hash was registered (same-step hit accounting).
        self._cached_step: list[int] = [-1] * self.num_blocks

    # ------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks on the free list (some may still carry a hash)."""
        return len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_hash(self, block: int) -> int | None:
        return self._hash[block]

    def cached_step(self, block: int) -> int:
        """Step at which ``block``'s current hash was registered (-1 if none)."""
        return self._cached_step[block]

    def is_free(self, block: int) -> bool:
        return block in self._free

    def lookup_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Blocks of the longest cached run of ``block_hashes`` from block 0.

        ``num_tokens`` is the request's known length; the hit never covers all
        of it (vLLM always recomputes at least the last token), so at most
        ``(num_tokens - 1) // block_size`` blocks are returned.
        """
        limit = max(0, (num_tokens - 1) // self.block_size)
        out: list[int] = []
        for h in block_hashes[:limit]:
            blocks = self._by_hash.get(h)
            if not blocks:
                break
            out.append(next(iter(blocks)))
        return out

    # ------------------------------------------------------------ mutation

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on hit blocks, reviving any that sit on the free list."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
                self.stats.revived_from_free += 1
            self._ref[b] += 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Pop ``n`` blocks from the LRU head (evicting their hashes), or None if short."""
        if n > len(self._free):
            return None
        out: list[int] = []
        for _ in range(n):
            b = self._pop_free()
            self._evict_hash(b)
            self._ref[b] = 1
            out.append(b)
        self.stats.allocated += n
        return out

    def _pop_free(self) -> int:
        """The block to reuse next: the least recently freed (vLLM's order)."""
        return self._free.popitem(last=False)[0]

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; unreferenced ones join the LRU tail, last block first."""
        for b in reversed(blocks):
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} freed with ref count {self._ref[b]}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                self.stats.freed += 1

    def cache(self, block: int, h: int, step: int) -> None:
        """Register ``block`` as holding the full block whose hash is ``h``."""
        if self._hash[block] is not None:
            if self._hash[block] != h:
                raise ValueError(f"block {block} already cached under another hash")
            return
        self._hash[block] = h
        self._cached_step[block] = step
        self._by_hash.setdefault(h, {})[block] = None
        self.stats.cached += 1

    def _evict_hash(self, block: int) -> None:
        h = self._hash[block]
        if h is None:
            return
        holders = self._by_hash[h]
        del holders[block]
        if not holders:
            del self._by_hash[h]
        self._hash[block] = None
        self._cached_step[block] = -1
        self.stats.evicted_hashes += 1

    def check_invariants(self) -> None:
        """Raise if the free list, ref counts and hash map disagree (tests use this)."""
        for b in range(self.num_blocks):
            on_free = b in self._free
            if on_free != (self._ref[b] == 0):
                raise AssertionError(f"block {b}: ref {self._ref[b]} but on_free={on_free}")
            h = self._hash[b]
            if h is not None and b not in self._by_hash.get(h, {}):
                raise AssertionError(f"block {b}: hash not indexed")
        for h, blocks in self._by_hash.items():
            for b in blocks:
                if self._hash[b] != h:
                    raise AssertionError(f"index says block {b} holds {h}")
