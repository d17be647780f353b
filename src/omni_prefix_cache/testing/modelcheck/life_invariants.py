"""The lifecycle model's invariants: per world, per action, per receipt.

``LifeInvariants`` holds one checker per system invariant the lifecycle
model answers for (``NAMES``), and the request_lifecycle and delivery
machines' own. Most are about an action, not a world: ``check_move(before,
after, label)`` sees which operation ran (and for whom) and what it
changed; ``receive`` checks the rows a consumer took (an acknowledged view,
or a commit's handoff) against what it took before. Each raises
``Violation`` naming the invariant.
"""

from __future__ import annotations

from omni_prefix_cache.testing.modelcheck.life_binding import LifeBinding
from omni_prefix_cache.testing.modelcheck.life_world import RESUMED, LLabel, LWorld, Ten, older
from omni_prefix_cache.testing.modelcheck.world import Violation

# Operations that deliver: only their acknowledgements move a watermark.
DELIVERING = frozenset({"ack_delivery", "commit_output"})
CONSUMER_OPS = frozenset({"delivery_view", "ack_delivery", "commit_output"})


class LifeInvariants:
    """The lifecycle's invariants over ``LWorld``s (``binding``: state numbers)."""

    # The protocol invariants this model checks (the write path's are ``SystemInvariants``').
    NAMES = (
        "delivered_within_saved",
        "at_most_once_in_order",
        "gap_raises",
        "old_owner_never_moves_current",
        "discard_is_not_delivery",
        "resumed_hit_recovers",
        "accepted_rows_only",
        "can_settle",
    )

    def __init__(self, binding: LifeBinding):
        self.b = binding

    # ----------------------------------------------------------- per world
    def check_state(self, w: LWorld) -> None:
        for t, ten in enumerate(w.tenures):
            if max(ten.marks) > max(ten.saved, ten.served):
                raise Violation(
                    "delivered_within_saved",
                    f"tenure {t} delivered up to {max(ten.marks)} but saved {ten.saved} and served {ten.served}",
                )
            bound = max(ten.verified, ten.served)
            if max(ten.saved, ten.computed, *ten.marks) > bound:
                raise Violation(
                    "accepted_rows_only",
                    f"tenure {t} counts positions no forward verified: computed {ten.computed}, saved {ten.saved}, "
                    f"delivered {list(ten.marks)}, but only [0, {bound}) are the target's rows",
                )
        active = [t for t, ten in enumerate(w.tenures) if ten.state in self.b.active]
        if len(active) > 1:
            raise Violation("request_lifecycle.one_current_tenure", f"tenures {active} are all ADMITTED or RUNNING")
        owners = [ten.owner for ten in w.tenures]
        if owners != sorted(owners) or len(set(owners)) != len(owners):
            raise Violation("request_lifecycle.monotonic_owner", f"tenures opened in owner order {owners}")

    # ---------------------------------------------------------- per action
    def check_move(self, a: LWorld, b: LWorld, label: LLabel) -> None:
        op, _, _, (sid, k, o), raised = label
        moved = [
            (t, i)
            for t, ten in enumerate(a.tenures)
            for i, (x, y) in enumerate(zip(ten.marks, b.tenures[t].marks, strict=True))
            if x != y
        ]
        for t, i in moved:
            if b.tenures[t].marks[i] < a.tenures[t].marks[i]:
                raise Violation("delivery.watermark_monotonic", f"tenure {t} consumer {i}'s watermark went back")
        if moved and op not in DELIVERING:
            t, i = moved[0]
            raise Violation(
                "discard_is_not_delivery",
                f"{op} moved consumer {i}'s watermark of tenure {t} "
                f"{a.tenures[t].marks[i]} -> {b.tenures[t].marks[i]}; only an acknowledgement delivers",
            )
        if moved and raised:
            raise Violation("gap_raises", f"{op} raised{raised} and still moved watermarks {moved}")
        if op == "delivery_view" and not raised:
            out = a.outputs[o]
            seen = a.tenures[out.tenure].marks[k]
            # A retired tenure's view selects nothing (commit filters it): no gap to raise.
            retired = a.tenures[out.tenure].state == self.b.RETIRED
            if out.start > seen and out.end > seen and not retired:
                raise Violation(
                    "gap_raises",
                    f"a view for consumer {k} of [{out.start}, {out.end}) of tenure {out.tenure} did not raise; "
                    f"its watermark is {seen}: positions [{seen}, {out.start}) would be skipped",
                )
        if op in DELIVERING and not raised and k >= 0:
            view = a.views[k]
            if view is not None:
                t = a.outputs[view.output].tenure
                seen = a.tenures[t].marks[k]
                if view.start > seen and view.end > seen and view.end > view.start:
                    raise Violation(
                        "delivery.no_gap_crossed",
                        f"{op} of [{view.start}, {view.end}) for consumer {k} passed its watermark {seen}",
                    )
        self._old_owner(a, b, label)
        if op == "materialize" and len(b.outputs) > len(a.outputs):
            self._resumed(a, b, sid)
            st, out = a.steps[sid], b.outputs[-1]
            if out.end > st.accepted_end:
                raise Violation(
                    "accepted_rows_only",
                    f"materialize of step {sid} returns [{out.start}, {out.end}) of tenure {out.tenure}; its drafts "
                    f"were {st.drafts}, {st.accepted} accepted: rows past {st.accepted_end} are rejected drafts",
                )

    def _old_owner(self, a: LWorld, b: LWorld, label: LLabel) -> None:
        op, _, _, (sid, k, o), _ = label
        cur = a.current
        if cur < 0:
            return
        actor = ""
        if op == "new_step" and sid >= 0:
            event = a.steps[sid].event if sid < len(a.steps) else b.steps[sid].event
            if event is not None and older(event.owner, a.tenures[cur].owner):
                actor = f"an event of older owner {event.owner}"
        elif op in CONSUMER_OPS and o >= 0 and a.outputs[o].tenure != cur:
            actor = f"{op} of consumer {k} for tenure {a.outputs[o].tenure}"
        if actor and (b.current != cur or b.tenures[cur] != a.tenures[cur]):
            raise Violation(
                "old_owner_never_moves_current",
                f"{actor} moved the current tenure {cur} (owner {a.tenures[cur].owner}): "
                f"{self._describe(a, cur)} -> {self._describe(b, cur)}; current {cur} -> {b.current}",
            )

    def _describe(self, w: LWorld, t: int) -> str:
        ten = w.tenures[t]
        return f"{self.b.m['request'].State(ten.state).name} computed {ten.computed} marks {list(ten.marks)}"

    def _resumed(self, a: LWorld, b: LWorld, sid: int) -> None:
        st = a.steps[sid]
        out = b.outputs[-1]
        if st.event is None or st.event.kind != RESUMED or st.resume_low < 0:
            return
        if out.start > st.resume_low:
            raise Violation(
                "resumed_hit_recovers",
                f"the resumed step {sid} (hit {st.event.hit_end}) delivers [{out.start}, {out.end}) of tenure "
                f"{out.tenure}; the slowest consumer was at {st.resume_low}: positions [{st.resume_low}, "
                f"{out.start}) are lost",
            )

    def handed(self, tenures: list[Ten], current: int, handed: list[int]) -> None:
        """A commit hands off only the id's current (or finished) tenure:
        a retired owner's rows never reach a consumer beside the new one's."""
        for t in handed:
            if tenures[t].state == self.b.RETIRED or current not in (-1, t):
                raise Violation(
                    "old_owner_never_moves_current",
                    f"commit_output handed off tenure {t} (owner {tenures[t].owner}, "
                    f"{self.b.m['request'].State(tenures[t].state).name}); the id's current tenure is {current}",
                )

    # -------------------------------------------------------- per receipt
    @staticmethod
    def receive(got: int, t: int, k: int, start: int, end: int) -> int:
        """What consumer ``k`` has received of tenure ``t`` after taking
        rows ``[start, end)`` (it had ``got``); raise Violation for a
        repeated or skipped position."""
        if start >= end:
            return got
        if start < got:
            raise Violation(
                "at_most_once_in_order",
                f"consumer {k} received [{start}, {end}) of tenure {t}, having received [0, {got}) already",
            )
        if start > got:
            raise Violation(
                "gap_raises",
                f"consumer {k} received [{start}, {end}) of tenure {t} with only [0, {got}) before: "
                f"[{got}, {start}) skipped without a raise",
            )
        return end
