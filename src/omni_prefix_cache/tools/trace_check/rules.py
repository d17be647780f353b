"""The system invariants of spec/protocol.yaml that a trace can judge, one
checker per name, fed by the replay (``replay.Replay``) as it goes.

A trace holds moves, segments, effects, waits and facade calls, not bytes
or rows, so ``staged_bytes``, ``copy_on_write`` (a read's slots are not
recorded), ``rows_match_reference``, ``can_settle`` (model only) and the
lock-held invariants of the manager's own state lock are reported as not
judged. A checker refers to machines through the composition's roles
(``task``, ``position``, ``task_holder``, ``step_holder``, ``step``) and to
the protocol's effects by their spec names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from omni_prefix_cache.interface import OmniPrefixCacheWriteFailedError
from omni_prefix_cache.tools.trace_check.specview import SpecView

# Judged here, by name (each must be an invariant of the composition).
JUDGED = (
    "position_matches_task",
    "one_queue_entry",
    "done_after_record",
    "task_views_step_page",
    "failure_is_sticky",
    "save_waits_previous_writes",
    "queue_by_priority",
    "at_most_once_in_order",
    "gap_raises",
)
# Facade calls that raise once a write failure is sticky (discard and
# shutdown still work after one: docs/protocol.md, failure_is_sticky).
STICKY_CALLS = frozenset({"new_step_starts", "save_outputs", "materialize"})
_STICKY_ERROR = OmniPrefixCacheWriteFailedError.__name__


@dataclass(frozen=True)
class Violation:
    """The first rule a trace breaks: its name, what happened, the index of
    the record (in file order, header excluded) and the instances involved
    (``(machine or role, id)``) for the excerpt."""

    rule: str
    message: str
    index: int
    about: list[tuple[str, Any]]


class Stop(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.message)
        self.violation = violation


def inst_key(iid: Any, for_each: str | None) -> Any:
    """The instance of a ``for_each`` operation that machine instance ``iid``
    belongs to: a task's tid names its task and its position; a holder
    ``(kind, owner)`` of kind ``for_each`` (any kind, for an operation
    without ``for_each``) names its owner."""
    if isinstance(iid, tuple):
        if len(iid) != 2:
            return None
        # An operation with no for_each (save's parts) moves its batch's tasks.
        return iid[1] if for_each is None or iid[0] == for_each else None
    return iid


class ReplayState(Protocol):
    """What the checkers read of the replay (``replay.Replay``)."""

    view: SpecView
    state: dict[tuple[str, Any], int]
    index: int

    def fail(self, rule: str, message: str, about: list[tuple[str, Any]] | None = None) -> Stop: ...

    def open_elsewhere(self, inst: Any, thread: str) -> bool: ...


class Invariants:
    """Checkers of the invariants in ``JUDGED`` (and the settled end)."""

    def __init__(self, replay: ReplayState) -> None:
        self.replay = replay
        view = replay.view
        self.machine = view.role_machine
        self.pairs = {pos: frozenset(tasks) for pos, tasks in view.protocol.pairs.items()}
        self.state_names = {name: (tuple(s.name for s in m.State), int(m.initial)) for name, m in view.machines.items()}
        self.moves = self.row_moves = self.segments = 0
        self.published: set[Any] = set()  # tids whose completion or failure record is public
        self.bound: dict[Any, Any] = {}  # task -> the call whose save bound its holder (immediate writes)
        self.page_of: dict[Any, Any] = {}  # holder -> page
        self.sticky_at: int | None = None
        self.call_start: dict[Any, int] = {}  # call id -> the index of its call record
        self.early_wakes: set[tuple[Any, int]] = set()  # (tid, record) of wakes ahead of any record
        self.shut_down = False
        # Instances a helper thread moved last: it may still run after
        # shutdown returns (a prefetch finishing its read), so no settled check.
        self.helper_moved: set[tuple[str, Any]] = set()
        self.watermark: dict[Any, int] = {}  # delivery instance -> its replayed watermark

    def coverage(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        names = self.replay.view.invariants
        return tuple(n for n in names if n in JUDGED), tuple(n for n in names if n not in JUDGED)

    def _state(self, role: str, iid: Any) -> str:
        name = self.machine[role]
        names, initial = self.state_names[name]
        return names[self.replay.state.get((name, iid), initial)]

    # -------------------------------------------------------- hooks

    def on_move(self, rec: dict[str, Any], name: str, iid: Any, src: int, dest: int, move: Any) -> None:
        self.moves += 1
        if "call" in rec or "run" in rec:
            self.helper_moved.discard((name, iid))
        else:  # a helper thread (a prefetch) moved it, outside any call or segment
            self.helper_moved.add((name, iid))
        fail = self.replay.fail
        trigger = rec["tr"]
        if name == self.machine["task"] and move.dest.is_terminal:
            self.bound.pop(iid, None)  # done: no later save waits for it
        if name == self.machine["task"] and "set_done" in move.spec.effects:
            deferred = rec.get("x") is True and "set_done" in move.spec.deferrable
            if not deferred and iid not in self.published:
                raise fail(
                    "done_after_record",
                    f"task {iid}: {trigger} sets done before its completion or failure record is published",
                    [("task", iid)],
                )
        elif name == self.machine["task_holder"]:
            page = rec.get("x")
            if int(dest) != int(src) and move.dest in self.replay.view.machines[name].tagged("holds_page"):
                self.page_of[iid] = page
                if isinstance(iid, tuple) and iid[0] == "task":
                    self.bound[iid[1]] = rec.get("call")
                    steps = [
                        h for h, p in self.page_of.items() if p == page and isinstance(h, tuple) and h[0] == "step"
                    ]
                    if not steps:
                        raise fail(
                            "task_views_step_page",
                            f"task {iid[1]}: its holder bound page {page}, which no step holds",
                            [("task", iid[1]), (name, iid)],
                        )
            elif move.dest.is_terminal:
                self.page_of.pop(iid, None)
        elif name == self.machine["position"] and src == int(self.replay.view.machines[name].initial):
            immediate = iid in self.bound
            if trigger == "push" and not immediate or trigger == "push_low" and immediate:
                raise fail(
                    "queue_by_priority",
                    f"task {iid}: {trigger} for a {'n immediate' if immediate else ' deferred'} write",
                    [("task", iid)],
                )
        elif name == self.machine["delivery"] and trigger == "ack":
            self._delivered(rec, name, iid)
        elif name == self.machine["step"] and trigger == "save":
            call = rec.get("call")
            open_tasks = [t for t, c in self.bound.items() if c != call]  # bound holds unfinished tasks only
            if open_tasks:
                raise fail(
                    "save_waits_previous_writes",
                    f"step {iid}: save mapped its slots while earlier immediate writes {open_tasks[:8]} were not done",
                    [("task", t) for t in open_tasks[:4]] + [(name, iid)],
                )

    def _delivered(self, rec: dict[str, Any], name: str, iid: Any) -> None:
        """An acknowledgement of ``[start, end)`` (the move's detail) by one
        (tenure, consumer): a non-empty one must start exactly at the
        watermark the replay holds (earlier: positions delivered twice;
        later: a gap crossed), and moves it to ``end``."""
        span = rec.get("x")
        if not isinstance(span, list) or len(span) != 2:
            return
        start, end = int(span[0]), int(span[1])
        mark = self.watermark.get(iid, 0)
        if end <= start:
            return
        if start < mark:
            raise self.replay.fail(
                "at_most_once_in_order",
                f"delivery {iid}: acknowledged [{start}, {end}) but positions up to {mark} were delivered already",
                [(name, iid)],
            )
        if start > mark:
            raise self.replay.fail(
                "gap_raises",
                f"delivery {iid}: acknowledged [{start}, {end}) past its watermark {mark}: [{mark}, {start}) skipped",
                [(name, iid)],
            )
        self.watermark[iid] = end

    def on_rows(self, rec: dict[str, Any], move: Any) -> None:
        self.row_moves += 1

    def on_effect(self, rec: dict[str, Any], iids: list[Any]) -> None:
        name = rec["name"]
        if name in ("publish_completed", "publish_failed"):
            self.published.update(iids)
        elif name == "wake_failed":
            # A record published later is the ordering rule failure_record_before_wakes's
            # to report (at the publish); one never published is judged at the end.
            self.early_wakes.update((i, self.replay.index) for i in iids if i not in self.published)

    def on_segment_end(self, rec: dict[str, Any], op: str, insts: list[Any], thread: str) -> None:
        if self.replay.view.for_each.get(op) != "task":
            return
        for tid in insts:
            if self.replay.open_elsewhere(tid, thread):
                continue  # mid-segment on another thread: not a state between segments
            pos, task = self._state("position", tid), self._state("task", tid)
            if task not in self.pairs.get(pos, frozenset()):
                raise self.replay.fail(
                    "position_matches_task",
                    f"task {tid}: after {op} segment {rec.get('seg')} its position {pos} pairs with {task}, "
                    f"which the spec's pairs do not list (position {pos} pairs with {sorted(self.pairs.get(pos, ()))})",
                    [("task", tid)],
                )

    def on_call(self, rec: dict[str, Any]) -> None:
        self.call_start[rec.get("call")] = self.replay.index

    def on_ret(self, rec: dict[str, Any]) -> None:
        err = rec.get("err")
        f = rec.get("f")
        if err is not None and err[0] == _STICKY_ERROR and self.sticky_at is None:
            self.sticky_at = self.replay.index
            return
        # Only a call entered after the failure was raised must raise: one
        # already running on another thread (a lagged materialize) may not.
        entered = self.call_start.pop(rec.get("call"), -1)
        if self.sticky_at is not None and entered > self.sticky_at and f in STICKY_CALLS and err is None:
            raise self.replay.fail(
                "failure_is_sticky",
                f"{f} returned normally after a write failure was raised (record {self.sticky_at})",
                [("call", rec.get("call"))],
            )
        if f == "shutdown" and err is None:
            self.shut_down = True

    def on_close(self, rec: dict[str, Any]) -> None:
        """No failure wake without its record; after a clean shutdown every
        instance of a machine with final states is in one (or in a state
        its spec tags ``rest``: one shutdown does not move, as a request's)."""
        never = sorted((at, str(tid)) for tid, at in self.early_wakes if tid not in self.published)
        if never:
            at, tid = never[0]
            raise self.replay.fail(
                "done_after_record",
                f"task {tid}: its failure wakes ran (record {at + 1}) and no failure record was ever published",
                [("task", tid)],
            )
        if not self.shut_down:
            return
        view = self.replay.view
        for (name, iid), state in self.replay.state.items():
            if (name, iid) in self.helper_moved:
                continue
            machine = view.machines[name]
            settled = machine.final | machine.tagged("rest")
            if machine.final and machine.State(state) not in settled:
                raise self.replay.fail(
                    "settled_at_shutdown",
                    f"{name} {iid} is {machine.State(state).name} after shutdown returned "
                    f"(final states: {sorted(s.name for s in machine.final)})",
                    [(name, iid)],
                )
