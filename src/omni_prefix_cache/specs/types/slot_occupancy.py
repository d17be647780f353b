# Generated from spec/slot_occupancy.yaml by `make typed-specs`; do not edit.
"""Typed names of the ``slot_occupancy`` spec:
the ``SlotState`` states and the ``SlotOccupancyTrigger`` triggers.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeAlias

from omni_prefix_cache.specs.compiled import SpecState

SPEC_NAME = "slot_occupancy"


class SlotState(SpecState):
    """
    Which write last claimed a KV slot's row for one pool key, and whether that row has reached the CPU block
    pool. Slots cycle forever: vLLM reusing a block is the eviction. Hidden and each mm key move independently.
    Each slot also remembers which save (tenancy) last mapped it, so a materialize that rejects its step's
    speculative drafts moves only the slots no later save wrote.
    """

    ABSENT = 0
    """
    not written for this key by the slot's tenant (hits on hidden raise; mm serves the baseline, zeros)
    (initial, tag rest, tag read_baseline)
    """
    IN_TRANSIT = 1
    """owned by one unfinished write task (tids holds the owner) (tag owned, tag read_owner)"""
    COMMITTED = 2
    """the owner's pool write was published; the pool row is durable (tag rest, tag read_pool)"""
    REJECTED = 3
    """
    the row its last save wrote is a rejected speculative draft (its step's materialize said so); a hit on it
    raises for every key until a save maps the slot again (tag rest, tag read_refused)
    """


SlotState.final_states = frozenset()
INITIAL = SlotState.ABSENT


class SlotOccupancyTrigger(StrEnum):
    """Trigger names of the slot_occupancy spec."""

    MAP = "map"
    """a new write maps the slot"""
    COMMIT = "commit"
    """the owner's pool write was drained; a taken-over slot stays with its new owner"""
    DROP = "drop"
    """the owner's write failed; its rows never landed"""
    RESET = "reset"
    """the slot's new tenant does not write this key; it was absent already"""
    RESTORE = "restore"
    """the host tier restores a block's rows into the slot (a KV connector loaded its KV there)"""
    REJECT = "reject"
    """
    a materialize found the row its step wrote here past the request's accepted end (a rejected speculative
    draft) and no later save mapped the slot since: the owner skips it at its pool write
    """


SlotOccupancyTriggerName: TypeAlias = Literal["map", "commit", "drop", "reset", "restore", "reject"]
