# Generated from spec/delivery.yaml by `make typed-specs`; do not edit.
"""Typed names of the ``delivery`` spec: the ``DeliveryState`` states and the ``DeliveryTrigger`` triggers."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeAlias

from omni_prefix_cache.specs.compiled import SpecState

SPEC_NAME = "delivery"


class DeliveryState(SpecState):
    """
    One (tenure, consumer) watermark. A view selects the positions at or past it; only an acknowledgement moves
    it, to the view's end, so each position reaches a consumer at most once and in order. A view or
    acknowledgement that would skip positions (a gap) raises instead. A view never reaches past what the
    tenure's saves recorded (once a save recorded any: a tenure with none has only caller-built outputs,
    delivered as built, as upstream does), and only a view the manager issued, as issued, is acknowledged, once:
    an issued view acknowledged again (a retried ack) moves nothing, as upstream's acknowledgement only ever
    advances.
    """

    OPEN = 0
    """the tenure is current (or finished, its last outputs still deliverable) (initial, tag rest)"""
    RETIRED = 1
    """
    the tenure was retired; commit filters its outputs; a late acknowledgement moves only this watermark (tag
    rest)
    """


DeliveryState.final_states = frozenset()
INITIAL = DeliveryState.OPEN


class DeliveryTrigger(StrEnum):
    """Trigger names of the delivery spec."""

    VIEW = "view"
    """select [max(start, watermark), end) of a materialized output; nothing is acknowledged"""
    ACK = "ack"
    """the consumer took the view's rows; the watermark moves to the view's end (never back)"""
    ACK_AGAIN = "ack_again"
    """
    an issued view an acknowledgement already spent is acknowledged again (a consumer retrying its ack): nothing
    moves
    """
    RETIRE = "retire"
    """the tenure was retired (a replacement or a new admission of the id)"""


DeliveryTriggerName: TypeAlias = Literal["view", "ack", "ack_again", "retire"]
