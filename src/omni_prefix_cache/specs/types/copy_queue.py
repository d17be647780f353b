# Generated from spec/copy_queue.yaml by `make typed-specs`; do not edit.
"""Typed names of the ``copy_queue`` spec: the ``QueuePosition`` states and the ``CopyQueueTrigger`` triggers."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeAlias

from omni_prefix_cache.specs.compiled import SpecState

SPEC_NAME = "copy_queue"


class QueuePosition(SpecState):
    """
    UNQUEUED -> HIGH | LOW -> CLAIMED -> BLOCKED -> DONE. An escalate promotes LOW to HIGH; a failure takes the
    task out (a queue entry is left STALE and dropped at its pop). Eager dispatch runs a task inline without
    queueing it (UNQUEUED -> INLINE -> DONE).
    """

    UNQUEUED = 0
    """registered, on no queue (deferred and not escalated, or queued but not yet dispatched) (initial)"""
    HIGH = 1
    """on the high-priority copy queue (steps' immediate writes, escalated writes) (tag waits)"""
    LOW = 2
    """on the low-priority copy queue (deferred writes submitted queued) (tag waits)"""
    CLAIMED = 3
    """popped by the committer, which owns the copy stage (tag waits)"""
    BLOCKED = 4
    """host rows ready, waiting for the committer's pool write (tag waits)"""
    INLINE = 5
    """claimed by an eager dispatch, which runs its copy and pool write on the calling thread"""
    STALE = 6
    """the task failed while queued; its entry stays on the queue until popped"""
    DONE = 7
    """out of the pipeline (written, failed, or run inline) (final)"""


QueuePosition.final_states = frozenset({QueuePosition.DONE})
INITIAL = QueuePosition.UNQUEUED


class CopyQueueTrigger(StrEnum):
    """Trigger names of the copy_queue spec."""

    PUSH = "push"
    """dispatch of an immediate write (tail of the high queue)"""
    PUSH_LOW = "push_low"
    """dispatch of a deferred write submitted queued (tail of the low queue)"""
    PUSH_HEAD = "push_head"
    """escalate of a pending write (head of the high queue)"""
    PROMOTE = "promote"
    """escalate moves a low-queued write to the head of the high queue"""
    CLAIM = "claim"
    """the committer pops the task (high first) and claims its copy in the same critical section"""
    COPIED = "copied"
    """the copy stage finished; the task waits for its pool write"""
    WRITTEN = "written"
    """the pool write finished"""
    SKIP = "skip"
    """the committer pops a failed task's entry and drops it"""
    INLINE = "inline"
    """eager dispatch claimed the task to run it on the calling thread"""
    FAIL = "fail"
    """the task failed while queued"""


CopyQueueTriggerName: TypeAlias = Literal[
    "push",
    "push_low",
    "push_head",
    "promote",
    "claim",
    "copied",
    "written",
    "skip",
    "inline",
    "fail",
]
