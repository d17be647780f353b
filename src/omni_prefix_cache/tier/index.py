"""The scheduler side's record of which block hashes the host tier holds.

Pure Python (no vLLM, no torch). ``OmniTierConnector`` asks it how far a
request's prefix is covered, tells it which finished blocks to keep, which
loads are in flight and which hashes the wrapped connector dropped; each step
it drains what the worker must apply (``take_step``: release, then bind).

The tier is LRU and bounded by bytes: ``max_bytes // block_bytes`` blocks. An
entry pinned by a load in flight is never evicted nor forgotten until the load
is unpinned: the worker still has to restore its rows into the load's blocks.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from omni_prefix_cache.errors import OmniPrefixCacheInvalidArgumentError
from omni_prefix_cache.tier.metadata import BlockHash, TierBind


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise OmniPrefixCacheInvalidArgumentError(f"TierIndex: {name} must be a positive int, got {value!r}")
    return value


class TierIndex:
    """Which hashes the host tier holds, in LRU order, at most ``capacity`` of them."""

    def __init__(self, max_bytes: int, block_bytes: int) -> None:
        _positive("max_bytes", max_bytes)
        _positive("block_bytes", block_bytes)
        self.capacity = max_bytes // block_bytes
        if self.capacity <= 0:
            raise OmniPrefixCacheInvalidArgumentError(
                f"TierIndex: max_bytes={max_bytes} holds no block of block_bytes={block_bytes}"
            )
        # Held hashes, least recently used first.
        self._held: OrderedDict[BlockHash, None] = OrderedDict()
        # What the next take_step hands the worker. A hash bound and evicted
        # before the worker heard of it cancels its bind instead of being
        # released: release applies before bind, so both would leave it bound.
        self._release: list[BlockHash] = []
        self._bind: dict[BlockHash, TierBind] = {}
        self._pins: dict[str, tuple[BlockHash, ...]] = {}
        self._pin_count: Counter[BlockHash] = Counter()
        # Hashes the connector dropped while a load still needed them.
        self._forget_later: set[BlockHash] = set()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._held

    def held(self) -> tuple[BlockHash, ...]:
        """The held hashes, least recently used first."""
        return tuple(self._held)

    def pinned(self, req_id: str) -> tuple[BlockHash, ...]:
        """The hashes ``req_id``'s load in flight pins (empty: none)."""
        return self._pins.get(req_id, ())

    def covered(self, hashes: Sequence[BlockHash], first_block: int, max_blocks: int) -> int:
        """How many consecutive blocks of ``hashes``, from index ``first_block``
        and at most ``max_blocks``, the tier holds. Marks them recently used."""
        if first_block < 0 or max_blocks < 0:
            raise OmniPrefixCacheInvalidArgumentError(
                f"TierIndex.covered: first_block={first_block} and max_blocks={max_blocks} must be >= 0"
            )
        n = 0
        for block_hash in hashes[first_block : first_block + max_blocks]:
            if block_hash not in self._held:
                break
            self._held.move_to_end(block_hash)
            n += 1
        return n

    def retain(self, pairs: Iterable[tuple[BlockHash, int]]) -> None:
        """Hold each ``(hash, block_id)`` from now on: a hash not held yet is
        queued as a ``TierBind`` for the next step (its rows are in
        ``block_id``'s slots); a held one is only marked recently used. Then
        evicts least recently used unpinned entries down to ``capacity``."""
        for block_hash, block_id in pairs:
            if block_hash in self._held:
                self._held.move_to_end(block_hash)
                continue
            self._held[block_hash] = None
            self._bind[block_hash] = TierBind(block_hash, block_id)
        self._evict()

    def pin(self, req_id: str, hashes: Iterable[BlockHash]) -> None:
        """Protect ``hashes`` from eviction while ``req_id``'s load is in
        flight (replaces an earlier pin of ``req_id``). Each must be held."""
        hashes = tuple(hashes)
        missing = [h.hex() for h in hashes if h not in self._held]
        if missing:
            raise OmniPrefixCacheInvalidArgumentError(
                f"TierIndex.pin: request {req_id!r} loads blocks the tier does not hold: {missing}"
            )
        self.unpin(req_id)
        self._pins[req_id] = hashes
        self._pin_count.update(hashes)
        for h in hashes:
            self._held.move_to_end(h)

    def unpin(self, req_id: str) -> bool:
        """Drop ``req_id``'s pin (False: it had none); hashes forgotten while
        pinned are released now, and the tier is trimmed to ``capacity``."""
        hashes = self._pins.pop(req_id, None)
        if hashes is None:
            return False
        self._pin_count.subtract(hashes)
        freed = [h for h in hashes if self._pin_count[h] <= 0]
        for h in freed:
            del self._pin_count[h]
        self.forget([h for h in freed if h in self._forget_later])
        self._evict()
        return True

    def forget(self, hashes: Iterable[BlockHash]) -> None:
        """Stop holding ``hashes`` (the wrapped connector evicted their KV, so
        no load will need them). A pinned hash goes when its last pin does;
        a hash not held is ignored."""
        for h in hashes:
            if h not in self._held:
                continue
            if self._pin_count[h] > 0:
                self._forget_later.add(h)
                continue
            self._drop(h)

    def take_step(self) -> tuple[tuple[BlockHash, ...], tuple[TierBind, ...]]:
        """What the worker applies next, ``(release, bind)`` in that order,
        each change once: the queues are empty afterwards."""
        release, bind = tuple(self._release), tuple(self._bind.values())
        self._release, self._bind = [], {}
        return release, bind

    def _drop(self, h: BlockHash) -> None:
        del self._held[h]
        self._forget_later.discard(h)
        if self._bind.pop(h, None) is None:
            self._release.append(h)

    def _evict(self) -> None:
        excess = len(self._held) - self.capacity
        if excess <= 0:
            return
        victims = []
        for h in self._held:
            if self._pin_count[h] <= 0:
                victims.append(h)
                if len(victims) == excess:
                    break
        for h in victims:
            self._drop(h)
