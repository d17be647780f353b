# Generated from spec/write_task.yaml by `make typed-specs`; do not edit.
"""Typed names of the ``write_task`` spec: the ``TaskState`` states and the ``WriteTaskTrigger`` triggers."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeAlias

from omni_prefix_cache.specs.compiled import SpecState

SPEC_NAME = "write_task"


class TaskState(SpecState):
    """
    A strict chain PENDING -> QUEUED -> COPYING -> HOST_READY -> WRITTEN, plus FAILED from any non-terminal
    state. The wait events host_ready / done are set only by the effects declared here. A task is a step's write
    (the immediate rows of one save, its requests kept as state arrays on the task: request ids in step order
    and their row offsets; one copy, one pool write per key, one completion record; the save's registration
    strategy may cut a step into several such writes, in step order), or one request's deferred write (growing
    by a chunk per save, escalated per request on finish or abort). The lifecycle is the same for both.
    """

    PENDING = 0
    """registered, not on a copy queue (deferred waits for finish or budget) (initial, tag accepts_chunks)"""
    QUEUED = 1
    """on a copy queue (tag accepts_chunks, tag waits)"""
    COPYING = 2
    """exactly one thread owns the copy stage (tag waits)"""
    HOST_READY = 3
    """host rows ready; device clone dropped (tag waits)"""
    WRITTEN = 4
    """rows are in the CPU block pool (final)"""
    FAILED = 5
    """the committer could not finish; every later facade entry raises (final, tag failure)"""


TaskState.final_states = frozenset({TaskState.WRITTEN, TaskState.FAILED})
INITIAL = TaskState.PENDING


class WriteTaskTrigger(StrEnum):
    """Trigger names of the write_task spec."""

    ENQUEUE = "enqueue"
    """submit (immediate) or escalate (finish, abort, budget flush)"""
    CLAIM_COPY = "claim_copy"
    """the committer (or eager dispatch) wins the copy claim"""
    HOST_READY = "host_ready"
    """staging view landed, or deferred clone copied to host"""
    WRITTEN = "written"
    """pool write done and the completion record published"""
    FAIL = "fail"
    """copy or pool write failed; the wakes may wait until the failure record is published"""


WriteTaskTriggerName: TypeAlias = Literal["enqueue", "claim_copy", "host_ready", "written", "fail"]
