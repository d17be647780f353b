"""The event API's side of the engine loop (``SimConfig.api == "events"``).

Engine thread: the scheduler adapter turns each step's scheduler output into
a ``PrefixCacheStep`` for ``new_step_starts``, and builds the step's write
layout over the simulated group view for ``save_outputs``. After the
scheduler applied a step, finished tenures are noted for the oracle, and a
step chosen for discard rolls its requests back (they are preempted and
resume, and their hit recovers what no consumer received); a step in which a
request finished is never discarded, since nothing would deliver its last rows.

Consumer side (inline, or the lagging materialize thread): two consumers
take every materialized output.

- ``builder``, the output builder: every step, ``delivery_view`` then
  ``commit_output`` (which filters retired owners and acknowledges the live
  ones). A tenure a commit filtered is retired for good, so the builder
  leaves it out of its later views.
- ``local``, a second local consumer that lags: it queues outputs and, every
  ``local_ack_every`` outputs, views and acknowledges (``ack_delivery``) the
  queue in order; now and then it drops a view unacknowledged and stops,
  so those positions are delivered by its next drain.

The oracle (``DeliveryOracle``) checks every output and view.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from omni_prefix_cache.adapter import PrefixCacheSchedulerAdapter
from omni_prefix_cache.interface import StageCacheOutputs, output_progress
from omni_prefix_cache.tools.simulate.delivery_oracle import CONSUMERS, DeliveryOracle, EventExpectation
from omni_prefix_cache.tools.simulate.request import Status
from omni_prefix_cache.tools.simulate.scheduler import StepPlan

BUILDER, LOCAL = CONSUMERS

_Queued = tuple[int, int, list[EventExpectation], StageCacheOutputs]


class EventDriver:
    """Adapter, write layouts and the two consumers of one simulation run."""

    def __init__(self, oracle: DeliveryOracle, *, seed: int, local_ack_every: int, local_drop_prob: float) -> None:
        self.adapter = PrefixCacheSchedulerAdapter()
        self.oracle = oracle
        self._scheduled: dict[str, int] = {}
        self._local: deque[_Queued] = deque()
        self._local_every = max(1, local_ack_every)
        self._drop_prob = local_drop_prob
        self._rng = random.Random(seed ^ 0xD311)  # consumer side only: its draws follow the step order
        self._retired: dict[int, Any] = {}  # id -> tenure a builder commit filtered (held: ids stay unique)
        self._materialized = 0
        self.handoffs = 0

    # ------------------------------------------------------- engine thread

    def new_step(self, mgr: Any, scheduler_output: Any) -> None:
        step = self.adapter.translate_step(scheduler_output)
        self._scheduled = dict(step.scheduled_tokens)
        mgr.new_step_starts(step)

    def save(self, mgr: Any, view: Any, hidden: Any, mm: dict[str, Any], n: int, padded: int) -> int:
        layout = self.adapter.build_write_layout(view, num_scheduled_tokens=self._scheduled)
        step_id: int = mgr.save_outputs(
            hidden, mm, num_tokens_unpadded=n, num_tokens_padded=padded, write_layout=layout
        )
        return step_id

    def expectations(self, order: list[str], plan: StepPlan[Any]) -> list[EventExpectation]:
        by_id = {e.req.req_id: e for e in plan.entries}
        # With speculative drafts the rows end at the accepted end (the rejected drafts' rows never return).
        return [
            self.oracle.expect(by_id[r].req, by_id[r].start, by_id[r].accepted_end, by_id[r].resumed) for r in order
        ]

    def after_update(self, sched: Any, plan: StepPlan[Any], exps: list[EventExpectation], discard: bool) -> bool:
        """Note the step's finishes; roll a discarded step's requests back.
        Returns whether the step is discarded."""
        done = [e.req for e in plan.entries if getattr(e.req, "status", None) is Status.DONE]
        for req in done:
            if not getattr(req, "aborted", False):
                self.oracle.finished(req)
        if discard and not done:
            self.oracle.note_discard(exps)
            sched.rollback([e.req for e in plan.entries])
            return True
        return False

    # ------------------------------------------------------- consumer side

    def deliver(
        self, mgr: Any, step: int, step_id: int, exps: list[EventExpectation], outs: Any, leftover: dict[str, Any]
    ) -> None:
        """Check a materialized output, then hand it to both consumers."""
        oracle = self.oracle
        oracle.check_output(step, step_id, exps, outs, leftover)
        progress = output_progress(outs)
        keep = [e for e in exps if id(progress.get(e.req_id)) not in self._retired]
        view = mgr.delivery_view(outs, [e.req_id for e in keep], consumer=BUILDER)
        oracle.check_view(step, step_id, BUILDER, keep, outs, view)
        live = mgr.commit_output(outs, self._handoff, delivery=view)
        for e in exps:
            if e.req_id not in live:
                tenure = progress.get(e.req_id)
                self._retired[id(tenure)] = tenure
        oracle.delivered(BUILDER, exps, view, live)
        self._local.append((step, step_id, exps, outs))
        self._materialized += 1
        if self._materialized % self._local_every == 0:
            self.drain_local(mgr, may_drop=True)

    def _handoff(self, live: frozenset[str]) -> None:
        self.handoffs += 1  # publishes prepared payloads only (commit_output's contract)

    def drain_local(self, mgr: Any, *, may_drop: bool) -> None:
        """The local consumer views and acknowledges its queued outputs in order."""
        while self._local:
            step, step_id, exps, outs = self._local[0]
            view = mgr.delivery_view(outs, [e.req_id for e in exps], consumer=LOCAL)
            self.oracle.check_view(step, step_id, LOCAL, exps, outs, view)
            if may_drop and self._rng.random() < self._drop_prob:
                self.oracle.view_dropped()  # never acknowledged: the next drain gets the same positions
                return
            mgr.ack_delivery(view)
            self.oracle.delivered(LOCAL, exps, view, None)
            self._local.popleft()
