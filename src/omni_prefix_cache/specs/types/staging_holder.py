# Generated from spec/staging_holder.yaml by `make typed-specs`; do not edit.
"""Typed names of the ``staging_holder`` spec:
the ``HolderState`` states and the ``StagingHolderTrigger`` triggers.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeAlias

from omni_prefix_cache.specs.compiled import SpecState

SPEC_NAME = "staging_holder"


class HolderState(SpecState):
    """
    One holder of a staging page: the step that claimed it (until materialize or discard) or the step's
    immediate write viewing it (until its pool write). A page has at most these two holders: a step's immediate
    rows are one write, not one per request.
    """

    UNHELD = 0
    """not yet holding a page (initial)"""
    HELD = 1
    """holds one page; the page is busy (tag holds_page, tag waits)"""
    RELEASED = 2
    """let go; the page is free once its last holder is released (final)"""


HolderState.final_states = frozenset({HolderState.RELEASED})
INITIAL = HolderState.UNHELD


class StagingHolderTrigger(StrEnum):
    """Trigger names of the staging_holder spec."""

    CLAIM = "claim"
    """save claims a free page for its step (waits, then times out)"""
    BIND = "bind"
    """an immediate write task views the page its step holds"""
    CONSUME = "consume"
    """materialize or discard consumed the step"""
    ABANDON = "abandon"
    """the save failed after claiming; its step id is never issued"""
    WRITTEN = "written"
    """the task's pool write finished (before its completion is drained)"""
    FAIL = "fail"
    """the task failed"""


StagingHolderTriggerName: TypeAlias = Literal["claim", "bind", "consume", "abandon", "written", "fail"]
