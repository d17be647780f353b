"""The protocol tests' request-lifecycle drivers, a mixin of ``ProtocolMachine``.

They announce each step's events (``EventEngine``) and keep the tenure
oracle in step with what the manager was told; the client consumer's turn
(delivery_view, ack_delivery, commit_output); a replacement of a request's
content (REPLACED: retire_owner and retire_delivery), the reuse of a
finished request's id by a new admission, an older owner's events and a
replayed step sequence (both must move nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import event
from hypothesis import strategies as st

from omni_prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheStep
from omni_prefix_cache.interface import output_progress
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.testing.protocol_tests.consumers import ACTIONS, Desk, Output
from omni_prefix_cache.testing.protocol_tests.lifecycle import CONSUMERS, EventEngine, OracleTenure, TenureOracle
from omni_prefix_cache.testing.serving_model import PlannedStep, ServingModel

K = PrefixCacheEventKind
STALE_KINDS = (K.EXTENDED, K.STARTED, K.RESUMED, K.FINISHED, K.ABORTED, K.REPLACED)


def table_snapshot(mgr: OmniPrefixCacheManager) -> dict[str, tuple[Any, ...]]:
    """Every current tenure of the manager, by id, as a comparable tuple."""
    return {
        rid: (id(t), int(t.state), t.owner, t.computed_upto, t.saved_upto, dict(t.delivered_upto), t.lookup)
        for rid, t in mgr.components.requests.current.items()
    }


class LifecycleDrivers:
    """Request-lifecycle drivers over ``ProtocolMachine``'s runtime."""

    mgr: OmniPrefixCacheManager
    model: ServingModel
    engine: EventEngine
    oracle: TenureOracle
    desk: Desk
    dead: bool
    pending: PlannedStep | None
    violations: dict[str, list[str]]
    prefetch_errors: list[str]
    step_tenures: dict[int, dict[str, OracleTenure]]
    recovering: dict[str, int]
    recover_at: dict[int, dict[str, int]]
    _facade: Callable[..., Any]
    drive_new_step: Callable[..., int | None]

    def announce(self, step: PrefixCacheStep) -> dict[str, int]:
        """new_step_starts(step); the oracle applies the same events.
        Returns the hits' recovery starts (empty when the manager is dead)."""
        was_dead = self.dead
        self._facade(self.mgr.new_step_starts, step)
        if self.dead or was_dead:
            return {}
        hits = self.oracle.apply(step.events)
        current = self.mgr.components.requests.current
        for tenure in self.oracle.current.values():
            if tenure.runtime is None and not tenure.finished:
                runtime = current.get(tenure.rid)
                if runtime is not None and runtime.owner == tenure.owner:
                    tenure.runtime = runtime
        if hits:
            event("a step installed a lookup that serves rows")
        return hits

    def saved(self, sid: int, planned: PlannedStep) -> None:
        """A save's rows advance their tenures (the oracle's record_saved)."""
        tenures = {}
        for exp in planned.expects:
            tenure = tenures[exp.rid] = self.oracle.current[exp.rid]
            tenure.saved = max(tenure.saved, exp.end)
        self.step_tenures[sid] = tenures
        self.recover_at[sid], self.recovering = self.recovering, {}

    def delivered(self, sid: int, outs: Any, planned: PlannedStep, data: Any) -> None:
        """A materialized output: its tenures and recovered hits are
        checked, the talker takes it now, the client's inbox gets it."""
        tenures = self.step_tenures.pop(sid)
        recover = self.recover_at.pop(sid, {})
        out = Output(sid, outs, tenures, {e.rid: (e.start, e.end) for e in planned.expects})
        progress = output_progress(outs)
        for rid, tenure in tenures.items():
            if progress.get(rid) is not tenure.runtime:
                self.prefetch_errors.append(f"step {sid}: the output of {rid} is not tied to its tenure {tenure}")
        for rid, start in recover.items():
            got = outs.token_ranges.get(rid)
            if got is None or got[0] != start:
                self.violations["resumed_hit_recovers"].append(
                    f"step {sid}: resumed {rid} serves {got}, not from the lowest watermark {start}"
                )
            else:
                event("a resumed hit recovered positions a consumer had not received")
        if self.dead:
            return
        action = "ack" if data is None else data.draw(st.sampled_from(ACTIONS), label="talker")
        self.desk.take(out, CONSUMERS[0], action)
        inbox = self.desk.inbox
        inbox.append(out)
        if data is None:
            return
        # The client keeps up to a few outputs behind (its rule takes more, in any order).
        lag = data.draw(st.integers(0, 3), label="client lag")
        while len(inbox) > lag:
            self.desk.take(inbox.pop(0), CONSUMERS[1], data.draw(st.sampled_from(ACTIONS), label="client"))

    def drive_client(self, data: Any) -> None:
        """The lagging consumer takes an output from its inbox (mostly the
        oldest) and views, acknowledges, commits, drops or skips it."""
        inbox = self.desk.inbox
        index = 0 if data.draw(st.integers(0, 3), label="client order") else len(inbox) - 1
        out = inbox.pop(index)
        action = data.draw(st.sampled_from(ACTIONS), label="client")
        event(f"client {action}")
        self.desk.take(out, CONSUMERS[1], action)

    def drive_resume(self, data: Any) -> int | None:
        """A running request is preempted and scheduled again at once: it is
        RESUMED with the hit its blocks still give, which recovers what the
        slowest consumer has not received."""
        rid = data.draw(st.sampled_from(sorted(r.rid for r in self.model.running())), label="preempt")
        self.model.preempt(rid)
        sid: int | None = self.drive_new_step(data, admit_only=rid)
        return sid

    def drive_replace(self, data: Any) -> None:
        """A live request's content is replaced: REPLACED (a new generation
        of its owner) retires its tenure at the next step; its outputs not
        yet consumed are retired with it."""
        live = sorted(r.rid for r in self.model.requests.values() if r.live)
        rid = data.draw(st.sampled_from(live), label="replace")
        self.engine.replace(rid, data.draw(st.integers(0, 2), label="prefix"), [24])

    def drive_reuse_id(self, data: Any) -> None:
        """A new admission reuses the id of a request that ended."""
        rid = data.draw(st.sampled_from(self.reusable()), label="reuse")
        self.model.arrive(data.draw(st.integers(0, 2), label="prefix"), [22, 23], rid=rid)

    def reusable(self) -> list[str]:
        ids = set(self.engine.seen)
        return sorted(ids - set(self.model.requests))

    def drive_stale_events(self, data: Any) -> None:
        """An event of an older owner of a reused or replaced id: it moves nothing."""
        rid = data.draw(st.sampled_from(self.engine.stale_ids()), label="stale id")
        kind = data.draw(st.sampled_from(STALE_KINDS), label="stale kind")
        before = table_snapshot(self.mgr)
        marks_before = {id(t): dict(t.runtime.delivered_upto) for t in self.oracle.every if t.runtime is not None}
        if self._facade(self.mgr.new_step_starts, self.engine.stale(rid, kind)) is None and self.dead:
            return
        after = table_snapshot(self.mgr)
        if after != before:
            self.violations["old_owner_never_moves_current"].append(
                f"a {kind.name} event of an older owner of {rid} moved the request table: {before} -> {after}"
            )
        self.desk.unmoved(marks_before, "old_owner_never_moves_current", f"a stale {kind.name} of {rid}")

    def drive_replay_step(self) -> None:
        """The last step again, with its sequence: a replay applies nothing."""
        step = self.engine.last
        assert step is not None
        before = (table_snapshot(self.mgr), sorted(self.mgr.components.hits.pending))
        self._facade(self.mgr.new_step_starts, step)
        if self.dead:
            return
        after = (table_snapshot(self.mgr), sorted(self.mgr.components.hits.pending))
        if after != before:
            self.prefetch_errors.append(f"replayed step {step.sequence} moved the manager: {before} -> {after}")
