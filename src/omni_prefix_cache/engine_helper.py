"""The engine helper: one object that wires the event API into a model runner.

A runner keeps one ``PrefixCacheEngineHelper`` per stage and calls, per
scheduler step:

- ``begin_step(scheduler_output)`` on the engine thread, before the runner
  updates its input batch (vLLM: first thing in ``execute_model``, before
  ``_update_states`` drops finished requests): the adapter's events go to
  ``new_step_starts``;
- ``save(hidden, mm, ...)`` on the engine thread, after the forward, while
  the input batch is still the step's: the write layout comes from the
  group view and the rows go to ``save_outputs``; the returned
  ``SavedStep`` must be consumed exactly once;
- ``output_builder(saved, build, publish)`` (or ``discard_builder``) on the
  engine thread, handing the returned callable to the thread that builds
  outputs (vLLM: the async output thread). Builders run in step order; the
  callable materializes, takes the delivery view of ``consumer``, builds
  the payload outside any lock, then commits it (``commit_output``: retired
  owners filtered, ``publish`` called, the view acknowledged, atomically).
  A builder whose predecessor failed discards its step and raises
  ``OmniPrefixCacheStepDiscardedError``.

Speculative decoding: a step with drafts (``SavedStep.drafts``) needs its
accepted rows, ``accepted_rows_of(model_runner_output)`` (per request
``len(sampled_token_ids[i])``), given to ``output_builder`` when the runner
has them on the engine thread (right after the rejection sampler), or to
the builder when it runs (vLLM's async output thread: they reach the CPU in
``get_output``). A drafted step's builder without them raises
``OmniPrefixCacheAcceptedRowsError`` naming the requests and discards the
step (nothing is delivered past it).

Other consumers of the same outputs call ``manager.delivery_view`` and
``manager.ack_delivery`` on their own schedule. Nothing here locks: the
manager does; the ordering needs only one future per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from omni_prefix_cache.adapter import PrefixCacheSchedulerAdapter, PrefixCacheStep
from omni_prefix_cache.errors import (
    OmniPrefixCacheAcceptedRowsError,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheUnmatchError,
)
from omni_prefix_cache.interface import ReqId, StageCacheOutputs, output_progress
from omni_prefix_cache.kv_layout_gate import check_view_group
from omni_prefix_cache.manager import OmniPrefixCacheManager

__all__ = [
    "CommittedStep",
    "OmniPrefixCacheStepDiscardedError",
    "PrefixCacheEngineHelper",
    "SavedStep",
]

T = TypeVar("T")
P = TypeVar("P")


class OmniPrefixCacheStepDiscardedError(OmniPrefixCacheUnmatchError):
    """An ordered output builder did not build: an earlier step's builder
    failed, so this step was discarded. The message names both steps."""


@dataclass(frozen=True, slots=True)
class SavedStep:
    """A saved step: its id, the requests of its rows in batch order (the
    save-time snapshot the output path must use, never the live batch), the
    adapter's step sequence and the speculative drafts it scheduled
    (``(req_id, drafts)``; its builder then needs the accepted rows)."""

    step_id: int
    req_ids: tuple[ReqId, ...]
    sequence: int | None = None
    drafts: tuple[tuple[ReqId, int], ...] = ()


@dataclass(frozen=True, slots=True)
class CommittedStep(Generic[P]):
    """What an output builder did: the raw outputs (for other consumers),
    the delivery view it built from, the payload, and the live requests the
    commit handed off (retired owners left out)."""

    saved: SavedStep
    outputs: StageCacheOutputs
    view: StageCacheOutputs
    payload: P
    live: frozenset[ReqId]


class PrefixCacheEngineHelper:
    """Step begin, save, materialize, commit and ordered output builders
    over one manager, one scheduler adapter and one group view.

    ``consumer`` names the output builder's delivery watermark. Engine
    thread: ``begin_step``, ``save``, ``output_builder``, ``discard_builder``
    (in step order). The builders, ``materialize``, ``discard`` and
    ``commit``: any one thread at a time per consumer (the manager locks).
    """

    def __init__(
        self,
        manager: OmniPrefixCacheManager,
        group_view: Any,
        *,
        consumer: str = "output",
        adapter: PrefixCacheSchedulerAdapter | None = None,
    ) -> None:
        """Raises ``OmniPrefixCacheUnmatchError`` when ``group_view`` reads
        another KV cache group than ``manager`` keys its rows by."""
        group = getattr(manager, "kv_cache_group_index", None)
        if group is not None:
            check_view_group(group_view, group)
        self.manager = manager
        self.group_view = group_view
        self.consumer = consumer
        self.adapter = adapter if adapter is not None else PrefixCacheSchedulerAdapter()
        self._step: PrefixCacheStep | None = None
        self._tail: Future[None] | None = None  # the last builder handed out

    # ------------------------------------------------------------ engine thread

    def begin_step(self, scheduler_output: Any) -> PrefixCacheStep:
        """Translate ``scheduler_output`` and start the step
        (``new_step_starts``). Engine thread, every step, before the input
        batch drops finished requests, also for a step that schedules
        nothing. Raises what the adapter and ``new_step_starts`` raise; the
        step is then not begun."""
        step = self.adapter.translate_step(scheduler_output)
        self._step = None
        self.manager.new_step_starts(step)
        self._step = step
        return step

    def save(
        self,
        hidden: Any,
        mm: Mapping[str, Any] | None,
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
    ) -> SavedStep | None:
        """Save the begun step's forward outputs under the write layout the
        group view gives (the input batch must be this step's). None when
        the step scheduled no tokens (nothing saved, nothing to consume).
        Engine thread, once per begun step. Raises the unmatch error
        without a begun step, else what ``build_write_layout`` and
        ``save_outputs`` raise."""
        step = self._step
        if step is None:
            raise OmniPrefixCacheUnmatchError("engine helper: save without a begun step (call begin_step first)")
        self._step = None
        counts = dict(step.scheduled_tokens)
        if not any(counts.values()):
            return None
        layout = self.adapter.build_write_layout(self.group_view, num_scheduled_tokens=counts)
        sid = self.manager.save_outputs(
            hidden,
            mm,
            num_tokens_unpadded=num_tokens_unpadded,
            num_tokens_padded=num_tokens_padded,
            write_layout=layout,
        )
        return SavedStep(sid, tuple(w.req_id for w in layout.writes), step.sequence, step.draft_tokens)

    def output_builder(
        self,
        saved: SavedStep,
        build: Callable[[StageCacheOutputs], P],
        publish: Callable[[P, frozenset[ReqId]], None],
        *,
        accepted_rows: Mapping[ReqId, int] | None = None,
    ) -> Callable[..., CommittedStep[P]]:
        """The step's output builder, ordered after every builder handed
        out before it. When called (any thread): materialize, take
        ``consumer``'s delivery view, ``build(view)`` (copies, syncs: no
        lock held), then ``commit_output`` calling ``publish(payload,
        live)`` (publish only: no copies, waits or manager calls).

        ``accepted_rows`` (a step with speculative drafts): per request
        ``len(sampled_token_ids[i])``, here or as the builder's own
        ``accepted_rows`` argument when it runs (not both); a drafted step
        without them raises ``OmniPrefixCacheAcceptedRowsError`` naming the
        requests, discarding the step. The view leaves out requests whose
        owner is already retired: commit would drop their rows anyway, and
        once it dropped one output of an owner (unacknowledged), a view of
        that owner's next output would start past its watermark and raise a
        gap. Engine thread, in step order."""

        def run(*, accepted_rows: Mapping[ReqId, int] | None = None) -> CommittedStep[P]:
            outputs = self.materialize(saved, accepted_rows=_one_of(given, accepted_rows, saved))
            view = self.manager.delivery_view(outputs, _unretired(outputs, saved.req_ids), consumer=self.consumer)
            payload = build(view)
            live = self.commit(outputs, view, lambda ids: publish(payload, ids))
            return CommittedStep(saved, outputs, view, payload, live)

        given = accepted_rows
        return self.ordered(run, saved, accepted_rows=given)

    def discard_builder(
        self, saved: SavedStep, *, accepted_rows: Mapping[ReqId, int] | None = None
    ) -> Callable[..., None]:
        """A builder that discards the step, ordered like ``output_builder``
        (an engine that drops a step's outputs). ``accepted_rows``, here or
        when it runs, as ``discard`` takes them. Engine thread, in step order."""

        def run(*, accepted_rows: Mapping[ReqId, int] | None = None) -> None:
            self.discard(saved, accepted_rows=_one_of(given, accepted_rows, saved))

        given = accepted_rows
        return self.ordered(run, saved, accepted_rows=given)

    def ordered(
        self,
        build: Callable[..., T],
        saved: SavedStep | None = None,
        *,
        accepted_rows: Mapping[ReqId, int] | None = None,
    ) -> Callable[..., T]:
        """``build`` wrapped to run after the previous wrapped builder
        finished (the wrapper's keyword arguments go to ``build``). If that
        one failed, ``saved`` (when given) is discarded (with the step's
        ``accepted_rows``, given here or to the wrapper, when they fit) and
        the wrapper raises ``OmniPrefixCacheStepDiscardedError``, so a
        failure fails every later step instead of delivering past it;
        ``build`` refusing an argument (the step's accepted rows) discards
        it too (the step would stay saved otherwise). Engine thread, in step
        order; call each wrapper exactly once."""
        before = self._tail
        done: Future[None] = Future()
        self._tail = done

        def run(**kwargs: Any) -> T:
            try:
                if before is not None:
                    failure = before.exception()  # waits for the predecessor
                    if failure is not None:
                        if saved is not None:
                            self._discard_after_failure(saved, kwargs.get("accepted_rows") or accepted_rows)
                        sid = "?" if saved is None else saved.step_id
                        raise OmniPrefixCacheStepDiscardedError(
                            f"output builder of step {sid} discarded it: an earlier step's builder failed "
                            f"({type(failure).__name__}: {failure})"
                        ) from failure
                try:
                    result = build(**kwargs)
                except OmniPrefixCacheInvalidArgumentError:
                    # A refused materialize (the accepted rows, or a bad argument) leaves its step
                    # saved: discard it, so nothing is held past it.
                    if saved is not None:
                        self._discard_quietly(saved)
                    raise
            except BaseException as exc:
                done.set_exception(exc)
                raise
            done.set_result(None)
            return result

        return run

    def _discard_after_failure(self, saved: SavedStep, accepted_rows: Mapping[ReqId, int] | None) -> None:
        """Discard a step whose predecessor's builder failed: with its
        accepted rows when it has drafts and they fit (its accepted rows
        then count, its rejected ones' slots are REJECTED), else without."""
        if saved.drafts and accepted_rows is not None:
            try:
                self.manager.discard_step(saved.step_id, accepted_rows=accepted_rows)
                return
            except OmniPrefixCacheAcceptedRowsError:
                pass  # not a fit: discard it without them
        self.manager.discard_step(saved.step_id)

    def _discard_quietly(self, saved: SavedStep) -> None:
        """Discard a step a builder could not materialize, if it is still
        saved (a refusal consumed nothing; any other error consumed it)."""
        try:
            self.manager.discard_step(saved.step_id)
        except OmniPrefixCacheUnmatchError:
            pass  # already consumed (the error came after the consume), or shut down

    # ------------------------------------------------------------ any thread

    def materialize(self, saved: SavedStep, *, accepted_rows: Mapping[ReqId, int] | None = None) -> StageCacheOutputs:
        """``materialize`` of the saved step for its save-time requests
        (consumes it), with the step's accepted rows (speculative
        decoding; passed only when given, so a manager without
        speculative decoding sees the call it always saw). Any thread, once
        per step; raises what it raises."""
        if accepted_rows is None:
            return self.manager.materialize(saved.step_id, list(saved.req_ids))
        return self.manager.materialize(saved.step_id, list(saved.req_ids), accepted_rows=accepted_rows)

    def discard(self, saved: SavedStep, *, accepted_rows: Mapping[ReqId, int] | None = None) -> None:
        """``discard_step`` of the saved step (consumes it; nothing is
        delivered; with accepted rows its rejected drafts' slots are
        REJECTED and its accepted rows count; passed only when given). Any
        thread, once per step."""
        if accepted_rows is None:
            self.manager.discard_step(saved.step_id)
        else:
            self.manager.discard_step(saved.step_id, accepted_rows=accepted_rows)

    def commit(
        self,
        outputs: StageCacheOutputs,
        view: StageCacheOutputs,
        handoff: Callable[[frozenset[ReqId]], None],
    ) -> frozenset[ReqId]:
        """``commit_output(outputs, handoff, delivery=view)``: the live
        requests handed off and acknowledged. The output builder's thread;
        raises the delivery-gap error (nothing handed off) as it does."""
        return self.manager.commit_output(outputs, handoff, delivery=view)


def _one_of(
    given: Mapping[ReqId, int] | None, at_run: Mapping[ReqId, int] | None, saved: SavedStep
) -> Mapping[ReqId, int] | None:
    """The accepted rows given to the builder's maker or to the builder
    itself; both is a caller bug (which one holds?)."""
    if given is not None and at_run is not None:
        raise OmniPrefixCacheAcceptedRowsError(
            f"output builder of step {saved.step_id}: accepted_rows given twice (to output_builder and to the "
            "builder); give them once"
        )
    return at_run if at_run is not None else given


def _unretired(outputs: StageCacheOutputs, req_ids: tuple[ReqId, ...]) -> list[ReqId]:
    """``req_ids`` whose owner (the tenure the rows were saved under) is not
    retired. Read without the state lock: ``retired`` only ever turns True,
    and an owner retired after this read is filtered by ``commit_output``."""
    progress = output_progress(outputs)
    return [rid for rid in req_ids if not progress[rid].retired]
