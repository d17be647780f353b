# Generated from spec/step_context.yaml by `make typed-specs`; do not edit.
"""Typed names of the ``step_context`` spec: the ``StepState`` states and the ``StepContextTrigger`` triggers."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeAlias

from omni_prefix_cache.specs.compiled import SpecState

SPEC_NAME = "step_context"


class StepState(SpecState):
    """
    Every step id is consumed by exactly one of materialize or discard_step, possibly on another thread while
    the engine runs the next step.
    """

    UNSAVED = 0
    """no save issued this step id yet (unknown ids are in this state) (initial)"""
    SAVED = 1
    """save_outputs returned this id; it holds a staging page (tag waits)"""
    CONSUMED = 2
    """already materialized or discarded (or its save failed); a second consume raises (final)"""


StepState.final_states = frozenset({StepState.CONSUMED})
INITIAL = StepState.UNSAVED


class StepContextTrigger(StrEnum):
    """Trigger names of the step_context spec."""

    SAVE = "save"
    """save_outputs issued the step id"""
    MATERIALIZE = "materialize"
    """outputs merged and returned"""
    DISCARD = "discard"
    """the engine dropped the step's outputs"""


StepContextTriggerName: TypeAlias = Literal["save", "materialize", "discard"]
