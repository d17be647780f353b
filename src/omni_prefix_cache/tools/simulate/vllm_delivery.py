"""Per-consumer delivery checks of ``simulate --engine vllm`` on the event API.

``DeliveryOracle`` follows, per request incarnation (one owner) and
consumer, the next position the consumer must receive. Every delivery view
a consumer acknowledges must start exactly there (nothing skipped, nothing
twice) and carry exactly the row function's rows; at the end, every
incarnation that finished (and was not fenced by a reuse of its id before
its last output was committed) must have reached every consumer up to its
last computed position. ``LaggingConsumer`` is the second, local consumer:
it views and acknowledges outputs in order but only in bursts, several
steps behind the output builder.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_prefix_cache.interface import StageCacheOutputs
from omni_prefix_cache.tools.simulate.oracle import Oracle, RowExpectation


@dataclass
class DeliveryCounts:
    """What the event-API run did, for the report (``VllmSimResult.events``)."""

    resumed: int = 0  # RESUMED events the adapter produced from resumed_req_ids
    resumed_with_hit: int = 0  # ... whose hit_end (vLLM's num_computed_tokens) was > 0
    resumed_unaligned: int = 0  # ... whose hit_end was not a multiple of the block size
    recovered: int = 0  # resumed outputs whose range started before the step's rows (cache recovery)
    recovered_positions: int = 0
    shrinking: int = 0  # resumed outputs whose step rows started below the builder's watermark (replayed)
    replayed_positions: int = 0  # recomputed positions not delivered again
    discard_preemptions: int = 0  # requests preempted because their step was discarded
    recovered_after_discard: int = 0  # ... whose later resume recovered positions from the cache
    fenced: int = 0  # request outputs commit_output filtered (the id's owner had changed)
    same_step_reuse_events: int = 0  # FINISHED and STARTED of one id in one step
    delivered: dict[str, int] = field(default_factory=dict)  # consumer -> positions
    max_consumer_lag: int = 0  # the lagging consumer's largest backlog, in steps


class DeliveryMismatch(AssertionError):
    """A consumer received a position twice, out of order, with wrong rows, or never."""


class DeliveryOracle:
    """Next expected position per (incarnation, consumer); row checks per key."""

    def __init__(self, widths: dict[str, int], dtype: Any, consumers: tuple[str, ...]) -> None:
        self.consumers = consumers
        self.rows = {c: Oracle(widths, dtype) for c in consumers}
        self.next: dict[tuple[int, str], int] = {}
        self.counts = DeliveryCounts(delivered=dict.fromkeys(consumers, 0))
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def expect(self, consumer: str, inc: int) -> int:
        with self._lock:
            return self.next.get((inc, consumer), 0)

    def delivered(
        self, consumer: str, step: int, view: StageCacheOutputs, reqs: Mapping[str, Any], live: frozenset[str]
    ) -> None:
        """Check the acknowledged part of ``view`` (its ``live`` requests):
        each range starts at the consumer's next position for the
        incarnation in ``reqs``, and its rows are the row function's."""
        exps: list[RowExpectation] = []
        for rid, (start, end) in view.token_ranges.items():
            if rid not in live:
                continue
            req = reqs[rid]
            key = (req.incarnation, consumer)
            with self._lock:
                want = self.next.get(key, 0)
                if end > start and start != want:
                    self._fail(
                        f"step {step}: {consumer} got {rid!r} #{req.incarnation} [{start}, {end}), expected {want}"
                    )
                elif end <= start and end > want:
                    self._fail(f"step {step}: {consumer} skipped {rid!r} #{req.incarnation} [{want}, {end})")
                if end > want:
                    self.next[key] = end
                    self.counts.delivered[consumer] += end - max(start, want)
            if end > start:
                exps.append(RowExpectation(rid, start, end, 0, req.hashes.span(start, end).clone()))
        self.rows[consumer].check(step, -1, exps, view)

    def check_complete(self, final: Mapping[int, tuple[str, int]], fenced: set[int]) -> None:
        """Every finished incarnation (``final``: incarnation -> (req id,
        last computed position)) reached every consumer up to that position;
        the output builder's consumer is exempt for ``fenced`` incarnations."""
        for inc, (rid, end) in final.items():
            for consumer in self.consumers:
                if inc in fenced and consumer == self.consumers[0]:
                    continue
                got = self.next.get((inc, consumer), 0)
                if got != end:
                    self._fail(f"{consumer} received {rid!r} #{inc} up to {got}, its last position is {end}")

    @property
    def mismatches(self) -> int:
        return len(self.errors) + sum(o.mismatches for o in self.rows.values())

    def details(self) -> list[str]:
        return self.errors[:10] + [str(m) for o in self.rows.values() for m in o.details[:10]]

    def _fail(self, message: str) -> None:
        self.errors.append(message)


# One unit of the lagging consumer's work: a materialized output and the incarnations it was saved for.
LagJob = tuple[int, StageCacheOutputs, dict[str, Any]]


class LaggingConsumer:
    """The second consumer: views and acknowledges every output in step
    order, in bursts of 1-6 steps (its own thread when ``threaded``).

    ``view``/``ack`` are the manager's ``delivery_view``/``ack_delivery``;
    a failure (a gap) is kept in ``error`` and stops the consumer."""

    def __init__(
        self,
        name: str,
        view: Callable[..., StageCacheOutputs],
        ack: Callable[[StageCacheOutputs], None],
        oracle: DeliveryOracle,
        seed: int,
        *,
        threaded: bool,
    ) -> None:
        self.name, self._view, self._ack, self.oracle = name, view, ack, oracle
        self._rng = random.Random(seed ^ 0x1A66)
        self._backlog: list[LagJob] = []
        self._burst = self._rng.randint(1, 6)
        self.error: BaseException | None = None
        self._jobs: queue.Queue[LagJob | None] | None = queue.Queue() if threaded else None
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="sim-lagging-consumer", daemon=True)
            self._thread.start()

    def put(self, job: LagJob) -> None:
        """Queue one output (the output builder's thread, in step order)."""
        if self._jobs is not None:
            self._jobs.put(job)
        else:
            self._take(job)

    def close(self) -> None:
        """Drain everything queued, then stop."""
        if self._jobs is not None and self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=30.0)
        else:
            self._drain()

    def _loop(self) -> None:
        assert self._jobs is not None
        while (job := self._jobs.get()) is not None:
            self._take(job)
        self._drain()

    def _take(self, job: LagJob) -> None:
        self._backlog.append(job)
        counts = self.oracle.counts
        counts.max_consumer_lag = max(counts.max_consumer_lag, len(self._backlog))
        if len(self._backlog) >= self._burst:
            self._drain()
            self._burst = self._rng.randint(1, 6)

    def _drain(self) -> None:
        backlog, self._backlog = self._backlog, []
        if self.error is not None:
            return
        try:
            for step, outputs, reqs in backlog:
                view = self._view(outputs, list(outputs.token_ranges), consumer=self.name)
                self._ack(view)
                self.oracle.delivered(self.name, step, view, reqs, frozenset(view.token_ranges))
        except Exception as exc:
            self.error = exc
