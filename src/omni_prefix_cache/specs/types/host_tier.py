# Generated from spec/host_tier.yaml by `make typed-specs`; do not edit.
"""Typed names of the ``host_tier`` spec: the ``TierState`` states and the ``HostTierTrigger`` triggers."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeAlias

from omni_prefix_cache.specs.compiled import SpecState

SPEC_NAME = "host_tier"


class TierState(SpecState):
    """
    The scheduler side (tier.connector) decides what the tier holds and the worker follows its metadata in order
    (release, bind, loads). A bound entry's rows stay in its block's slots until vLLM reuses the block; the
    reuse plans a read of the old rows first (the slots' copy on write keeps them), and the fetched rows become
    the entry's own. A load restores an entry's rows into the new block (slot_occupancy's restore_tenancy
    coupling). The worker never evicts on its own: what the scheduler side believes held, the worker holds, or a
    load of it raises. A fill past this side's byte bound is kept as a surplus and its hash reported (with every
    lost one) to the scheduler side, which forgets it and releases it once no load of it is pending.
    """

    ABSENT = 0
    """the tier does not hold the hash (never bound, released, or its fill failed) (initial, tag rest)"""
    BOUND = 1
    """
    held; its rows are still in its block's slots in the pool (the block was not reused since) (tag tier_held,
    tag rest)
    """
    FILLING = 2
    """held; its block is being reused and a planned read of the old rows is in flight (tag tier_held, tag waits)"""
    HELD = 3
    """
    held; its rows (block_size per key) are the tier's own, counted against its byte bound (tag tier_held, tag
    rest)
    """
    SURPLUS = 4
    """
    held past this side's byte bound (PrefixCacheConfig.host_tier_bytes): its rows are kept, counted apart, and
    its hash was reported to the scheduler side, whose release drops them once no load of it is pending (tag
    tier_held, tag rest)
    """


TierState.final_states = frozenset()
INITIAL = TierState.ABSENT


class HostTierTrigger(StrEnum):
    """Trigger names of the host_tier spec."""

    BIND = "bind"
    """the scheduler side retains the hash; its rows are in the named block"""
    REUSE = "reuse"
    """
    a save or a restore is about to write the block's slots; a read of every key's rows is planned before the
    slots change tenant (its copy on write keeps the old rows) and fetched off the state lock
    """
    FILLED = "filled"
    """the fill's read served every key; the rows are the tier's, within its byte bound"""
    OVERFLOW = "overflow"
    """
    the fill's read served every key but its rows would pass the byte bound: kept apart, and the hash reported
    to the scheduler side (a load already under way still gets them)
    """
    LOSE = "lose"
    """the fill's read failed (or timed out); the hash is reported, and a later load of it raises"""
    RESTORE = "restore"
    """a load's new block gets the rows (written to the pool under the state lock, restore_tenancy)"""
    RELEASE = "release"
    """the scheduler side no longer holds the hash (its LRU, or the connector evicted the KV)"""


HostTierTriggerName: TypeAlias = Literal["bind", "reuse", "filled", "overflow", "lose", "restore", "release"]
