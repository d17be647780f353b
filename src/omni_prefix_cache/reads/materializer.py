"""The materializer: one consumed step's outputs, per request.

``Materializer.build`` merges each request's rows from the step's staging
page (immediate keys), its CPU snapshot (deferred keys and leftover mm) and,
for a prefix hit, the prefetched ``[prefix | tail]`` buffer; ``release`` runs
the consume move's effects and drops hit reads nobody will look at.

Threading: any thread, after the facade consumed the step under the state
lock; no lock is held on entry. ``build`` takes the state lock briefly to
publish drained writes; ``wait_device`` may record a sticky failure.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from itertools import accumulate
from typing import Any

import torch

from omni_prefix_cache.device.copy_engine import DeviceEvent
from omni_prefix_cache.device.index_tensors import int64_tensor, per_row
from omni_prefix_cache.interface import (
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    ReqId,
    StageCacheOutputs,
    TensorName,
    is_hidden_key,
)
from omni_prefix_cache.reads.planned_read import HitReads, PlannedRead
from omni_prefix_cache.specs import CompiledMove
from omni_prefix_cache.steps.step_context import StepContext
from omni_prefix_cache.steps.step_layout import payload_for_request
from omni_prefix_cache.steps.validation import listed
from omni_prefix_cache.steps.write_ledger import WriteLedger
from omni_prefix_cache.telemetry.registry import TELEMETRY, dropped


class Materializer:
    """Builds StageCacheOutputs from a consumed StepContext."""

    def __init__(self, ledger: WriteLedger, reads: HitReads, state_lock: threading.Lock) -> None:
        self._ledger = ledger
        self._reads = reads
        self._state_lock = state_lock

    def build(self, ctx: StepContext, req_ids: Sequence[ReqId]) -> StageCacheOutputs:
        """Each request's merged outputs: hit prefix rows followed by this
        step's rows for every pool key, plus its share of the leftover mm.
        Raises OmniPrefixCacheUnmatchError for ids outside the save snapshot
        or a hit that cannot be served, the shutdown error for a hit read
        cancelled by shutdown, the write-failed error on a device fault."""
        outside = [r for r in req_ids if r not in ctx.spans]
        if outside:
            raise OmniPrefixCacheUnmatchError(
                f"materialize(step {ctx.step_id}): request ids {listed(outside)} are outside the save snapshot "
                f"(saved: {listed(list(ctx.spans))})"
            )
        with self._state_lock:
            self._ledger.commit_drained_locked()
        if ctx.d2h is not None and ctx.d2h.event is not None:
            self.wait_device(ctx, ctx.d2h.event, "staging copy")
        if ctx.mm_event is not None:  # pragma: no cover - CUDA only
            self.wait_device(ctx, ctx.mm_event, "leftover mm copy")
        sources: dict[TensorName, torch.Tensor] = {}
        if ctx.d2h is not None:
            for key in ctx.immediate_keys:
                sources[key] = ctx.d2h.views[key]
        for key in ctx.deferred_keys:
            snap = ctx.mm_cpu_snapshot[key]
            sources[key] = snap.reshape(int(snap.shape[0]), ctx.layouts[key].width)
        hidden_out: dict[ReqId, torch.Tensor] | None = {} if ctx.hidden_cached else None
        mm_out: dict[TensorName, dict[ReqId, Any]] = {}
        for key in (*sources, *ctx.mm_cpu_snapshot):
            if not is_hidden_key(key):
                mm_out.setdefault(key, {})
        hits = ctx.hits
        hit_reqs = [r for r in req_ids if r in hits] if hits else []
        # The plain requests' rows are gathered once per key (one copy of
        # just their rows) and cut into per-request views, in step order;
        # the views are disjoint, so no request aliases another.
        wanted = set(req_ids)
        names, sizes, index = self.request_rows(ctx, wanted.difference(hits) if hits else wanted)
        for key, src in sources.items():
            out_map = hidden_out if is_hidden_key(key) else mm_out[key]
            if out_map is None:
                continue
            if names:
                picked = src[: ctx.n].clone() if index is None else src.index_select(0, index)
                out_map.update(zip(names, torch.split(self.restore_shape(ctx, key, picked), sizes)))
            for rid in hit_reqs:
                start, rows = ctx.spans[rid]
                fut = ctx.hit_prefetch.get(rid, {}).get(key)
                merged = self.merge_hit(ctx, rid, key, hits[rid][0], fut, src[start : start + rows])
                out_map[rid] = self.restore_shape(ctx, key, merged)
        for rid in hit_reqs:
            # Cached keys this step did not produce: the prefix is all there is.
            computed = ctx.hits[rid][0]
            for key, fut in ctx.hit_prefetch.get(rid, {}).items():
                if key in sources:
                    continue
                prefix = self.restore_shape(ctx, key, self.hit_rows(ctx, rid, key, fut)[:computed])
                if is_hidden_key(key):
                    if hidden_out is not None:
                        hidden_out[rid] = prefix
                else:
                    mm_out.setdefault(key, {})[rid] = prefix
        every: tuple[list[ReqId], list[int], torch.Tensor | None] | None = None
        token_major = {k for k in sources if not is_hidden_key(k)}
        for key, value in ctx.mm_cpu_snapshot.items():
            if key in sources:
                continue
            out_map = mm_out[key]
            if isinstance(value, torch.Tensor) and value.ndim >= 1 and int(value.shape[0]) == ctx.n:
                token_major.add(key)
                # Token-major: one gather and a view per request, as for the pool keys.
                if every is None:
                    every = self.request_rows(ctx, wanted)
                picked = value.clone() if every[2] is None else value.index_select(0, every[2])
                out_map.update(zip(every[0], torch.split(picked, every[1])))
                continue
            for rid in req_ids:
                start, rows = ctx.spans[rid]
                out_map[rid] = payload_for_request(value, start, start + rows, ctx.n)
        return self.outputs(ctx, req_ids, hidden_out, mm_out, token_major)

    @staticmethod
    def outputs(
        ctx: StepContext,
        req_ids: Sequence[ReqId],
        hidden: dict[ReqId, torch.Tensor] | None,
        mm: dict[TensorName, dict[ReqId, Any]],
        token_major: set[TensorName],
    ) -> StageCacheOutputs:
        """The outputs with where they sit: each request's rows cover
        ``[hit start, token end)`` with a hit (the recovered prefix first),
        else its scheduled range; the tenures they were saved under."""
        scheduled = ctx.token_ranges
        starts = ctx.hit_starts
        ranges = {r: (starts[r], scheduled[r][1]) if r in starts else scheduled[r] for r in req_ids if r in scheduled}
        cached = frozenset(k for k in ctx.layouts if not is_hidden_key(k) and k in mm)
        tenures = ctx.tenures
        return StageCacheOutputs(
            hidden_states=hidden,
            mm_outputs=mm,
            token_ranges=ranges,
            scheduled_token_ranges={r: scheduled[r] for r in ranges},
            cached_mm_keys=cached,
            token_mm_keys=frozenset(token_major),
            _progress={r: tenures[r] for r in ranges if r in tenures},
        )

    @staticmethod
    def request_rows(ctx: StepContext, wanted: set[ReqId]) -> tuple[list[ReqId], list[int], torch.Tensor | None]:
        """The requests of ``wanted`` (inside the save snapshot) in step
        order, their row counts this step and the step rows to gather for
        them (None: all ``n`` rows, in order)."""
        if not wanted:
            return [], [], torch.empty((0,), dtype=torch.int64)
        if len(wanted) == len(ctx.order) and wanted.issuperset(ctx.order):
            return ctx.order, ctx.sizes, None
        spans = ctx.spans
        names = sorted(wanted, key=lambda r: spans[r][0])
        sizes = [spans[r][1] for r in names]
        return names, sizes, gather_index([spans[r][0] for r in names], sizes)

    def merge_hit(
        self,
        ctx: StepContext,
        rid: ReqId,
        key: TensorName,
        computed: int,
        fut: Future[torch.Tensor] | None,
        tail: torch.Tensor,
    ) -> torch.Tensor:
        """Write this step's rows behind the prefetched prefix (the returned
        tensor is the prefetched buffer whenever its size fits). Raises when
        the hit has no planned read for ``key``."""
        if fut is None:
            raise OmniPrefixCacheUnmatchError(
                f"materialize(step {ctx.step_id}): hit of request {rid!r} has no planned read for key {key!r}"
            )
        buf = self.hit_rows(ctx, rid, key, fut)
        rows = int(tail.shape[0])
        if int(buf.shape[0]) != computed + rows:
            grown = torch.empty((computed + rows, *buf.shape[1:]), dtype=buf.dtype)
            grown[:computed].copy_(buf[:computed])
            buf = grown
        buf[computed:].copy_(tail)
        return buf

    def hit_rows(self, ctx: StepContext, rid: ReqId, key: TensorName, fut: Future[torch.Tensor]) -> torch.Tensor:
        """The prefetched ``[prefix | tail]`` buffer (waits for the prefetch).
        Only shutdown cancels a read a step still owns, so a cancelled one is
        the shutdown error; a failed read raises its own error."""
        try:
            dp = TELEMETRY.datapath
            if dp is None:
                return fut.result()
            if fut.done():
                dp.add("prefetch_hits_total", "used")
                return fut.result()
            # Served late: the engine thread waits the prefetch thread.
            start = TELEMETRY.clock()
            try:
                return fut.result()
            finally:
                dp.add("prefetch_hits_total", "late")
                dp.waited("prefetch", start, TELEMETRY.clock())
        except CancelledError:
            raise OmniPrefixCacheShutdownError(
                f"materialize(step {ctx.step_id}): the hit read of {key!r} rows for request {rid!r} was cancelled "
                "by shutdown"
            ) from None

    @staticmethod
    def restore_shape(ctx: StepContext, key: TensorName, rows: torch.Tensor) -> torch.Tensor:
        """2-D pool rows back in the per-token shape the caller saved."""
        layout = ctx.layouts.get(key)
        if layout is None or len(layout.trailing) == 1:
            return rows
        return rows.reshape(int(rows.shape[0]), *layout.trailing)

    def wait_device(self, ctx: StepContext, event: DeviceEvent, what: str) -> None:
        """Host-wait a device event of ``ctx``'s step. A device fault (the
        CUDA context is gone) becomes the sticky failure, then raises."""
        try:
            event.synchronize()
        except RuntimeError as exc:
            # A dead device context loses every write still in flight, so it
            # is sticky like a failed pool write.
            error = OmniPrefixCacheWriteFailedError(f"step {ctx.step_id}: device fault while waiting its {what}: {exc}")
            error.__cause__ = exc
            self._ledger.record_fault(error)
            raise error.again() from exc

    def release(self, ctx: StepContext, move: CompiledMove) -> None:
        """Run the consume move's effects (release the step holder) and drop
        hit prefetches nobody will read. Any thread, no lock held; raises
        what a refused staging release raises (after the cleanup)."""
        try:
            for effect in move.effects:
                effect(ctx)
        finally:
            stale: list[PlannedRead] = []
            for rid, futures in ctx.hit_prefetch.items():
                for key, fut in futures.items():
                    if fut.cancel():
                        dropped(1)
                        ref = ctx.hit_refs.get(rid, {}).get(key)
                        if ref is not None:
                            stale.append(ref)
            for ref in stale:
                self._reads.forget(ref)


def gather_index(starts: list[int], sizes: list[int]) -> torch.Tensor:
    """The rows ``range(starts[i], starts[i] + sizes[i])`` of every ``i``,
    concatenated (int64). The shift from output row to step row is constant
    per request: one ``per_row`` of the shifts plus the output row."""
    if sizes.count(1) == len(sizes):  # one row each (decode)
        return int64_tensor(starts)
    firsts = accumulate(sizes, initial=0)
    shifts = per_row([start - first for start, first in zip(starts, firsts)], sizes)
    return shifts.add_(torch.arange(int(shifts.numel()), dtype=torch.int64))
