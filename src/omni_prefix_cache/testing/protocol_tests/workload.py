"""The protocol tests' workload: sizes, keys, prompts, and the tables that
bind the spec's operations to driver rules and its invariants to checkers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omni_prefix_cache.interface import HIDDEN_KEY
from omni_prefix_cache.testing.serving_model import PlannedStep

NUM_BLOCKS, BLOCK_SIZE, CAPACITY, DEPTH = 8, 2, 12, 3
IMMEDIATE, DEFERRED, LEFTOVER = "talker.h", "codes.audio", "codes.ref"
# A pool key only ``submit_queued`` writes (outside the row oracle's keys).
SIDE_KEY = "side.queued"
WIDTHS = {HIDDEN_KEY: 4, IMMEDIATE: 3, DEFERRED: 2}
PREFIXES = [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
MAX_REQUESTS = 6
# Where a task's queue entry is, by its copy_queue position (one_queue_entry).
ENTRY_OF: dict[str, tuple[str, ...]] = {
    "HIGH": ("high",),
    "LOW": ("low",),
    "STALE": ("high", "low"),
    "CLAIMED": ("claimed",),
    "BLOCKED": ("blocked",),
}

# Operation -> the rule that starts it. Several operations may share a rule
# (an eager save runs eager_run inline; a facade entry drains). "teardown"
# is the end of every run.
DRIVERS: dict[str, str] = {
    "new_step": "new_step",
    "save": "save",
    "abandon_save": "save",  # a save whose budget flush joins a failed write is abandoned
    "escalate": "finish_or_abort",  # escalated at the facade entry announcing the finish
    "committer_claim": "committer_claim",
    # The manual committer moves only when a rule steps it: its claim rule stands for every wake, the
    # linger's included (the threaded committer's timed wait is tests/test_committer_idle.py's).
    "linger": "committer_claim",
    "committer_copy": "committer_copy",
    "committer_write": "committer_write",
    "eager_run": "save",  # eager: save, escalate and a budget flush run each write inline
    "fail": "inject_failure",  # an injected copy or pool-write failure of a live or next task
    "join": "join",  # also inside save (barrier, budget flush) and a prefetch of a queued write
    "drain": "drain",  # every facade entry drains; this rule is an entry with nothing scheduled
    "prefetch": "prefetch_run",  # the prefetch thread, run by hand (paused, resumed, raced)
    "materialize": "materialize",  # possibly lagged: steps wait in a bundle
    "discard": "discard",
    "shutdown": "teardown",
    # The request lifecycle: every step's events run request_event; a
    # replacement retires the old tenure and its consumers' watermarks; the
    # talker takes each output inside materialize, the client in its rule.
    "request_event": "new_step",
    "retire_owner": "replace",
    "retire_delivery": "replace",
    "delivery_view": "client",
    "ack_delivery": "client",
    "commit_output": "client",
}

# Rules for the engine's workload, not protocol operations.
WORKLOAD_RULES = (
    "preempt",
    "interim_tenant",
    "prefetch_run",
    "prefetch_pause",
    "prefetch_resume",
    "paused_reader_slots_reused",
    "submit_queued",
    "resume",
    "reuse_id",
    "stale_events",
    "replay_step",
    "optimistic_resume",
)

# Invariant name (spec/protocol.yaml, checked_by tests) -> checker method.
CHECKERS: dict[str, str] = {
    "position_matches_task": "position_matches_task",
    "one_queue_entry": "one_queue_entry",
    "done_after_record": "done_after_record",
    "staged_bytes": "staged_bytes",
    "task_views_step_page": "task_views_step_page",
    "copy_on_write": "copy_on_write",
    "failure_is_sticky": "failure_is_sticky",
    "save_waits_previous_writes": "save_waits_previous_writes",
    "queue_by_priority": "queue_by_priority",
    "committer_never_raises": "committer_never_raises",
    "no_join_under_state_lock": "no_join_under_state_lock",
    "rows_match_reference": "rows_match_reference",
    "delivered_within_saved": "delivered_within_saved",
    "at_most_once_in_order": "at_most_once_in_order",
    "gap_raises": "gap_raises",
    "old_owner_never_moves_current": "old_owner_never_moves_current",
    "discard_is_not_delivery": "discard_is_not_delivery",
    "resumed_hit_recovers": "resumed_hit_recovers",
    "accepted_rows_only": "accepted_rows_only",
}


@dataclass
class Sched:
    """A scheduler output with nothing scheduled (a facade entry)."""

    scheduled_new_reqs: list[Any]
    finished_req_ids: set[str]
    num_scheduled_tokens: dict[str, int]


@dataclass
class Served:
    """A materialized step's outputs, to check against the row oracle."""

    sid: int
    outs: Any
    planned: PlannedStep
    absent: frozenset[str]


def leftover_rows(n: int) -> torch.Tensor:
    """The leftover tensor a step passes through unchanged."""
    return torch.arange((n + 3) * 2, dtype=torch.float32).reshape(n + 3, 2)


def sparse_rows(n: int, key: str) -> torch.Tensor:
    """A pool key passed as a leftover (first dim not the token count)."""
    return -torch.arange((n + 3) * WIDTHS[key], dtype=torch.float32).reshape(n + 3, WIDTHS[key])
