# Generated from spec/request_lifecycle.yaml by `make typed-specs`; do not edit.
"""Typed names of the ``request_lifecycle`` spec:
the ``RequestState`` states and the ``RequestLifecycleTrigger`` triggers.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeAlias

from omni_prefix_cache.specs.compiled import SpecState

SPEC_NAME = "request_lifecycle"


class RequestState(SpecState):
    """
    A request id's tenure under one owner, driven by the adapter's events. A new admission of the id, or an
    accepted replacement, opens a new tenure and retires the old one; an event of an older owner never moves the
    current tenure. Preemption is not an event: the request resumes (RESUMED) in the same tenure. A speculative
    draft's row counts for the tenure only once a materialize accepted it (accept). The cache's shutdown ends no
    request, so a tenure rests wherever the scheduler left it (the states tagged rest).
    """

    UNKNOWN = 0
    """no event of this tenure applied yet (initial)"""
    ADMITTED = 1
    """a control-only event established the owner; the prefix lookup is still pending (tag waits, tag rest)"""
    RUNNING = 2
    """the lookup is installed; its steps compute, save and deliver positions (tag rest)"""
    FINISHED = 3
    """finished or aborted; its open writes were escalated; its last outputs stay deliverable (tag rest)"""
    RETIRED = 4
    """
    superseded by a newer owner of the id; its outputs are filtered at commit. No event moves it again (only
    accept, which counts a late materialize's accepted drafts) (tag rest)
    """


RequestState.final_states = frozenset()
INITIAL = RequestState.UNKNOWN


class RequestLifecycleTrigger(StrEnum):
    """Trigger names of the request_lifecycle spec."""

    ADMIT = "admit"
    """STARTED or REPLACED whose lookup is not complete yet (a control-only step)"""
    START = "start"
    """STARTED or REPLACED with its lookup; a hit covers [0, hit_end)"""
    LOOKUP = "lookup"
    """the tenure's first event with a complete lookup"""
    RESUME = "resume"
    """
    RESUMED after a preemption; a hit recovers from the cache every position some consumer has not received
    ([lowest watermark, hit_end))
    """
    EXTEND = "extend"
    """EXTENDED (or a repeated STARTED of the same owner and lookup) is ordinary progress, no lookup"""
    ACCEPT = "accept"
    """
    the materialize of a step that scheduled speculative drafts for it: the drafts the step accepted count as
    computed and saved (the tenure's watermarks reach the accepted end, never past it: a save counts only the
    rows before its drafts); the rejected ones never count
    """
    FINISH = "finish"
    """FINISHED or ABORTED; the block hashes are public, so its open writes are escalated and must land"""
    RETIRE = "retire"
    """a newer owner took the id; the producer's writes still land, its outputs no longer deliver"""


RequestLifecycleTriggerName: TypeAlias = Literal[
    "admit",
    "start",
    "lookup",
    "resume",
    "extend",
    "accept",
    "finish",
    "retire",
]
