"""Step-output layout: which rows of a save belong to whom, and how they travel.

``StepLayout`` reads the group view (request order, per-request spans, slot
ids) and routes one forward's outputs: immediate pool keys (hidden and
token-major mm, copied through a staging page), deferred pool keys (cloned
once, one chunk per request) and leftover mm (a CPU snapshot for this step's
own materialize). It also keeps each pool key's layout (dtype, width, the
per-token shape restored on the way out).

Threading: the engine thread calls ``request_spans``, ``split`` and
``leftover_snapshot`` outside the manager's state lock (they clone and copy);
``publish_keys`` and ``step_context`` run under the state lock.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.device.copy_engine import CopyEngine, CudaRuntime, DeviceEvent
from omni_prefix_cache.device.index_tensors import out_of_range
from omni_prefix_cache.engine_types import GroupViewLike
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    PrefixCacheConfig,
    ReqId,
    StepId,
    TensorName,
    is_hidden_key,
)
from omni_prefix_cache.steps import write_layout
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy
from omni_prefix_cache.steps.step_context import KeyLayout, StepContext
from omni_prefix_cache.steps.step_record import StepRecord
from omni_prefix_cache.steps.validation import check_step_tensors, listed
from omni_prefix_cache.writes.chunks import BudgetTicket, WriteChunk
from omni_prefix_cache.writes.staging import StagingBufferPool, StepD2HClaim


@dataclass(eq=False)
class SchedSnapshot:
    """What save needs from the scheduler output new_step_starts saw (and,
    for the event API, the write layout save_outputs was given)."""

    num_scheduled: dict[ReqId, int]
    layout: Any = None  # a PrefixCacheWriteLayout, or None: read the group view
    # Seed-era (no layout): where a request's rows start when the scheduler output says (its
    # scheduled_cached_reqs); any other request continues its tenure's computed_upto.
    starts: dict[ReqId, int] | None = None
    drafts: Mapping[ReqId, int] = field(default_factory=dict)  # speculative drafts per request (StepInput.drafts)


@dataclass(eq=False)
class StepOutputs:
    """One save's outputs, split by how they travel (``StepLayout.split``)."""

    immediate: dict[TensorName, torch.Tensor]  # 2-D rows [0:n): staging copy, JOIN_NEXT_STEP
    leftover: dict[TensorName, Any]  # everything copied to CPU for this step's materialize
    deferred_chunks: list[tuple[ReqId, WriteChunk]]  # one per request, viewing the deferred clone
    deferred_clone: dict[TensorName, torch.Tensor] = field(default_factory=dict)  # 2-D clone [0:n)
    # The GPU-byte budget charges only the deferred clone, on every engine
    # (the immediate clone is bounded by the staging pages; docs/cuda.md).
    deferred_ticket: BudgetTicket | None = None
    freeze_event: DeviceEvent | None = None
    layouts: dict[TensorName, KeyLayout] = field(default_factory=dict)
    on_device: tuple[TensorName, ...] = ()  # the immediate keys on a device (frozen clones)


def is_step_token_tensor(value: Any, n: int, padded: int) -> bool:
    """True for a token-major step tensor: ndim >= 2 and a first dim equal
    to the unpadded (``n``) or the CUDA-graph padded token count. Only those
    become pool keys."""
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and int(value.shape[0]) in (n, padded)


def snapshot_leftover_mm_cpu(
    mm: Mapping[str, Any], skip_keys: set[str], n: int
) -> tuple[dict[str, Any], DeviceEvent | None]:
    """CPU copies of every mm entry not in ``skip_keys``, taken at save so
    materialize never reads buffers the next forward overwrites.

    Shapes are kept exactly: a tensor is sliced ``[:n]`` only when its first
    dim already is ``n`` (which keeps it whole), never by ``shape[0] >= n``.
    Lists, tuples and dicts are copied recursively; other values pass
    through. Device tensors land in pinned memory with non-blocking copies
    and the returned CUDA event completes them (None when nothing left the
    device). Engine thread, outside the state lock.
    """
    devices: set[int] = set()

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            src = value.detach()
            if src.ndim >= 1 and int(src.shape[0]) == n:
                src = src[:n]
            if src.device.type == "cpu":
                return src.clone()
            # Pinned: a device copy writes it. The copy runs on the current
            # stream of the source's device, so that is where its event goes.
            devices.add(src.device.index or 0)
            dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            dst.copy_(src, non_blocking=True)
            return dst
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, list):
            return [copy(v) for v in value]
        if isinstance(value, tuple):
            items = [copy(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return value

    out = {key: copy(value) for key, value in mm.items() if key not in skip_keys}
    event = None
    if devices:  # pragma: no cover - CUDA only
        event = CudaRuntime().record_on_current(sorted(devices))
    return out, event


def payload_for_request(value: Any, start: int, end: int, n: int) -> Any:
    """One request's share of a leftover snapshot entry: tensors whose first
    dim is the step's token count are sliced to the request's rows; lists
    and tuples pass through whole (tensors cloned), dicts recurse, other
    tensors are request-invariant and cloned so callers never alias."""
    if isinstance(value, torch.Tensor):
        if value.ndim >= 1 and int(value.shape[0]) == n:
            return value[start:end].clone()
        return value.clone()
    if isinstance(value, dict):
        return {k: payload_for_request(v, start, end, n) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [v.clone() if isinstance(v, torch.Tensor) else v for v in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


class StepLayout:
    """Routes a step's outputs and keeps the pool keys' layouts.

    ``view`` is the group view (engine thread only). ``known`` maps each pool
    key to the layout its slab was opened with; it only grows.
    """

    def __init__(
        self,
        config: PrefixCacheConfig,
        view: GroupViewLike | None,
        pool: PrefixBlockPool,
        engine: CopyEngine,
        staging: StagingBufferPool,
    ) -> None:
        """``engine``: where the step's rows leave the device (its clones are
        frozen on it); ``staging``: the pool a step context's page is in."""
        self._config = config
        self._view = view
        self._pool = pool
        self._engine = engine
        self._staging = staging
        self.known: dict[TensorName, KeyLayout] = {}

    def new_slabs(self, split: StepOutputs) -> dict[TensorName, torch.Tensor]:
        """Slabs for the step's keys the pool does not hold yet (engine
        thread, outside the state lock: allocating them takes time)."""
        return {
            key: self._pool.new_slab(layout.dtype, layout.width)
            for key, layout in split.layouts.items()
            if not self._pool.has_key(key)
        }

    def publish_keys(self, slabs: dict[TensorName, torch.Tensor], split: StepOutputs, occupancy: SlotOccupancy) -> None:
        """Publish new pool keys with their occupancy tables and layouts
        (save, state lock held). A key another save published first keeps
        its slab."""
        for key, slab in slabs.items():
            if not self._pool.has_key(key):
                self._pool.install_key(key, slab)
            occupancy.add_key(key)
            self.known.setdefault(key, split.layouts[key])

    def route_step(
        self,
        sid: StepId,
        sched: SchedSnapshot,
        policy: ModelCachePolicy,
        hidden: torch.Tensor | None,
        mm: Mapping[str, Any] | None,
        n: int,
        padded: int,
    ) -> tuple[list[ReqId], dict[ReqId, tuple[int, int]], torch.Tensor, StepOutputs]:
        """Check and route one save (engine thread, no lock): the outputs'
        types and devices, the request spans and slots (``request_spans``),
        the split by how rows travel (``split``), that the immediate rows
        fit a staging page and that the host can hold the slabs of keys the
        pool has not opened yet (``PrefixBlockPool.check_fits``). Raises the
        invalid-type or invalid-argument error naming the step; nothing is
        registered yet."""
        check_step_tensors(sid, hidden, mm)
        req_order, spans, slots = self.request_spans(sid, sched, n)
        # The rows per request are the spans': the scheduler's counts built them
        # (group view), or the layout did, checked equal to any counts the step carries.
        rows = sched.num_scheduled if sched.layout is None else {r: spans[r][1] for r in req_order}
        split = self.split(policy, hidden, mm, n, padded, slots_cpu=slots, req_order=req_order, num_sched=rows)
        capacity = self._config.staging_capacity_tokens
        if split.immediate and n > capacity:
            raise OmniPrefixCacheInvalidArgumentError(
                f"step {sid} has {n} tokens; staging capacity is {capacity} "
                "(size staging_capacity_tokens to max_num_batched_tokens)"
            )
        # The first save of a key fixes its width, so its slab is sized now.
        self._pool.check_fits(
            {key: (lay.dtype, lay.width) for key, lay in split.layouts.items()}, what=f"save_outputs (step {sid})"
        )
        return req_order, spans, slots, split

    def request_spans(
        self, sid: StepId, sched: SchedSnapshot, n: int
    ) -> tuple[list[ReqId], dict[ReqId, tuple[int, int]], torch.Tensor]:
        """Request order, per-request (start, rows) and slot ids of the step,
        read from the write layout if the save was given one, else from the
        group view (engine thread, no lock). Raises the invalid-argument
        error if they do not cover ``n`` tokens."""
        if sched.layout is not None:
            return write_layout.layout_spans(sid, sched.layout, n, self._pool.num_slots, sched.num_scheduled)
        if self._view is None:
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): this manager has no group view, so every save needs a write_layout "
                "(PrefixCacheSchedulerAdapter.build_write_layout)"
            )
        num_sched = sched.num_scheduled
        order = [r for r in self._view.batch_req_ids() if num_sched.get(r, 0) > 0]
        sizes = list(map(num_sched.__getitem__, order))
        starts = list(accumulate(sizes, initial=0))
        start = starts.pop()
        spans = dict(zip(order, zip(starts, sizes)))
        if len(spans) != len(order):
            twice = next(r for i, r in enumerate(order) if r in order[:i])
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): request {twice!r} twice in the batch"
            )
        unbatched: list[ReqId] = []
        # Counts are validated non-negative: more nonzero counts than spans
        # means a scheduled request outside the batch.
        if len(num_sched) - operator.countOf(num_sched.values(), 0) != len(spans):
            unbatched = sorted(r for r, k in num_sched.items() if k > 0 and r not in spans)
        if unbatched or start != n:
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): the slot mapping covers {start} scheduled tokens of batch requests "
                f"but the step has {n} tokens (scheduled outside the batch: {listed(unbatched)})"
            )
        slots = self._view.step_slots_cpu(order, num_sched) if order else torch.empty((0,), dtype=torch.int64)
        if not isinstance(slots, torch.Tensor) or slots.ndim != 1 or int(slots.numel()) != n:
            got = tuple(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): slot mapping {got} does not cover the step's {n} tokens"
            )
        if slots.dtype != torch.int64 or not slots.is_cpu:
            write_layout.check_slot_dtype(f"save_outputs (step {sid}): the group view's slot mapping", slots)
            slots = slots.to("cpu", torch.int64)
        if out_of_range(slots.numpy(), self._pool.num_slots):
            bad = slots[(slots < 0) | (slots >= self._pool.num_slots)]
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): slots {listed(bad)} outside [0, {self._pool.num_slots})"
            )
        return order, spans, slots

    def layout_of(self, key: TensorName, rows: torch.Tensor, layouts: dict[TensorName, KeyLayout]) -> torch.Tensor:
        """Rows as a 2-D ``(n, width)`` tensor; records the key's layout in
        ``layouts`` and raises if it differs from the layout the key's slab
        was opened with."""
        trailing = tuple(rows.shape[1:])  # torch.Size holds ints
        known = self.known.get(key)
        if known is not None and known.dtype == rows.dtype and known.trailing == trailing:
            layouts[key] = known  # the usual save: the key's layout as the pool holds it
            return rows if len(trailing) == 1 else rows.reshape(int(rows.shape[0]), known.width)
        width = 1
        for d in trailing:
            width *= d
        if known is not None:
            raise OmniPrefixCacheInvalidArgumentError(
                f"key {key!r}: step rows are {rows.dtype} {trailing}, the pool holds {known.dtype} {known.trailing}"
            )
        if width <= 0:
            raise OmniPrefixCacheInvalidArgumentError(f"key {key!r}: token rows of shape {trailing} hold no values")
        layouts[key] = KeyLayout(dtype=rows.dtype, width=width, trailing=trailing)
        return rows.reshape(int(rows.shape[0]), width)

    def split(
        self,
        policy: ModelCachePolicy,
        hidden: torch.Tensor | None,
        mm: Mapping[str, Any] | None,
        n: int,
        padded: int,
        *,
        slots_cpu: torch.Tensor,
        req_order: Sequence[ReqId],
        num_sched: Mapping[ReqId, int],
    ) -> StepOutputs:
        """Route one step's outputs. Immediate: hidden (if cached) and
        token-major mm not marked deferred, as ``[:n]`` rows. Deferred:
        token-major deferred keys, cloned ``[:n]`` once for the whole step
        and cut into one chunk per request (sharing one budget ticket); also
        leftover, for this step's own materialize. Leftover: everything else.
        Engine thread, outside the state lock (it clones). Raises on too few
        hidden rows, a reserved mm name or a key changing dtype/width."""
        layouts: dict[TensorName, KeyLayout] = {}
        immediate: dict[TensorName, torch.Tensor] = {}
        leftover: dict[TensorName, Any] = {}
        deferred_src: dict[TensorName, torch.Tensor] = {}
        if policy.needs_full_hidden_states:
            if not isinstance(hidden, torch.Tensor) or hidden.ndim < 2 or int(hidden.shape[0]) < n:
                got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
                raise OmniPrefixCacheInvalidArgumentError(
                    f"hidden states {got} have fewer than the step's {n} token rows"
                )
            immediate[HIDDEN_KEY] = self.layout_of(HIDDEN_KEY, hidden.detach()[:n], layouts)
        if mm is None:
            mm = {}
        if not isinstance(mm, Mapping):
            raise OmniPrefixCacheInvalidTypeError(f"multimodal outputs must be a mapping, got {type(mm).__name__}")
        for key, value in mm.items():
            if is_hidden_key(key):
                raise OmniPrefixCacheInvalidArgumentError(f"mm output uses the reserved hidden key name {key!r}")
            if not is_step_token_tensor(value, n, padded):
                leftover[key] = value
                continue
            rows = self.layout_of(key, value.detach()[:n], layouts)
            if key in policy.deferred_keys:
                deferred_src[key] = rows
                leftover[key] = value.detach()[:n]
            else:
                immediate[key] = rows
        out = StepOutputs(immediate=immediate, leftover=leftover, deferred_chunks=[], layouts=layouts)
        on_device = out.on_device = tuple(k for k, t in immediate.items() if self._engine.is_device(t))
        # Freeze on the compute stream: the copy stream reads the clone,
        # never the static buffers the next CUDA-graph replay overwrites.
        # Not charged to the budget: it lives until its task's host_ready,
        # and every such task holds a staging page (at most staging_depth).
        for key in on_device:
            immediate[key] = immediate[key].clone()
        if deferred_src:
            clone = {k: t.clone() for k, t in deferred_src.items()}
            out.deferred_clone = clone
            out.deferred_ticket = BudgetTicket(nbytes=sum(t.numel() * t.element_size() for t in clone.values()))
            if req_order:
                # One chunk per request. The splits are untracked views: the
                # clone is private to its chunks and no autograd runs on it.
                sizes = [int(num_sched[r]) for r in req_order]
                slot_parts = slots_cpu.unsafe_split_with_sizes(sizes)
                ticket = out.deferred_ticket
                keys = list(clone)
                row_parts = [clone[k].unsafe_split_with_sizes(sizes) for k in keys]
                parts_of = zip(*row_parts)
                out.deferred_chunks = [
                    (rid, WriteChunk(s, dict(zip(keys, parts)), budget=ticket, rows=rows))
                    for rid, s, parts, rows in zip(req_order, slot_parts, parts_of, sizes)
                ]
        # After the clones, on the current stream of their devices (the
        # forward's stream: see docs/cuda.md). None when nothing is on a device.
        out.freeze_event = self._engine.freeze([*immediate.values(), *out.deferred_clone.values()])
        return out

    def step_context(
        self,
        sid: StepId,
        claimed: StepD2HClaim | None,
        split: StepOutputs,
        n: int,
        req_order: list[ReqId],
        spans: dict[ReqId, tuple[int, int]],
        snapshot: dict[str, Any],
        mm_event: DeviceEvent | None,
        policy: ModelCachePolicy,
    ) -> StepContext:
        """What the step's materialize will read: its staging page, its
        requests' rows (``StepRecord``; save adds hits and tenures), its
        keys, the layouts of every known key (hit keys this step did not
        produce too) and its CPU snapshot (save, under the state lock)."""
        return StepContext(
            step_id=sid,
            staging=self._staging,
            d2h=claimed,
            n=n,
            record=StepRecord.of_rows(req_order, spans),
            hidden_cached=policy.needs_full_hidden_states,
            immediate_keys=tuple(split.immediate),
            deferred_keys=tuple(split.deferred_clone),
            layouts=dict(self.known),
            mm_cpu_snapshot=snapshot,
            mm_event=mm_event,
        )

    @staticmethod
    def leftover_snapshot(split: StepOutputs, n: int) -> tuple[dict[str, Any], DeviceEvent | None]:
        """This step's own copy of everything materialize serves from the
        CPU: the leftover mm (``snapshot_leftover_mm_cpu``) and the deferred
        rows already cloned on the CPU, in their per-token shape. Returns the
        snapshot and the CUDA event completing it (None on the CPU). Engine
        thread, outside the state lock."""
        cpu_deferred = {k for k, t in split.deferred_clone.items() if t.device.type == "cpu"}
        snapshot, mm_event = snapshot_leftover_mm_cpu(split.leftover, cpu_deferred, n)
        for key in cpu_deferred:
            layout = split.layouts[key]
            snapshot[key] = split.deferred_clone[key].reshape(n, *layout.trailing)
        return snapshot, mm_event
