# Generated from spec/planned_read.yaml by `make typed-specs`; do not edit.
"""Typed names of the ``planned_read`` spec: the ``ReadState`` states and the ``PlannedReadTrigger`` triggers."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeAlias

from omni_prefix_cache.specs.compiled import SpecState

SPEC_NAME = "planned_read"


class ReadState(SpecState):
    """
    One hit read of one key over the hit's slots. While it is pending, a write reusing one of its committed
    slots first copies the old rows into the read (preserve), under the reads lock together with the slot's
    version bump; the fetch serves pool rows whose version is unchanged and preserved copies for the rest, and
    fails when a changed slot has no copy.
    """

    PLANNING = 0
    """being planned under the state lock; absent mm rows take the baseline, hidden ones refuse (initial)"""
    PENDING = 1
    """registered; waits for its fetch; a reuse of its slots preserves the old rows first (tag waits)"""
    FETCHING = 2
    """
    a thread is reading it (joins in-transit owners, reads the pool, checks versions); still preserved (tag
    waits)
    """
    SERVED = 3
    """its rows were returned (final)"""
    FAILED = 4
    """not servable (hidden rows absent, owner gone or failed, overwritten without a copy, join failed) (final)"""
    DROPPED = 5
    """abandoned before its fetch began (hit dropped or re-planned, step consumed, prefetch not started) (final)"""


ReadState.final_states = frozenset({ReadState.SERVED, ReadState.FAILED, ReadState.DROPPED})
INITIAL = ReadState.PLANNING


class PlannedReadTrigger(StrEnum):
    """Trigger names of the planned_read spec."""

    REGISTER = "register"
    """
    the plan is complete; later reuses of its slots must preserve for it. Rows still in transit with a deferred
    write are pinned to the chunk row that write holds for each slot now: the same write mapping the slot again
    later (its request preempted and resumed onto the block) must not answer this read with its newer row
    """
    REFUSE = "refuse"
    """planning found rows the read can never serve; the hit fails at materialize"""
    PRESERVE = "preserve"
    """copy on write; a write reuses some of its committed slots, the old rows are copied in first"""
    FETCH = "fetch"
    """the prefetch thread (or a direct fetch) starts reading it"""
    SERVE = "serve"
    """every changed slot had a preserved copy; the rows are returned"""
    FAIL = "fail"
    """a changed slot had no preserved copy, or a join or read failed"""
    DROP = "drop"
    """nobody will fetch it (a fetch already running finishes it itself)"""


PlannedReadTriggerName: TypeAlias = Literal["register", "refuse", "preserve", "fetch", "serve", "fail", "drop"]
