"""The materializer: one consumed step's outputs, per request.

``Materializer.build`` merges each request's rows from the step's staging
page (immediate keys), its CPU snapshot (deferred keys and leftover mm) and,
for a prefix hit, the prefetched ``[prefix | tail]`` buffer (operation
materialize's ``merge_outputs``; the manager runs the operation,
``manager_ops``).

Threading: any thread, after the facade consumed the step under the state
lock; no lock is held on entry. ``build`` takes the state lock briefly to
publish drained writes; ``wait_device`` may record a sticky failure.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from omni_prefix_cache.device.copy_engine import DeviceEvent
from omni_prefix_cache.device.index_tensors import int64_tensor, per_row_ids
from omni_prefix_cache.interface import (
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    PrefixCacheRequestProgress,
    ReqId,
    StageCacheOutputs,
    TensorName,
    is_hidden_key,
)
from omni_prefix_cache.reads.planned_read import HitReads
from omni_prefix_cache.steps.step_context import StepContext
from omni_prefix_cache.steps.step_layout import payload_for_request
from omni_prefix_cache.steps.step_record import Accepted
from omni_prefix_cache.steps.validation import listed
from omni_prefix_cache.steps.write_ledger import WriteLedger
from omni_prefix_cache.telemetry.registry import TELEMETRY


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
        wanted = set(req_ids)
        record = ctx.record
        index = record.index
        if not index.keys() >= wanted:
            outside = [r for r in req_ids if r not in index]
            raise OmniPrefixCacheUnmatchError(
                f"materialize(step {ctx.step_id}): request ids {listed(outside)} are outside the save snapshot "
                f"(saved: {listed(record.req_ids)})"
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
        entries = record.hits
        hits = [h for h in map(entries.__getitem__, map(index.__getitem__, req_ids)) if h] if record.any_hit else []
        # The plain requests' rows are gathered once per key (one copy of
        # just their rows) and cut into per-request views, in step order;
        # the views are disjoint, so no request aliases another.
        plain = RequestRuns.of(ctx, wanted.difference(h.req_id for h in hits) if hits else wanted)
        for key, src in sources.items():
            out_map = hidden_out if is_hidden_key(key) else mm_out[key]
            if out_map is None:
                continue
            if plain.names:
                out_map.update(zip(plain.names, plain.views(self.restore_shape(ctx, key, plain.gather(src)))))
            for hit in hits:
                rid = hit.req_id
                start, rows = record.span(rid)
                merged = self.merge_hit(
                    ctx, rid, key, hit.num_computed, hit.futures.get(key), src[start : start + rows]
                )
                out_map[rid] = self.restore_shape(ctx, key, merged)
        for hit in hits:
            # Cached keys this step did not produce: the prefix is all there is.
            rid, computed = hit.req_id, hit.num_computed
            for key, fut in hit.futures.items():
                if key in sources:
                    continue
                prefix = self.restore_shape(ctx, key, self.hit_rows(ctx, rid, key, fut)[:computed])
                if is_hidden_key(key):
                    if hidden_out is not None:
                        hidden_out[rid] = prefix
                else:
                    mm_out.setdefault(key, {})[rid] = prefix
        every: RequestRuns | None = None
        token_major = {k for k in sources if not is_hidden_key(k)}
        for key, value in ctx.mm_cpu_snapshot.items():
            if key in sources:
                continue
            out_map = mm_out[key]
            if isinstance(value, torch.Tensor) and value.ndim >= 1 and int(value.shape[0]) == ctx.n:
                token_major.add(key)
                # Token-major: one gather and a view per request, as for the pool keys.
                if every is None:
                    every = plain if not hits else RequestRuns.of(ctx, wanted)
                if every.names:
                    out_map.update(zip(every.names, every.views(every.gather(value))))
                continue
            for rid in req_ids:
                start, rows = record.span(rid)
                out_map[rid] = payload_for_request(value, start, start + rows, ctx.n)
        return self.outputs(ctx, wanted, req_ids, hidden_out, mm_out, token_major)

    @staticmethod
    def outputs(
        ctx: StepContext,
        wanted: set[ReqId],
        req_ids: Sequence[ReqId],
        hidden: dict[ReqId, torch.Tensor] | None,
        mm: dict[TensorName, dict[ReqId, Any]],
        token_major: set[TensorName],
    ) -> StageCacheOutputs:
        """The outputs with where they sit: each request's rows cover
        ``[hit start, token end)`` with a hit (the recovered prefix first),
        else its scheduled range; the tenures they were saved under."""
        record = ctx.record
        names, scheduled, tenures = record.req_ids, record.token_ranges, record.tenures
        if not record.any_hit and len(scheduled) == len(names) and list(req_ids) == names:
            # Every request of the step in step order, none with a hit
            # (decode): the step's own arrays, zipped whole (no Python per
            # request).
            ranges = dict(zip(names, scheduled))
            sched = ranges.copy()
            progress: dict[ReqId, PrefixCacheRequestProgress] = dict(zip(names, tenures))
        else:
            index, hits, known = record.index, record.hits, len(scheduled)
            ranges, sched, progress = {}, {}, {}
            for r in req_ids:
                i = index[r]
                if i >= known:  # no token range recorded (a record_saved never ran)
                    continue
                span = sched[r] = scheduled[i]
                hit = hits[i]
                ranges[r] = (hit.hit_start, span[1]) if hit is not None else span
                progress[r] = tenures[i]
        cached = frozenset(k for k in ctx.layouts if not is_hidden_key(k) and k in mm)
        return StageCacheOutputs(
            hidden_states=hidden,
            mm_outputs=mm,
            token_ranges=ranges,
            scheduled_token_ranges=sched,
            cached_mm_keys=cached,
            token_mm_keys=frozenset(token_major),
            _progress=progress,
        )

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


def cut_rejected(outputs: StageCacheOutputs, verdicts: Sequence[Accepted]) -> None:
    """Effect ``cut_rejected`` on a fresh materialize result: each drafted
    request's rows (hidden, token-major mm) end at its accepted end, and so
    do its token ranges; other mm stays whole. A request the output does not
    carry is skipped. Views, no copy: the cut rows stay in the output's
    buffers, unreachable."""
    hidden, ranges, sched = outputs.hidden_states, outputs.token_ranges, outputs.scheduled_token_ranges
    token_major = [outputs.mm_outputs[k] for k in outputs.token_mm_keys if k in outputs.mm_outputs]
    for v in verdicts:
        cut = v.end - v.accepted_end
        got = ranges.get(v.req_id)
        if cut <= 0 or got is None:
            continue
        rid = v.req_id
        ranges[rid] = (got[0], got[1] - cut)
        if rid in sched:
            first, last = sched[rid]
            sched[rid] = (first, last - cut)
        if hidden is not None and rid in hidden:
            rows = hidden[rid]
            hidden[rid] = rows[: int(rows.shape[0]) - cut]
        for per_req in token_major:
            value = per_req.get(rid)
            if isinstance(value, torch.Tensor) and value.ndim >= 1:
                per_req[rid] = value[: int(value.shape[0]) - cut]


def gather_index(starts: list[int], sizes: list[int]) -> torch.Tensor:
    """The rows ``range(starts[i], starts[i] + sizes[i])`` of every ``i``,
    concatenated (int64). The shift from output row to step row is constant
    per request: one ``per_row_ids`` of the shifts plus the output row."""
    if sizes.count(1) == len(sizes):  # one row each (decode)
        return int64_tensor(starts)
    firsts = accumulate(sizes, initial=0)
    ids = per_row_ids([start - first for start, first in zip(starts, firsts)], sizes)
    ids += np.arange(ids.size, dtype=np.int64)
    return torch.from_numpy(ids)


# At most this many contiguous runs are gathered by one copy each into the
# output; more (decode requests picked one by one) by one index_select.
_COPY_RUNS = 8


@dataclass(frozen=True, eq=False, slots=True)
class RequestRuns:
    """Some requests of a step, in step order: their names, row counts and
    where their rows sit in the step, as contiguous runs ``(first step row,
    rows)`` (adjacent requests merge into one run). ``gather`` copies their
    rows out of a step tensor once, into one new tensor; ``views`` cuts that
    tensor into one view per request."""

    names: list[ReqId]
    sizes: list[int]
    runs: list[tuple[int, int]]

    @classmethod
    def of(cls, ctx: StepContext, wanted: set[ReqId]) -> RequestRuns:
        """The scheduled requests of ``wanted`` (each inside the save
        snapshot; a hit request without rows has none)."""
        record = ctx.record
        k = record.scheduled
        if len(wanted) == k == len(record.req_ids):  # as many as the snapshot holds, all scheduled: one run
            return cls(record.req_ids, record.row_counts, [(0, ctx.n)])
        ids, row_starts, counts = record.req_ids, record.row_starts, record.row_counts
        picked = [i for i in range(k) if ids[i] in wanted]
        names = [ids[i] for i in picked]
        sizes = [counts[i] for i in picked]
        runs: list[tuple[int, int]] = []
        end = -1
        for i in picked:
            start, rows = row_starts[i], counts[i]
            if start == end:
                first, count = runs[-1]
                runs[-1] = (first, count + rows)
            else:
                runs.append((start, rows))
            end = start + rows
        return cls(names, sizes, runs)

    def gather(self, src: torch.Tensor) -> torch.Tensor:
        """These requests' rows of ``src`` (step rows first), one new tensor:
        one copy per run into a preallocated output, or one index_select."""
        runs = self.runs
        if len(runs) == 1:
            first, rows = runs[0]
            return src[first : first + rows].clone()
        if len(runs) > _COPY_RUNS:
            return src.index_select(0, gather_index([s for s, _ in runs], [k for _, k in runs]))
        out = torch.empty((sum(self.sizes), *src.shape[1:]), dtype=src.dtype, device=src.device)
        at = 0
        for first, rows in runs:
            out[at : at + rows].copy_(src[first : first + rows])
            at += rows
        return out

    def views(self, rows: torch.Tensor) -> Sequence[torch.Tensor]:
        """``rows`` (a ``gather``, reshaped) cut into one tensor per request.
        Not views torch tracks: ``rows`` is private to this output and no
        autograd runs on it, so the untracked split (a third cheaper per
        request) shares the storage the same way."""
        if len(self.sizes) == 1:
            return (rows,)
        return rows.unsafe_split_with_sizes(self.sizes)
