"""The model's invariants, each a checker over one world (or one move).

``SystemInvariants`` holds one checker per invariant the protocol declares
for the model (``invariants_for("model")``, matched by name when the model
is built); ``MachineInvariants`` the component machines' own invariants,
per state and per move. A checker raises ``Violation`` naming the
invariant and what breaks it.
"""

from __future__ import annotations

from collections.abc import Callable

from omni_prefix_cache.testing.modelcheck.facts import ModelFacts
from omni_prefix_cache.testing.modelcheck.world import IMM, STEP, TASK, Violation, World


class SystemInvariants:
    """The protocol's system invariants over a world (``checkers()``)."""

    def __init__(self, facts: ModelFacts):
        self.f = facts

    def checkers(self) -> dict[str, Callable[[World], None]]:
        """Each checker by its protocol invariant name."""
        return {
            "position_matches_task": self.position_matches_task,
            "one_queue_entry": self.one_queue_entry,
            "done_after_record": self.done_after_record,
            "staged_bytes": self.staged_bytes,
            "task_views_step_page": self.task_views_step_page,
            "copy_on_write": self.copy_on_write,
            "failure_is_sticky": self.failure_is_sticky,
            "save_waits_previous_writes": self.save_waits_previous_writes,
            "can_settle": lambda w: None,  # liveness: checked over the whole graph in check()
            "idle_writes_land": lambda w: None,  # liveness over the other threads' moves, in check() too
        }

    def position_matches_task(self, w: World) -> None:
        for tid, t in enumerate(w.tasks):
            if t.state not in self.f.pairs.get(t.position, ()):
                raise Violation(
                    "position_matches_task",
                    f"task {tid} is {self.f.T(t.state).name} at queue position {self.f.P(t.position).name}",
                )

    def one_queue_entry(self, w: World) -> None:
        queued = [*w.hi, *w.lo]
        if len(set(queued)) != len(queued):
            raise Violation("one_queue_entry", f"a task is queued twice: hi={list(w.hi)} lo={list(w.lo)}")
        for tid, t in enumerate(w.tasks):
            if (t.position in self.f.on_queue) != (tid in queued):
                raise Violation(
                    "one_queue_entry",
                    f"task {tid} at {self.f.P(t.position).name}, queues hi={list(w.hi)} lo={list(w.lo)}",
                )

    def done_after_record(self, w: World) -> None:
        for tid, t in enumerate(w.tasks):
            if t.done and tid not in w.completed and tid not in w.failed and not t.drained:
                raise Violation("done_after_record", f"task {tid} is done but no completion/failure record is public")

    def staged_bytes(self, w: World) -> None:
        live = sum(st.charged for st in w.steps if not st.freed)
        if w.staged != live or w.staged < 0:
            raise Violation("staged_bytes", f"budget counter {w.staged}, unfreed tickets charge {live}")
        for tid, t in enumerate(w.tasks):
            if t.clone:
                freed = [sid for sid in t.pins if w.steps[sid].freed]
                if freed:
                    raise Violation(
                        "staged_bytes",
                        f"task {tid} ({self.f.T(t.state).name}) still holds device clones of step {freed[0]}, "
                        "whose ticket is already uncharged",
                    )

    def task_views_step_page(self, w: World) -> None:
        for tid, t in enumerate(w.tasks):
            if t.holder == self.f.held:
                step = w.steps[t.step]
                if step.holder == self.f.held and t.page != step.page:
                    raise Violation(
                        "task_views_step_page", f"task {tid} holds page {t.page}, its step {t.step} page {step.page}"
                    )

    def copy_on_write(self, w: World) -> None:
        for r in w.reads:
            # A read whose row was rejected is not preserved on purpose: it fails (rejected_never_served).
            stale = w.slots[r.slot].version != r.version and not r.preserved and not r.rejected
            if r.state not in self.f.read_final and stale:
                raise Violation(
                    "copy_on_write",
                    f"a planned read of {self.f.cell(r.slot)} (version {r.version}) lost its rows: it is now "
                    f"version {w.slots[r.slot].version} and nothing was preserved",
                )

    def failure_is_sticky(self, w: World) -> None:
        if w.failures_drained and not w.sticky:
            raise Violation("failure_is_sticky", "a failure was drained but later facade entries would not raise")

    def save_waits_previous_writes(self, w: World) -> None:
        for sid, st in enumerate(w.steps):
            if st.state == self.f.UNSAVED:
                continue
            for tid, t in enumerate(w.tasks):
                if t.sched == IMM and 0 <= t.step < sid and not t.done:
                    raise Violation(
                        "save_waits_previous_writes",
                        f"step {sid} was saved while the immediate write task {tid} of step {t.step} is not done",
                    )


class MachineInvariants:
    """The component machines' invariants: per state (``check_state``) and
    per move (``check_move``)."""

    def __init__(self, facts: ModelFacts):
        self.f = facts

    def check_state(self, w: World) -> None:
        """Raise Violation for the first machine invariant ``w`` breaks."""
        T = self.f.T
        for tid, t in enumerate(w.tasks):
            name = T(t.state).name
            if not t.owed:
                for event, (always, sometimes) in self.f.events.items():
                    is_set = getattr(t, event)
                    if (t.state in always and not is_set) or (t.state not in sometimes and is_set):
                        raise Violation("write_task.events_match_state", f"task {tid} in {name} has {event}={is_set}")
            if t.claims > 1 or (t.state in self.f.claimed and t.claims != 1):
                raise Violation("write_task.single_copy_claim", f"task {tid} in {name} has {t.claims} copy claims")
            # A fail in progress (wakes owed) releases the holder in its next segment.
            if t.holder == self.f.held and t.state in self.f.task_final and not t.owed:
                raise Violation("staging_holder.task_holder_has_live_task", f"task {tid} is {name} and holds a page")
        for slot, s in enumerate(w.slots):
            if (s.owner >= 0) != (s.state == self.f.IN_TRANSIT):
                raise Violation(
                    "slot_occupancy.owner_iff_in_transit",
                    f"{self.f.cell(slot)} is {self.f.Occ(s.state).name}, owner {s.owner}",
                )
            if s.stale and s.state != self.f.ABSENT:
                raise Violation(
                    "slot_occupancy.tenant_owns_all_keys",
                    f"{self.f.cell(slot)} is {self.f.Occ(s.state).name} with rows of the slot's previous tenant",
                )
            if s.owner >= 0:
                owner = w.tasks[s.owner]
                if owner.drained or slot in owner.reassigned:
                    raise Violation(
                        "slot_occupancy.owner_is_live_task",
                        f"{self.f.cell(slot)} is owned by task {s.owner}, which is drained or reassigned",
                    )
        held: list[set[tuple[int, int]]] = [set() for _ in w.pages]
        for sid, st in enumerate(w.steps):
            if (st.state == self.f.SAVED) and st.holder != self.f.held:
                raise Violation(
                    "step_context.one_holder_per_saved_step",
                    f"step {sid} is {self.f.S(st.state).name} with holder {self.f.H(st.holder).name}",
                )
            if st.holder == self.f.held:
                held[st.page].add((STEP, sid))
        for tid, t in enumerate(w.tasks):
            if t.holder == self.f.held:
                held[t.page].add((TASK, tid))
        for p, busy in enumerate(w.pages):
            if set(busy) != held[p]:
                raise Violation(
                    "staging_holder.free_iff_no_holder", f"page {p} busy set {sorted(busy)}, holders {sorted(held[p])}"
                )
            if sum(1 for k, _ in busy if k == STEP) > 1:
                raise Violation("staging_holder.one_step_holder_per_page", f"page {p} has two step holders")

    def check_move(self, before: World, after: World) -> None:
        """Per-move invariants: versions only grow, by one per reuse."""
        if before.slots == after.slots:
            return
        for slot, (a, b) in enumerate(zip(before.slots, after.slots, strict=True)):
            if a is b:
                continue
            if b.version < a.version or b.version > a.version + 1:
                raise Violation(
                    "slot_occupancy.version_monotonic", f"{self.f.cell(slot)} version {a.version} -> {b.version}"
                )
            if b.version == a.version + 1 and a.state != self.f.COMMITTED:
                raise Violation(
                    "slot_occupancy.version_monotonic", f"{self.f.cell(slot)} bumped from {self.f.Occ(a.state).name}"
                )
