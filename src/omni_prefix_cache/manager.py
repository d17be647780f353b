"""The manager facade: request and slot identity, hits, and the step protocol.

The engine calls, on its own thread, once per scheduler step::

    new_step_starts(scheduler_output)      # before finished requests are dropped
    sid = save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=p)
    materialize(sid, req_ids) | discard_step(sid)    # exactly once, any thread

The controller runs the writes (staging, budget, committer); this class
decides what is written, by whom, and what a hit reads. Its tables (slot
occupancy, request tasks, step contexts, pending reads) live under
``_state_lock``. That lock never covers a join, a budget flush, a copy of
step rows, an eager dispatch or a staging claim: each of those can wait on
another thread that may itself need the lock. Publishing a new pool key does
happen under it, together with its occupancy tables.

A second, leaf lock, ``_reads_lock``, covers the pending hit reads (their
preserved copies) and the slot versions a delayed read is checked against.
Writers take it inside ``_state_lock`` (lock order: state, then reads); the
prefetch thread takes only it, so a prefetch never holds the state lock and
can never stall the engine behind a gather.
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from omni_prefix_cache import sync
from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.controller import (
    OmniPrefixCacheController,
    StagingBufferHolder,
    StepD2HClaim,
    TaskState,
    WriteTask,
    _BudgetTicket,
    _WriteChunk,
)
from omni_prefix_cache.copy_engine import CopyEngine, CudaRuntime
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    PrefixCacheConfig,
    ReqId,
    StageCacheOutputs,
    StepId,
    TensorName,
    Tid,
    WriteSchedule,
    is_hidden_key,
)
from omni_prefix_cache.occupancy import ABSENT, IN_TRANSIT, SlotOccupancy
from omni_prefix_cache.planned_read import PlannedRead as _PlannedRead
from omni_prefix_cache.planned_read import PlannedReads
from omni_prefix_cache.planned_read import StagedRows as _StagedRows
from omni_prefix_cache.protocols import SchedulerOutputLike
from omni_prefix_cache.stats import CacheStats
from omni_prefix_cache.step_context import KeyLayout, StepContext, StepState, step_move

logger = logging.getLogger(__name__)

PREFETCH_THREAD_PREFIX = "omni-prefix-cache-prefetch"
_MAX_LISTED = 16


def _listed(values: Sequence[Any] | torch.Tensor) -> str:
    items = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    more = len(items) - _MAX_LISTED
    return f"{items[:_MAX_LISTED]}" + (f" (+{more} more)" if more > 0 else "")


# ---------------------------------------------------------------- input checks
# The facade checks its arguments before it changes anything, so a rejected
# call leaves the manager exactly as it was (the caller may fix and retry).


def _int(what: str, value: Any) -> int:
    """``value`` as an int; bools and floats are refused, not truncated."""
    if isinstance(value, bool):
        raise OmniPrefixCacheInvalidTypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise OmniPrefixCacheInvalidTypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def _count(what: str, value: Any) -> int:
    """``value`` as a non-negative int (see ``_int``)."""
    out = _int(what, value)
    if out < 0:
        raise OmniPrefixCacheInvalidArgumentError(f"{what} must be >= 0, got {out}")
    return out


def _step_id(what: str, value: Any) -> StepId:
    """A step id as save_outputs returned it (an int; never a bool or float)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise OmniPrefixCacheInvalidTypeError(
            f"{what}: step id must be the int save_outputs returned, got {type(value).__name__} {value!r}"
        )
    return value


def _req_id(what: str, value: Any) -> ReqId:
    if not isinstance(value, str):
        raise OmniPrefixCacheInvalidTypeError(f"{what}: request id must be a str, got {type(value).__name__} {value!r}")
    return value


def _req_ids(what: str, value: Any) -> list[ReqId]:
    """A collection of request ids (None: none). A bare str is refused: it
    would be read one character per request."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise OmniPrefixCacheInvalidTypeError(
            f"{what} must be a collection of request ids, got {type(value).__name__} {value!r}"
        )
    return [_req_id(what, r) for r in value]


def _check_device(what: str, value: torch.Tensor) -> None:
    """Rows must live where the cache can copy them from: the CPU, or CUDA
    when CUDA is available."""
    kind = value.device.type
    if kind == "cpu" or (kind == "cuda" and torch.cuda.is_available()):
        return
    raise OmniPrefixCacheInvalidArgumentError(
        f"{what} is on device {value.device}; the cache copies from the CPU"
        + (" or CUDA" if torch.cuda.is_available() else " (CUDA is not available)")
    )


def _check_devices(what: str, value: Any) -> None:
    """``_check_device`` for every tensor in a (nested) mm entry."""
    if isinstance(value, torch.Tensor):
        _check_device(what, value)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_devices(f"{what}[{k!r}]", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_devices(f"{what}[{i}]", v)


# ---------------------------------------------------------------- module helpers


def _per_row(values: list[int], counts: list[int], total: int) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times, as int64.

    Not ``torch.repeat_interleave``: its CPU kernel opens a parallel region
    with grain size 1 for any size, which costs milliseconds whenever the
    host's cores are busy. A decode step (one row per request) is a plain
    tensor; few long runs are one fill per run; otherwise a Python repeat.
    """
    if total == len(values):
        return torch.tensor(values, dtype=torch.int64)
    if total > 32 * len(values):
        return torch.cat([torch.full((c,), v, dtype=torch.int64) for v, c in zip(values, counts)])
    return torch.tensor(
        list(itertools.chain.from_iterable(itertools.repeat(v, c) for v, c in zip(values, counts))), dtype=torch.int64
    )


def _query_tokens(req: Any, computed: int, scheduled: int) -> int:
    """Prompt tokens a new request looked up in the prefix cache (vLLM's
    ``prompt_token_ids`` when present, else computed plus first-step tokens)."""
    prompt = getattr(req, "prompt_token_ids", None)
    try:
        return len(prompt) if prompt is not None else computed + scheduled
    except TypeError:
        return computed + scheduled


def _is_step_token_tensor(value: Any, n: int, padded: int) -> bool:
    """True for a token-major step tensor: ndim >= 2 and a first dim equal
    to the unpadded (``n``) or the CUDA-graph padded token count. Only those
    become pool keys."""
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and int(value.shape[0]) in (n, padded)


def _snapshot_leftover_mm_cpu(mm: Mapping[str, Any], skip_keys: set[str], n: int) -> tuple[dict[str, Any], Any]:
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


def _payload_for_request(value: Any, start: int, end: int, n: int) -> Any:
    """One request's share of a leftover snapshot entry: tensors whose first
    dim is the step's token count are sliced to the request's rows; lists
    and tuples pass through whole (tensors cloned), dicts recurse, other
    tensors are request-invariant and cloned so callers never alias."""
    if isinstance(value, torch.Tensor):
        if value.ndim >= 1 and int(value.shape[0]) == n:
            return value[start:end].clone()
        return value.clone()
    if isinstance(value, dict):
        return {k: _payload_for_request(v, start, end, n) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [v.clone() if isinstance(v, torch.Tensor) else v for v in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


# ---------------------------------------------------------------- tables


@dataclass(eq=False)
class _PendingHit:
    """A prefix hit registered at new_step_starts, handed to its save."""

    req_id: ReqId
    num_computed: int
    block_ids: list[int]
    slots: torch.Tensor
    num_scheduled: int
    futures: dict[TensorName, Future[torch.Tensor]] = field(default_factory=dict)
    refs: dict[TensorName, _PlannedRead] = field(default_factory=dict)


@dataclass(eq=False)
class _TaskRecord:
    """What the manager must remember about a write until it is drained:
    the task, whose it is, and which (keys, slots) it maps."""

    task: WriteTask
    req_id: ReqId
    parts: list[tuple[tuple[TensorName, ...], torch.Tensor]]


class _RequestTasks:
    """Per-request write bookkeeping (manager tables, under the state lock).

    ``tasks[req]``: tids of the request's undrained writes, in opening order.
    ``deferred[req]``: its open JOIN_ON_FINISH write (chunks append to it).
    ``opened[req]``: how many writes the request has opened (``write_n``).
    An entry lives while the request is live or has undrained writes
    (``drop_if_idle``), so every table is bounded by the working set, not
    by the requests ever seen.
    """

    def __init__(self) -> None:
        self.tasks: dict[ReqId, dict[Tid, None]] = {}
        self.deferred: dict[ReqId, WriteTask] = {}
        self.opened: dict[ReqId, int] = {}

    def open(self, req_id: ReqId, tid: Tid) -> int:
        """Record a new write of ``req_id``; returns its ``write_n``."""
        n = self.opened.get(req_id, 0) + 1
        self.opened[req_id] = n
        self.tasks.setdefault(req_id, {})[tid] = None
        return n

    def forget(self, req_id: ReqId, task: WriteTask) -> None:
        """The write was drained (written or failed)."""
        tids = self.tasks.get(req_id)
        if tids is not None:
            tids.pop(task.tid, None)
            if not tids:
                del self.tasks[req_id]
        if self.deferred.get(req_id) is task:
            del self.deferred[req_id]

    def drop_if_idle(self, req_id: ReqId) -> None:
        """Forget ``req_id`` (no longer live) once it has no undrained write;
        a later request reusing the id counts its writes from 1 again."""
        if req_id not in self.tasks:
            self.opened.pop(req_id, None)
            self.deferred.pop(req_id, None)


@dataclass(eq=False)
class _SchedSnapshot:
    """What save needs from the scheduler output new_step_starts saw."""

    num_scheduled: dict[ReqId, int]


@dataclass(eq=False)
class _StepOutputs:
    """One save's outputs, split by how they travel (``_split_step_outputs``)."""

    immediate: dict[TensorName, torch.Tensor]  # 2-D rows [0:n): staging copy, JOIN_NEXT_STEP
    leftover: dict[TensorName, Any]  # everything copied to CPU for this step's materialize
    deferred_chunks: list[tuple[ReqId, _WriteChunk]]  # one per request, viewing the deferred clone
    deferred_clone: dict[TensorName, torch.Tensor] = field(default_factory=dict)  # 2-D clone [0:n)
    # The GPU-byte budget charges only the deferred clone, on every engine
    # (the immediate clone is bounded by the staging pages; docs/cuda.md).
    deferred_ticket: _BudgetTicket | None = None
    freeze_event: Any = None
    layouts: dict[TensorName, KeyLayout] = field(default_factory=dict)


# One planned hit read waiting for the prefetch thread.
_HitJob = tuple[_PendingHit, TensorName, _PlannedRead]


# ---------------------------------------------------------------- manager


class OmniPrefixCacheManager:
    """Full-prompt hidden states and token-major mm outputs for one stage.

    ``view`` is the group view over vLLM's input batch (``block_size``,
    ``batch_req_ids()``, ``step_slots_cpu(req_ids, num_scheduled)``); it is
    read only on the engine thread (new_step_starts / save_outputs).
    ``eager``: None picks eager on machines without CUDA; False runs the
    threaded committer (CPU copy engine without CUDA). ``committer`` is
    passed to the controller: "thread" in production; "manual" and
    "on_demand" let a test step the committer itself.
    """

    def __init__(
        self,
        config: PrefixCacheConfig,
        view: Any,
        *,
        eager: bool | None = None,
        committer: Literal["thread", "manual", "on_demand"] = "thread",
        engine: CopyEngine | None = None,
    ) -> None:
        view_bs = getattr(view, "block_size", None)
        if view_bs is not None and int(view_bs) != int(config.block_size):
            raise OmniPrefixCacheUnmatchError(
                f"group view block_size {view_bs} does not match PrefixCacheConfig.block_size {config.block_size}"
            )
        self._config = config
        self._view = view
        self._block_size = int(config.block_size)
        self._pool = PrefixBlockPool(config)
        # ``engine``: where rows leave the device (default: CUDA lanes when
        # CUDA exists and eager is off, else host copies). A test seam.
        self._controller = OmniPrefixCacheController(
            self._pool, config, eager=eager, committer=committer, engine=engine
        )
        self._policy = ModelCachePolicy()
        self._state_lock = sync.Lock()
        self._reads_lock = sync.Lock()  # leaf; see the module docstring
        self._slot_status = SlotOccupancy(
            self._pool.num_slots, on_reassign=self._on_reassign, on_reuse=self._preserve_pending_reads
        )
        self._request_tasks = _RequestTasks()
        self._records: dict[Tid, _TaskRecord] = {}
        self._join_next_step_tids: list[Tid] = []
        self._step_ctxs: dict[StepId, StepContext] = {}
        self._next_step_id = 1
        self._tids = itertools.count(1)
        self._live: set[ReqId] = set()
        self._pending_sched: _SchedSnapshot | None = None
        self._pending_hits: dict[ReqId, _PendingHit] = {}
        # Planned hit reads, moved by the planned_read spec under _reads_lock.
        self._reads = PlannedReads(self._pool)
        self._pending_reads: set[_PlannedRead] = self._reads.pending
        self._layouts: dict[TensorName, KeyLayout] = {}
        self._failure: OmniPrefixCacheWriteFailedError | None = None  # the first, sticky
        # Operator counters (state lock); see stats().
        self._counters: Counter[str] = Counter()
        self._closed = False
        self._prefetch = sync.Executor(max_workers=2, thread_name_prefix=PREFETCH_THREAD_PREFIX)

    # ============================================================ facade

    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Set the model's cache policy (hidden or not, deferred mm keys).
        Engine thread, before or between steps; takes the state lock."""
        self._check_open()
        if not isinstance(policy, ModelCachePolicy):
            raise OmniPrefixCacheInvalidTypeError(
                f"register_policy needs a ModelCachePolicy, got {type(policy).__name__}"
            )
        with self._state_lock:
            self._policy = policy

    def new_step_starts(self, scheduler_output: SchedulerOutputLike) -> None:
        """Start one scheduler step (engine thread, before finished requests
        are dropped): publish finished writes, escalate the writes of
        finished/aborted requests, register prefix hits of requests that are
        not live and start gathering them on the prefetch thread.

        Validate, then mutate: a bad argument (a request id that is not a
        str, a negative or non-int count, a hit that is not block aligned or
        lacks group-0 block ids) raises OmniPrefixCacheInvalidArgumentError
        before anything changes, finished requests included; the caller
        fixes the output and calls again. Raises the write-failed error on a
        sticky failure and the shutdown error after shutdown. Takes the
        state lock twice; escalation (which runs eager writes inline)
        happens between, outside it.
        """
        self._check_open()
        self._raise_if_failed()
        finished = _req_ids("finished_req_ids", getattr(scheduler_output, "finished_req_ids", None))
        new_reqs = self._new_requests(getattr(scheduler_output, "scheduled_new_reqs", None))
        raw_sched = getattr(scheduler_output, "num_scheduled_tokens", None)
        if raw_sched is None:
            raw_sched = {}
        if not isinstance(raw_sched, Mapping):
            raise OmniPrefixCacheInvalidTypeError(
                f"num_scheduled_tokens must be a mapping of request id to count, got {type(raw_sched).__name__}"
            )
        num_sched = {
            _req_id("num_scheduled_tokens", r): _count(f"num_scheduled_tokens[{r!r}]", k) for r, k in raw_sched.items()
        }
        escalate: list[Tid] = []
        new_hits: list[_PendingHit] = []
        with self._state_lock:
            gone = set(finished)
            # Validate every hit before touching any table: a bad hit must
            # leave nothing half-registered behind.
            candidates: list[tuple[ReqId, int, list[int]]] = []
            queried = query_tokens = 0
            for rid, computed, block_ids, req in new_reqs:
                if rid in self._live and rid not in gone:
                    continue  # a live request re-entering the new list is not a hit
                queried += 1
                query_tokens += _query_tokens(req, computed, num_sched.get(rid, 0))
                if computed > 0:
                    candidates.append((rid, computed, self._hit_blocks(rid, computed, block_ids)))
            for rid in finished:
                self._live.discard(rid)
                self._request_tasks.deferred.pop(rid, None)
                stale = self._pending_hits.pop(rid, None)
                if stale is not None:
                    self._drop_hit_locked(stale)
                for tid in self._request_tasks.tasks.get(rid, ()):
                    rec = self._records.get(tid)
                    if rec is not None and not rec.task.is_terminal:
                        escalate.append(tid)
                self._request_tasks.drop_if_idle(rid)
            for rid, *_ in new_reqs:
                self._live.add(rid)
            # A step with nothing scheduled has no save: the next snapshot
            # replaces it. Its hits (if any) stay pending for the next save.
            self._pending_sched = _SchedSnapshot(num_sched)
            for rid, computed, blocks in candidates:
                hit = _PendingHit(
                    req_id=rid,
                    num_computed=computed,
                    block_ids=blocks,
                    slots=self._block_slots(blocks),
                    num_scheduled=num_sched.get(rid, 0),
                )
                old = self._pending_hits.pop(rid, None)
                if old is not None:
                    self._drop_hit_locked(old)
                self._pending_hits[rid] = hit
                new_hits.append(hit)
        if escalate:
            # Abort too: the block hashes are public, the rows must land.
            self._controller.escalate(escalate)
        jobs: list[_HitJob] = []
        with self._state_lock:
            self._counters["query_requests"] += queried
            self._counters["query_tokens"] += query_tokens
            self._counters["hit_requests"] += len(new_hits)
            self._counters["hit_tokens"] += sum(hit.num_computed for hit in new_hits)
            self._commit_drained_writes()
            for hit in new_hits:
                jobs.extend(self._plan_hit_locked(hit, at_save=False))
        self._start_prefetch(jobs)

    @staticmethod
    def _new_requests(raw: Any) -> list[tuple[ReqId, int, Any, Any]]:
        """``(req_id, num_computed_tokens, block_ids, record)`` of each
        scheduled new request, type-checked (the hit itself is checked under
        the lock)."""
        if raw is None:
            return []
        if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Iterable):
            raise OmniPrefixCacheInvalidTypeError(
                f"scheduled_new_reqs must be a list of new-request records, got {type(raw).__name__}"
            )
        out: list[tuple[ReqId, int, Any, Any]] = []
        for req in raw:
            if not hasattr(req, "req_id"):
                raise OmniPrefixCacheInvalidTypeError(
                    f"scheduled_new_reqs holds a {type(req).__name__} without a req_id: {req!r}"
                )
            rid = _req_id("scheduled_new_reqs", req.req_id)
            computed = getattr(req, "num_computed_tokens", 0)
            computed = _count(f"num_computed_tokens of request {rid!r}", 0 if computed is None else computed)
            out.append((rid, computed, getattr(req, "block_ids", None), req))
        return out

    def save_outputs(
        self,
        hidden: torch.Tensor | None,
        mm: Mapping[str, Any] | None,
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
    ) -> StepId:
        """Save one forward's outputs; returns the step id to materialize or
        discard exactly once. Engine thread.

        Joins the previous step's JOIN_NEXT_STEP writes, claims a staging
        page and copies the immediate rows into it, reserves the deferred
        clone's budget, then (under the state lock) registers this step's
        writes, maps their slots and plans same-step hits; the eager writes
        run after the lock is released.

        Validate, then mutate: bad input (no new_step_starts, a non-int or
        negative token count, a tensor of the wrong type, shape, dtype or
        device, a slot mapping that does not cover the step, too few hidden
        rows, an oversized step, a key changing dtype/width) raises
        OmniPrefixCacheInvalidArgumentError before the step's scheduler
        snapshot and hits are taken, so a corrected call may follow. Later
        failures raise the write-failed error (sticky), a join timeout, or
        the staging timeout error naming the unconsumed steps; no staging
        holder or budget is left behind by a failed save.
        """
        self._check_open()
        self._raise_if_failed()
        n = _count("save_outputs: num_tokens_unpadded", num_tokens_unpadded)
        padded = _count("save_outputs: num_tokens_padded", num_tokens_padded)
        with self._state_lock:
            # Engine thread only: nothing else takes a snapshot or a step id.
            sched = self._pending_sched
            sid = self._next_step_id
        if sched is None:
            raise OmniPrefixCacheUnmatchError(f"save_outputs (step {sid}) without a new_step_starts before it")
        if padded < n:
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): num_tokens_padded={padded} < num_tokens_unpadded={n}"
            )
        self._check_step_tensors(sid, hidden, mm)
        req_order, spans, slots = self._step_layout(sid, sched, n)
        num_sched = {r: spans[r][1] for r in req_order}
        query_start = {r: spans[r][0] for r in req_order}
        split = self._split_step_outputs(
            hidden,
            mm,
            n,
            padded,
            slots_cpu=slots,
            req_order=req_order,
            num_sched=num_sched,
            query_start=query_start,
        )
        if split.immediate and n > self._config.staging_capacity_tokens:
            raise OmniPrefixCacheInvalidArgumentError(
                f"step {sid} has {n} tokens; staging capacity is {self._config.staging_capacity_tokens} "
                "(size staging_capacity_tokens to max_num_batched_tokens)"
            )
        with self._state_lock:
            self._pending_sched = None
            hits, self._pending_hits = self._pending_hits, {}
            self._next_step_id += 1
        claimed: StepD2HClaim | None = None
        reserved: list[_BudgetTicket] = []
        registered: list[WriteTask] = []
        published = False
        registering = False  # past this point a failed save cannot be retried
        try:
            # Deferred rows already cloned on the CPU are this step's own
            # snapshot too; everything else leftover is copied now.
            cpu_deferred = {k for k, t in split.deferred_clone.items() if t.device.type == "cpu"}
            snapshot, mm_event = _snapshot_leftover_mm_cpu(split.leftover, cpu_deferred, n)
            for key in cpu_deferred:
                layout = split.layouts[key]
                snapshot[key] = split.deferred_clone[key].reshape(n, *layout.trailing)

            # Save barrier: a slot this step may reuse must be pool-complete.
            previous = self._join_next_step_tids
            if previous:
                self._controller.join(previous)
                self._join_next_step_tids = []

            claimed = self._controller.stage_step_host(
                split.immediate, n, split.freeze_event, StagingBufferHolder.for_step(sid)
            )
            ticket = split.deferred_ticket
            if ticket is not None:
                self._controller.reserve(ticket.nbytes)
                reserved.append(ticket)
            # Pay for new slabs here; publish them under the lock below.
            new_slabs = {
                key: self._pool.new_slab(layout.dtype, layout.width)
                for key, layout in split.layouts.items()
                if not self._pool.has_key(key)
            }

            with self._state_lock:
                registering = True
                # First, before any table changes: a failure here leaves
                # nothing registered.
                self._commit_drained_writes()
                for key, slab in new_slabs.items():
                    if not self._pool.has_key(key):
                        self._pool.install_key(key, slab)
                    self._slot_status.add_key(key)
                    self._layouts.setdefault(key, split.layouts[key])
                immediate = self._register_immediate_locked(sid, split, claimed, req_order, spans, slots, registered)
                deferred_tids = self._register_deferred_locked(split, registered)
                with self._reads_lock:
                    # Version bumps and preserved copies change together.
                    self._map_step_locked(split, slots, req_order, spans, immediate, deferred_tids)
                self._replan_same_step_hits_locked(hits, slots)
                ctx = StepContext(
                    step_id=sid,
                    controller=self._controller,
                    state=step_move(sid, StepState.UNSAVED, "save").dest,
                    d2h=claimed,
                    n=n,
                    spans=spans,
                    order=req_order,
                    sizes=[spans[r][1] for r in req_order],
                    hidden_cached=self._policy.needs_full_hidden_states,
                    immediate_keys=tuple(split.immediate),
                    deferred_keys=tuple(split.deferred_clone),
                    layouts=dict(self._layouts),  # hit keys this step did not produce too
                    mm_cpu_snapshot=snapshot,
                    mm_event=mm_event,
                )
                jobs: list[_HitJob] = []
                for rid, hit in hits.items():
                    if rid in spans:
                        hit.num_scheduled = spans[rid][1]
                    jobs.extend(self._plan_hit_locked(hit, at_save=True))
                    ctx.hits[rid] = (hit.num_computed, list(hit.block_ids))
                    ctx.hit_prefetch[rid] = hit.futures
                    ctx.hit_refs[rid] = hit.refs
                    if rid not in spans:
                        ctx.spans[rid] = (0, 0)
                self._step_ctxs[sid] = ctx
                self._join_next_step_tids = [t.tid for t in immediate]
                self._counters["steps_saved"] += 1
                self._counters["tokens_saved"] += n
                published = True
            if reserved:
                # A clone no task views (a step without scheduled requests)
                # is uncharged now; a pinned ticket refunds nothing here.
                self._controller.refund_unpinned(reserved)
            # Eager: copy + pool write inline, outside the lock.
            self._controller.dispatch(immediate)
        except BaseException as exc:
            error = self._save_error(sid, exc, registered, published)
            self._abandon_save(
                sid, claimed, reserved, registered, published, hits, error, None if registering else sched
            )
            if error is exc:
                raise
            raise error from exc
        self._start_prefetch(jobs)
        return sid

    def materialize(self, step_id: StepId, req_ids: Sequence[ReqId]) -> StageCacheOutputs:
        """Consume ``step_id`` and return each request's merged outputs:
        hit prefix rows (the prefetched buffer) followed by this step's rows
        for every pool key, plus each request's share of the leftover mm.

        Any thread, exactly once per step id (or discard_step instead). The
        step's staging holder is released whatever happens. Raises
        OmniPrefixCacheUnmatchError for an unknown or consumed step id, ids
        outside the save snapshot, a sticky write failure, or a hit that
        cannot be served (absent hidden rows, a reassigned delayed read, a
        failed pool read). A step id that is not an int or ``req_ids`` that
        is not a collection of str raise the invalid-type error without
        consuming the step; after shutdown, the shutdown error.
        """
        _step_id("materialize", step_id)
        req_ids = _req_ids(f"materialize(step {step_id}): req_ids", req_ids)
        self._check_open()
        with self._state_lock:
            ctx, move = self._consume_locked(step_id, "materialize")
        try:
            return self._materialize(ctx, req_ids)
        finally:
            self._finish_consume(ctx, move)

    def discard_step(self, step_id: StepId) -> None:
        """Consume ``step_id`` without building outputs (any thread, exactly
        once). Releases its staging holder and drops its hit prefetches.
        Works after a write failure. Raises for an unknown or consumed id,
        and after shutdown (which already released every open step)."""
        _step_id("discard_step", step_id)
        self._check_open()
        with self._state_lock:
            ctx, move = self._consume_locked(step_id, "discard")
        self._finish_consume(ctx, move)

    def stats(self) -> dict[str, Any]:
        """Metrics an operator would export, as a dict (any thread; takes the
        state lock briefly): every :class:`CacheStats` field by name, plus
        the historical keys: prefix queries and hits (requests, tokens), steps saved /
        materialized / discarded, tokens saved, rows committed to the pool
        (rows x keys), failed writes, live requests, open steps, and the
        controller's snapshot (tasks by state, queue depths, staged bytes,
        staging holders by kind). A write failure the committer recorded
        counts at once (``failed_writes``, ``sticky_failure``), before any
        serving entry drains it."""
        out = self._raw_stats()
        out.update(CacheStats.from_stats(out).as_dict())
        return out

    def stats_snapshot(self) -> CacheStats:
        """``stats()`` as a typed, frozen snapshot (Prometheus-style names)."""
        return CacheStats.from_stats(self._raw_stats())

    def _raw_stats(self) -> dict[str, Any]:
        """The historical ``stats()`` keys; CacheStats is derived from them."""
        names = (
            "query_requests",
            "query_tokens",
            "hit_requests",
            "hit_tokens",
            "steps_saved",
            "steps_materialized",
            "steps_discarded",
            "tokens_saved",
            "rows_committed",
            "failed_writes",
        )
        with self._state_lock:
            # Report a failure the committer recorded but no entry drained yet.
            failed = self._controller.drain_failed()
            if failed:
                self._note_failures_locked(failed)
            out: dict[str, Any] = {name: self._counters.get(name, 0) for name in names}
            out["live_requests"] = len(self._live)
            out["open_steps"] = len(self._step_ctxs)
            out["sticky_failure"] = self._failure is not None
        key_bytes = self._pool.key_nbytes()
        out["pool_host_bytes"] = sum(key_bytes.values())  # unpinned
        out.update(self._controller.stats())
        out["pool_key_bytes"] = key_bytes
        return out

    def shutdown(self) -> None:
        """Stop the prefetch thread and the controller (queued writes land
        first; unfinished ones fail). Steps not yet consumed are released
        and their hit reads dropped. Later facade calls (stats aside) raise
        the shutdown error; a materialize racing shutdown returns exact rows
        or raises it. Idempotent."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            open_steps = list(self._step_ctxs.values())
            self._step_ctxs.clear()
            for hit in self._pending_hits.values():
                self._drop_hit_locked(hit)
            self._pending_hits.clear()
            self._pending_sched = None
        self._prefetch.shutdown(wait=False, cancel_futures=True)
        for ctx in open_steps:
            # Cleanup must not raise: a refused release is logged, the rest go on.
            try:
                self._finish_consume(ctx, step_move(ctx.step_id, ctx.state, "discard"))
            except Exception:
                logger.exception("omni prefix cache: releasing step %s at shutdown failed", ctx.step_id)
        self._controller.shutdown()

    # ============================================================ save helpers

    def _check_step_tensors(self, sid: StepId, hidden: Any, mm: Any) -> None:
        """Type and device checks of a save's outputs (shapes are checked
        where they are routed)."""
        if hidden is not None:
            if not isinstance(hidden, torch.Tensor):
                raise OmniPrefixCacheInvalidTypeError(
                    f"save_outputs (step {sid}): hidden states must be a tensor or None, got {type(hidden).__name__}"
                )
            _check_device(f"save_outputs (step {sid}): hidden states", hidden)
        if mm is None:
            return
        if not isinstance(mm, Mapping):
            raise OmniPrefixCacheInvalidTypeError(
                f"save_outputs (step {sid}): multimodal outputs must be a mapping, got {type(mm).__name__}"
            )
        for key, value in mm.items():
            if not isinstance(key, str):
                raise OmniPrefixCacheInvalidTypeError(
                    f"save_outputs (step {sid}): multimodal output names must be str, got {type(key).__name__} {key!r}"
                )
            _check_devices(f"save_outputs (step {sid}): mm output {key!r}", value)

    def _step_layout(
        self, sid: StepId, sched: _SchedSnapshot, n: int
    ) -> tuple[list[ReqId], dict[ReqId, tuple[int, int]], torch.Tensor]:
        """Request order, per-request (start, rows) and slot ids of the step,
        read from the group view. Raises if they do not cover ``n`` tokens."""
        num_sched = sched.num_scheduled
        order = [r for r in self._view.batch_req_ids() if num_sched.get(r, 0) > 0]
        spans: dict[ReqId, tuple[int, int]] = {}
        start = 0
        for rid in order:
            if rid in spans:
                raise OmniPrefixCacheInvalidArgumentError(
                    f"save_outputs (step {sid}): request {rid!r} twice in the batch"
                )
            rows = num_sched[rid]
            spans[rid] = (start, rows)
            start += rows
        unbatched = sorted(r for r, k in num_sched.items() if k > 0 and r not in spans)
        if unbatched or start != n:
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): the slot mapping covers {start} scheduled tokens of batch requests "
                f"but the step has {n} tokens (scheduled outside the batch: {_listed(unbatched)})"
            )
        slots = self._view.step_slots_cpu(order, num_sched) if order else torch.empty((0,), dtype=torch.int64)
        if not isinstance(slots, torch.Tensor) or slots.ndim != 1 or int(slots.numel()) != n:
            got = tuple(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): slot mapping {got} does not cover the step's {n} tokens"
            )
        slots = slots.to(torch.int64)
        if n and (int(slots.min()) < 0 or int(slots.max()) >= self._pool.num_slots):
            bad = slots[(slots < 0) | (slots >= self._pool.num_slots)]
            raise OmniPrefixCacheInvalidArgumentError(
                f"save_outputs (step {sid}): slots {_listed(bad)} outside [0, {self._pool.num_slots})"
            )
        return order, spans, slots

    def _layout_of(self, key: TensorName, rows: torch.Tensor, layouts: dict[TensorName, KeyLayout]) -> torch.Tensor:
        """Rows as a 2-D ``(n, width)`` tensor; records the key's layout and
        raises if it differs from the layout the key's slab was opened with."""
        trailing = tuple(int(d) for d in rows.shape[1:])
        width = 1
        for d in trailing:
            width *= d
        layout = KeyLayout(dtype=rows.dtype, width=width, trailing=trailing)
        known = self._layouts.get(key)
        if known is not None and known != layout:
            raise OmniPrefixCacheInvalidArgumentError(
                f"key {key!r}: step rows are {rows.dtype} {trailing}, the pool holds {known.dtype} {known.trailing}"
            )
        if width <= 0:
            raise OmniPrefixCacheInvalidArgumentError(f"key {key!r}: token rows of shape {trailing} hold no values")
        layouts[key] = layout
        return rows.reshape(int(rows.shape[0]), width)

    def _split_step_outputs(
        self,
        hidden: torch.Tensor | None,
        mm: Mapping[str, Any] | None,
        n: int,
        padded: int,
        *,
        slots_cpu: torch.Tensor,
        req_order: Sequence[ReqId],
        num_sched: Mapping[ReqId, int],
        query_start: Mapping[ReqId, int],
    ) -> _StepOutputs:
        """Route one step's outputs. Immediate: hidden (if cached) and
        token-major mm not marked deferred, as ``[:n]`` rows. Deferred:
        token-major deferred keys, cloned ``[:n]`` once for the whole step
        and cut into one chunk per request (sharing one budget ticket); also
        leftover, for this step's own materialize. Leftover: everything else.
        Engine thread, outside the state lock (it clones). Raises on too few
        hidden rows, a reserved mm name or a key changing dtype/width."""
        policy = self._policy
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
            immediate[HIDDEN_KEY] = self._layout_of(HIDDEN_KEY, hidden.detach()[:n], layouts)
        if mm is None:
            mm = {}
        if not isinstance(mm, Mapping):
            raise OmniPrefixCacheInvalidTypeError(f"multimodal outputs must be a mapping, got {type(mm).__name__}")
        for key, value in mm.items():
            if is_hidden_key(key):
                raise OmniPrefixCacheInvalidArgumentError(f"mm output uses the reserved hidden key name {key!r}")
            if not _is_step_token_tensor(value, n, padded):
                leftover[key] = value
                continue
            rows = self._layout_of(key, value.detach()[:n], layouts)
            if key in policy.deferred_keys:
                deferred_src[key] = rows
                leftover[key] = value.detach()[:n]
            else:
                immediate[key] = rows
        out = _StepOutputs(immediate=immediate, leftover=leftover, deferred_chunks=[], layouts=layouts)
        on_device = [k for k, t in immediate.items() if self._controller.is_device(t)]
        # Freeze on the compute stream: the copy stream reads the clone,
        # never the static buffers the next CUDA-graph replay overwrites.
        # Not charged to the budget: it lives until its task's host_ready,
        # and every such task holds a staging page (at most staging_depth).
        for key in on_device:
            immediate[key] = immediate[key].clone()
        if deferred_src:
            clone = {k: t.clone() for k, t in deferred_src.items()}
            out.deferred_clone = clone
            out.deferred_ticket = _BudgetTicket(nbytes=sum(t.numel() * t.element_size() for t in clone.values()))
            if req_order:
                sizes = [int(num_sched[r]) for r in req_order]
                slot_parts = torch.split(slots_cpu, sizes)
                row_parts = {k: torch.split(t, sizes) for k, t in clone.items()}
                for i, rid in enumerate(req_order):
                    chunk = _WriteChunk(
                        slots_cpu=slot_parts[i],
                        tensors={k: parts[i] for k, parts in row_parts.items()},
                        budget=out.deferred_ticket,
                    )
                    out.deferred_chunks.append((rid, chunk))
        # After the clones, on the current stream of their devices (the
        # forward's stream: see docs/cuda.md). None when nothing is on a device.
        out.freeze_event = self._controller.freeze([*immediate.values(), *out.deferred_clone.values()])
        return out

    def _register_immediate_locked(
        self,
        sid: StepId,
        split: _StepOutputs,
        claimed: StepD2HClaim,
        req_order: list[ReqId],
        spans: dict[ReqId, tuple[int, int]],
        slots: torch.Tensor,
        registered: list[WriteTask],
    ) -> list[WriteTask]:
        """One JOIN_NEXT_STEP task per request, its host rows viewing the
        staging page, bound to the page and queued (not dispatched)."""
        if not split.immediate or not req_order:
            return []
        sizes = [spans[r][1] for r in req_order]
        slot_parts = torch.split(slots, sizes)
        host_parts = {k: torch.split(v, sizes) for k, v in claimed.views.items()}
        ctrl = self._controller
        frozen = {k: torch.split(t, sizes) for k, t in split.immediate.items() if ctrl.is_device(t)}
        keys = tuple(split.immediate)
        page = claimed.staging_slot
        tasks: list[WriteTask] = []
        for i, rid in enumerate(req_order):
            tid = next(self._tids)
            chunk = _WriteChunk(
                slots_cpu=slot_parts[i],
                tensors={k: parts[i] for k, parts in frozen.items()},
                host={k: parts[i] for k, parts in host_parts.items()},
            )
            task = WriteTask(
                tid=tid,
                req_id=rid,
                write_n=self._request_tasks.open(rid, tid),
                schedule=WriteSchedule.JOIN_NEXT_STEP,
                chunks=[chunk],
                freeze_event=split.freeze_event,
                staging_slot=page,
                step_d2h_event=claimed.event,
            )
            self._records[tid] = _TaskRecord(task, rid, [(keys, slot_parts[i])])
            tasks.append(task)
        # One controller lock and one staging lock for the whole step.
        # Registered first (queued, not dispatched: the committer cannot see
        # them yet), so a failed bind is cleaned up by failing the tasks.
        registered.extend(tasks)
        ctrl.register_many(tasks, queued=True)
        ctrl.staging_bind_many(page, [StagingBufferHolder.for_task(t.tid) for t in tasks])
        return tasks

    def _register_deferred_locked(self, split: _StepOutputs, registered: list[WriteTask]) -> list[Tid]:
        """Append each request's deferred chunk to its open JOIN_ON_FINISH
        write, or open a new one when there is none, it is closed (copy
        claimed: budget flush, escalate) or it already lost a slot the chunk
        would re-add (the old write would skip the fresh rows). Returns the
        owning tid per chunk, in request order."""
        owners: list[Tid] = []
        ticket = split.deferred_ticket
        ctrl = self._controller
        keys = tuple(split.deferred_clone)
        for rid, chunk in split.deferred_chunks:
            task = self._request_tasks.deferred.get(rid)
            if task is not None and (
                task.reassigned_intersects(chunk) or ctrl.append_chunk(task, chunk, split.freeze_event) is not None
            ):
                task = None
            if task is None:
                tid = next(self._tids)
                task = WriteTask(
                    tid=tid,
                    req_id=rid,
                    write_n=self._request_tasks.open(rid, tid),
                    schedule=WriteSchedule.JOIN_ON_FINISH,
                    chunks=[chunk],
                    freeze_event=split.freeze_event,
                )
                self._records[tid] = _TaskRecord(task, rid, [(keys, chunk.slots_cpu)])
                if ticket is not None:
                    ctrl.pin_budget(ticket, tid)
                ctrl.register(task, queued=False)
                registered.append(task)
                self._request_tasks.deferred[rid] = task
            else:
                self._records[task.tid].parts.append((keys, chunk.slots_cpu))
                if ticket is not None:
                    ctrl.pin_budget(ticket, task.tid)
            owners.append(task.tid)
        return owners

    def _map_step_locked(
        self,
        split: _StepOutputs,
        slots: torch.Tensor,
        req_order: list[ReqId],
        spans: dict[ReqId, tuple[int, int]],
        immediate: list[WriteTask],
        deferred_tids: list[Tid],
    ) -> None:
        """The step becomes the tenant of its slots (occupancy coupling
        ``take_tenancy``), one move per key for the whole step: a key the
        step writes goes IN_TRANSIT, owned by its request's write; every
        other open key of those slots is reset to ABSENT, so it can never
        serve a previous tenant's rows."""
        if not req_order:
            return
        sizes = [spans[r][1] for r in req_order]
        writes: dict[TensorName, torch.Tensor] = {}
        if immediate:
            owners = _per_row([t.tid for t in immediate], sizes, int(slots.numel()))
            writes.update(dict.fromkeys(split.immediate, owners))
        if deferred_tids:
            owners = _per_row(deferred_tids, sizes, int(slots.numel()))
            writes.update(dict.fromkeys(split.deferred_clone, owners))
        self._slot_status.take_tenancy(slots, writes)

    def _replan_same_step_hits_locked(self, hits: dict[ReqId, _PendingHit], slots: torch.Tensor) -> None:
        """A hit planned at new_step_starts whose slots this very step maps
        is a same-step hit on a reused block: vLLM dropped the old block
        hash before reallocating it, so the hit means the rows this step
        computes, not the old tenant's (which the reuse just preserved for
        it). The step is the new tenant of every key of those slots (keys it
        does not write were reset), so drop the plans of every key; they are
        re-planned against this step's tables right after (state lock held)."""
        if int(slots.numel()) == 0:
            return
        step_slots: set[int] | None = None
        for hit in hits.values():
            stale = list(hit.futures)
            if not stale:
                continue
            if step_slots is None:
                step_slots = set(slots.tolist())
            if step_slots.isdisjoint(hit.slots.tolist()):
                continue
            for key in stale:
                fut = hit.futures.pop(key)
                ref = hit.refs.pop(key, None)
                # A prefetch already running forgets its own read; its
                # result is simply never looked at.
                if fut.cancel() and ref is not None:
                    self._forget_read(ref)

    def _abandon_save(
        self,
        sid: StepId,
        claimed: StepD2HClaim | None,
        reserved: list[_BudgetTicket],
        registered: list[WriteTask],
        published: bool,
        hits: dict[ReqId, _PendingHit],
        error: BaseException,
        retry: _SchedSnapshot | None,
    ) -> None:
        """Undo a failed save: no step context, no step holder (``abandon``),
        no budget no task pinned. Tasks registered but never handed to the
        committer fail with ``error`` (their rows will never land: the
        failure is sticky). An eager dispatch failure already failed its batch.

        ``retry``: the save failed before registering anything (a staging
        timeout, a failed staging copy, a join): its scheduler snapshot and
        hits are put back, so the engine may call save_outputs again (under
        a new step id) and no row behind a published block hash is lost."""
        with self._state_lock:
            if published:
                self._step_ctxs.pop(sid, None)
            if retry is not None and self._pending_sched is None and not self._pending_hits:
                self._pending_sched, self._pending_hits = retry, hits
            else:
                for hit in hits.values():
                    self._drop_hit_locked(hit)
        if not published:
            self._controller.fail_tasks(self._stranded(registered), error)
        if reserved:
            # Uncharges exactly the tickets no task pinned (release is once per ticket).
            self._controller.refund_unpinned(reserved)
        if claimed is not None:
            self._controller.staging_release(claimed.staging_slot, StagingBufferHolder.for_step(sid), "abandon")

    @staticmethod
    def _stranded(registered: list[WriteTask]) -> list[WriteTask]:
        """Registered writes a failed save never handed to the committer.
        Before publish no committer or dispatch has seen them, so every one
        the write_task spec does not call final is stranded."""
        return [t for t in registered if not t.is_terminal]

    def _save_error(
        self, sid: StepId, exc: BaseException, registered: list[WriteTask], published: bool
    ) -> BaseException:
        """What a failed save raises: a library error (or a non-Exception)
        as is; otherwise a write-failed error when the failure strands
        registered writes (sticky), else a contract error naming the step."""
        if isinstance(exc, OmniPrefixCacheUnmatchError) or not isinstance(exc, Exception):
            return exc
        stranded = [] if published else self._stranded(registered)
        if stranded:
            return self._controller.write_error(stranded[0], exc, "registration")
        error = OmniPrefixCacheUnmatchError(f"save_outputs (step {sid}) failed: {exc!r}")
        error.__cause__ = exc
        return error

    # ============================================================ materialize

    def _consume_locked(self, step_id: StepId, trigger: str) -> tuple[StepContext, Any]:
        """Pop the step's context and move it to CONSUMED (state lock held)."""
        ctx = self._step_ctxs.get(step_id)
        if ctx is None:
            issued = isinstance(step_id, int) and 0 < step_id < self._next_step_id
            step_move(step_id, StepState.CONSUMED if issued else StepState.UNSAVED, trigger)
            raise AssertionError("unreachable: step_move raises for a step without a context")
        move = step_move(step_id, ctx.state, trigger)
        del self._step_ctxs[step_id]
        self._counters[f"steps_{trigger}d" if trigger.endswith("e") else f"steps_{trigger}ed"] += 1
        ctx.state = move.dest
        return ctx, move

    def _finish_consume(self, ctx: StepContext, move: Any) -> None:
        """Run the consume move's effects (release the step holder) and drop
        hit prefetches nobody will read."""
        try:
            for effect in move.effects:
                effect(ctx)
        finally:
            stale: list[_PlannedRead] = []
            for rid, futures in ctx.hit_prefetch.items():
                for key, fut in futures.items():
                    if fut.cancel():
                        ref = ctx.hit_refs.get(rid, {}).get(key)
                        if ref is not None:
                            stale.append(ref)
            if stale:
                for ref in stale:
                    self._forget_read(ref)

    def _materialize(self, ctx: StepContext, req_ids: list[ReqId]) -> StageCacheOutputs:
        self._check_open()
        self._raise_if_failed()
        outside = [r for r in req_ids if r not in ctx.spans]
        if outside:
            raise OmniPrefixCacheUnmatchError(
                f"materialize(step {ctx.step_id}): request ids {_listed(outside)} are outside the save snapshot "
                f"(saved: {_listed(list(ctx.spans))})"
            )
        with self._state_lock:
            self._commit_drained_writes()
        if ctx.d2h is not None and ctx.d2h.event is not None:
            self._wait_device(ctx, ctx.d2h.event, "staging copy")
        if ctx.mm_event is not None:  # pragma: no cover - CUDA only
            self._wait_device(ctx, ctx.mm_event, "leftover mm copy")
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
        plain = [r for r in req_ids if r not in ctx.hits]
        hit_reqs = [r for r in req_ids if r in ctx.hits]
        # Most requests: one owned copy of the step's rows per key, cut into
        # per-request views (disjoint, so no request aliases another).
        whole = len(plain) * 4 >= len(ctx.order)
        index = {r: i for i, r in enumerate(ctx.order)} if whole and plain else {}
        for key, src in sources.items():
            out_map = hidden_out if is_hidden_key(key) else mm_out[key]
            if out_map is None:
                continue
            if plain:
                if whole:
                    parts = torch.split(self._restore_shape(ctx, key, src.clone()), ctx.sizes)
                    for rid in plain:
                        out_map[rid] = parts[index[rid]]
                else:
                    for rid in plain:
                        start, rows = ctx.spans[rid]
                        out_map[rid] = self._restore_shape(ctx, key, src[start : start + rows].clone())
            for rid in hit_reqs:
                start, rows = ctx.spans[rid]
                fut = ctx.hit_prefetch.get(rid, {}).get(key)
                merged = self._merge_hit(ctx, rid, key, ctx.hits[rid][0], fut, src[start : start + rows])
                out_map[rid] = self._restore_shape(ctx, key, merged)
        for rid in hit_reqs:
            # Cached keys this step did not produce: the prefix is all there is.
            computed = ctx.hits[rid][0]
            for key, fut in ctx.hit_prefetch.get(rid, {}).items():
                if key in sources:
                    continue
                prefix = self._restore_shape(ctx, key, self._hit_rows(ctx, rid, key, fut)[:computed])
                if is_hidden_key(key):
                    if hidden_out is not None:
                        hidden_out[rid] = prefix
                else:
                    mm_out.setdefault(key, {})[rid] = prefix
        for key, value in ctx.mm_cpu_snapshot.items():
            if key in sources:
                continue
            out_map = mm_out[key]
            for rid in req_ids:
                start, rows = ctx.spans[rid]
                out_map[rid] = _payload_for_request(value, start, start + rows, ctx.n)
        return StageCacheOutputs(hidden_states=hidden_out, mm_outputs=mm_out)

    def _merge_hit(
        self,
        ctx: StepContext,
        rid: ReqId,
        key: TensorName,
        computed: int,
        fut: Future[torch.Tensor] | None,
        tail: torch.Tensor,
    ) -> torch.Tensor:
        """Write this step's rows behind the prefetched prefix (the returned
        tensor is the prefetched buffer whenever its size fits)."""
        if fut is None:
            raise OmniPrefixCacheUnmatchError(
                f"materialize(step {ctx.step_id}): hit of request {rid!r} has no planned read for key {key!r}"
            )
        buf = self._hit_rows(ctx, rid, key, fut)
        rows = int(tail.shape[0])
        if int(buf.shape[0]) != computed + rows:
            grown = torch.empty((computed + rows, *buf.shape[1:]), dtype=buf.dtype)
            grown[:computed].copy_(buf[:computed])
            buf = grown
        buf[computed:].copy_(tail)
        return buf

    def _hit_rows(self, ctx: StepContext, rid: ReqId, key: TensorName, fut: Future[torch.Tensor]) -> torch.Tensor:
        """The prefetched ``[prefix | tail]`` buffer. Only shutdown cancels
        a read a step still owns, so a cancelled one is the shutdown error."""
        try:
            return fut.result()
        except CancelledError:
            raise OmniPrefixCacheShutdownError(
                f"materialize(step {ctx.step_id}): the hit read of {key!r} rows for request {rid!r} was cancelled "
                "by shutdown"
            ) from None

    @staticmethod
    def _restore_shape(ctx: StepContext, key: TensorName, rows: torch.Tensor) -> torch.Tensor:
        """2-D pool rows back in the per-token shape the caller saved."""
        layout = ctx.layouts.get(key)
        if layout is None or len(layout.trailing) == 1:
            return rows
        return rows.reshape(int(rows.shape[0]), *layout.trailing)

    # ============================================================ hits

    def _hit_blocks(self, rid: ReqId, computed: int, block_ids: Any) -> list[int]:
        """Validate a hit and return its group-0 prefix block ids."""
        bs = self._block_size
        if computed % bs:
            raise OmniPrefixCacheInvalidArgumentError(
                f"prefix hit not block aligned: request {rid!r} has num_computed_tokens={computed}, block_size={bs}"
            )
        need = computed // bs
        group0 = None
        if isinstance(block_ids, (str, bytes)) or (block_ids is not None and not isinstance(block_ids, Sequence)):
            raise OmniPrefixCacheInvalidTypeError(
                f"prefix hit of request {rid!r}: block_ids must be a sequence of per-group block id lists, "
                f"got {type(block_ids).__name__}"
            )
        if block_ids is not None and len(block_ids) > 0:
            group0 = block_ids[0]
        if group0 is not None and (isinstance(group0, (str, bytes)) or not isinstance(group0, Sequence)):
            raise OmniPrefixCacheInvalidTypeError(
                f"prefix hit of request {rid!r}: group-0 block ids must be a sequence, got {type(group0).__name__}"
            )
        if group0 is None or len(group0) < need:
            have = 0 if group0 is None else len(group0)
            raise OmniPrefixCacheInvalidArgumentError(
                f"prefix hit of request {rid!r} ({computed} tokens, {need} blocks) comes with {have} group-0 block ids"
            )
        blocks = [_int(f"prefix hit of request {rid!r}: block id", b) for b in list(group0)[:need]]
        bad = [b for b in blocks if b < 0 or b >= self._config.num_blocks]
        if bad:
            raise OmniPrefixCacheInvalidArgumentError(
                f"prefix hit of request {rid!r}: block ids {_listed(bad)} outside [0, {self._config.num_blocks})"
            )
        return blocks

    def _block_slots(self, blocks: list[int]) -> torch.Tensor:
        bs = self._block_size
        base = torch.tensor(blocks, dtype=torch.int64).unsqueeze(1) * bs
        return (base + torch.arange(bs, dtype=torch.int64)).reshape(-1)

    def _plan_hit_locked(self, hit: _PendingHit, *, at_save: bool) -> list[_HitJob]:
        """Plan the hit's reads for every cached key not planned yet (state
        lock held). At new_step_starts a key with ABSENT rows (or no slab
        yet) waits for save: this very step may compute them. A read that
        cannot be served becomes a failed future, raised by materialize."""
        jobs: list[_HitJob] = []
        if hit.num_computed <= 0:
            return jobs
        for key in self._policy.get_hit_keys(self._slot_status.keys()):
            if key in hit.futures:
                continue
            if not self._slot_status.has_key(key):
                if not at_save:
                    continue
                self._fail_hit(
                    hit,
                    key,
                    OmniPrefixCacheUnmatchError(
                        f"prefix hit of request {hit.req_id!r}: key {key!r} was never cached "
                        f"(slots {_listed(hit.slots)} are ABSENT)"
                    ),
                )
                continue
            if not at_save:
                state = self._slot_status.state[key].index_select(0, hit.slots)
                if bool((state == ABSENT).any()):
                    continue
            try:
                ref = self._slot_ref(hit.slots, key, hit.req_id)
            except OmniPrefixCacheUnmatchError as exc:
                self._fail_hit(hit, key, exc)
                continue
            hit.refs[key] = ref
            jobs.append((hit, key, ref))
        return jobs

    @staticmethod
    def _fail_hit(hit: _PendingHit, key: TensorName, exc: OmniPrefixCacheUnmatchError) -> None:
        logger.warning("omni prefix cache unmatch: %s", exc)
        fut: Future[torch.Tensor] = Future()
        fut.set_exception(exc)
        hit.futures[key] = fut

    def _start_prefetch(self, jobs: list[_HitJob]) -> None:
        """Submit planned reads to the prefetch thread (outside the lock)."""
        for hit, key, ref in jobs:
            layout = self._layouts[key]
            total = hit.num_computed + hit.num_scheduled
            try:
                fut = self._prefetch.submit(self._prefetch_read, ref, layout, hit.num_computed, total)
            except Exception as exc:
                self._forget_read(ref)
                fut = Future()
                kind = OmniPrefixCacheShutdownError if self._closed else OmniPrefixCacheUnmatchError
                error = kind(f"prefetch of {key!r} rows for request {hit.req_id!r} could not start: {exc!r}")
                error.__cause__ = exc
                fut.set_exception(error)
            hit.futures[key] = fut

    def _prefetch_read(self, ref: _PlannedRead, layout: KeyLayout, computed: int, total: int) -> torch.Tensor:
        """Prefetch thread: build ``[prefix | empty tail]`` so materialize
        only writes the tail."""
        try:
            buf = torch.empty((total, layout.width), dtype=layout.dtype)
            self._fetch_source(ref, out=buf[:computed])
        except OmniPrefixCacheUnmatchError:
            raise
        except Exception as exc:
            raise OmniPrefixCacheUnmatchError(
                f"prefix hit of request {ref.req_id!r}: reading {ref.key!r} rows at slots {_listed(ref.slots)} "
                f"failed: {exc!r}"
            ) from exc
        return buf

    def _slot_ref(self, slots: torch.Tensor, key: TensorName, req_id: ReqId) -> _PlannedRead:
        """Plan a read of ``slots`` for ``key`` (state lock held) and register
        it as pending, so a reuse of a committed slot preserves its rows.

        COMMITTED rows read the pool; rows in transit wait for their
        JOIN_NEXT_STEP write (``join_tids``) or read their JOIN_ON_FINISH
        task (``staged_list``); ABSENT mm rows keep the baseline (zeros) taken
        now. Raises OmniPrefixCacheUnmatchError for ABSENT hidden rows, an
        in-transit owner the controller no longer knows, or a failed owner.
        """
        table = self._slot_status.get_slot_status(key)
        slots = slots.to(torch.int64)
        state = table.state.index_select(0, slots)
        ref = _PlannedRead(req_id=req_id, key=key, slots=slots, planned_version=table.slot_version[slots])
        try:
            self._plan_rows(ref, table, state)
        except OmniPrefixCacheUnmatchError:
            with self._reads_lock:
                self._reads.move(ref, "refuse")
            raise
        with self._reads_lock:
            self._reads.move(ref, "register")
        return ref

    def _plan_rows(self, ref: _PlannedRead, table: Any, state: torch.Tensor) -> None:
        """Where each row of ``ref`` comes from (see ``_slot_ref``)."""
        slots, key, req_id = ref.slots, ref.key, ref.req_id
        absent = state == ABSENT
        if bool(absent.any()):
            if is_hidden_key(key):
                raise OmniPrefixCacheUnmatchError(
                    f"prefix hit of request {req_id!r}: hidden rows at slots {_listed(slots[absent])} were never "
                    "written (ABSENT); the omni cache diverged from the KV cache"
                )
            pos = absent.nonzero().flatten()
            # Not the slab's rows: after a tenancy reset they may still be
            # a previous tenant's.
            baseline = self._pool.baseline(key, int(pos.numel()))
            for i, slot in enumerate(slots[pos].tolist()):
                ref.preserved[slot] = baseline[i]
        transit = state == IN_TRANSIT
        if bool(transit.any()):
            pos = transit.nonzero().flatten()
            owners = table.tids.index_select(0, slots[pos])
            for tid in dict.fromkeys(owners.tolist()):
                task = self._controller.get_task(tid)
                where = pos[owners == tid]
                if task is None:
                    raise OmniPrefixCacheUnmatchError(
                        f"prefix hit of request {req_id!r}: {key!r} rows at slots {_listed(slots[where])} are in "
                        f"transit with task {tid}, which the controller no longer holds"
                    )
                if task.state is TaskState.FAILED:
                    raise OmniPrefixCacheUnmatchError(
                        f"prefix hit of request {req_id!r}: write failed for task {tid} holding {key!r} rows at "
                        f"slots {_listed(slots[where])}"
                    )
                if task.schedule is WriteSchedule.JOIN_NEXT_STEP:
                    ref.join_tids.append(tid)
                else:
                    ref.staged_list.append(_StagedRows(task=task, positions=where, slots=slots[where]))

    def _fetch_source(self, src: _PlannedRead, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read a planned read's rows (never under the state lock; the
        prefetch thread or a test). Waits for JOIN_NEXT_STEP owners' pool
        writes, reads the pool, overlays rows of
        JOIN_ON_FINISH owners and preserved copies, and raises
        ("reassigned") when a pool row changed version with no preserved
        copy. The read is served or failed afterwards (spec planned_read),
        no longer pending whatever happens."""
        with self._reads_lock:
            self._reads.move(src, "fetch")
        try:
            if src.join_tids:
                # Once `done` is set the rows are in the pool. Publishing the
                # completion (the occupancy commit) is left to the next
                # facade entry: this thread never takes the state lock. A
                # reuse racing this read is caught by the version check.
                self._controller.join(list(src.join_tids))
            rows = self._pool.rows(src.key, src.slots)
            if out is not None:
                out.copy_(rows)
                rows = out
            staged: torch.Tensor | None = None
            for part in src.staged_list:
                got = self._controller.fetch_host(part.task, part.slots, src.key)
                rows.index_copy_(0, part.positions, got.reshape(int(got.shape[0]), int(rows.shape[1])).to(rows.dtype))
                if staged is None:
                    staged = torch.zeros(int(src.slots.numel()), dtype=torch.bool)
                staged[part.positions] = True
            for pos, row in self._ensure_not_reassigned(
                src.slots,
                src.key,
                req_id=src.req_id,
                planned_version=src.planned_version,
                preserved=src.preserved,
                skip=staged,
            ):
                rows[pos] = row
        except BaseException:
            with self._reads_lock:
                self._reads.move(src, "fail")
            raise
        with self._reads_lock:
            self._reads.move(src, "serve")
        return rows

    def _ensure_not_reassigned(
        self,
        slots: torch.Tensor,
        key: TensorName,
        *,
        req_id: ReqId,
        planned_version: torch.Tensor,
        preserved: Mapping[int, torch.Tensor] | None = None,
        skip: torch.Tensor | None = None,
    ) -> list[tuple[int, torch.Tensor]]:
        """Check a delayed pool read against the versions it was planned at
        (see below). Returns ``(position, row)`` overlays from
        ``preserved``; raises OmniPrefixCacheUnmatchError ("reassigned")
        naming the request, key and slots that changed version with no
        preserved copy. ``skip`` masks positions not read from the pool.
        Any thread; takes the reads lock (versions and preserved copies
        change together under it). ``preserved`` is the read's own dict,
        looked at only under that lock: a reuse may fill it between this
        call and the lock, together with the version bump."""
        with self._reads_lock:
            if preserved is None:
                preserved = {}
            current = self._slot_status.get_slot_status(key).slot_version.index_select(0, slots)
            changed = current != planned_version
            if skip is not None:
                changed &= ~skip
            if bool(changed.any()):
                lost = [s for s in slots[changed].tolist() if s not in preserved]
                if lost:
                    raise OmniPrefixCacheUnmatchError(
                        f"delayed read for request {req_id!r}: {key!r} rows at slots {_listed(lost)} were "
                        "reassigned to a new tenant before the read (no preserved copy)"
                    )
            if not preserved:
                return []
            skipped = skip.tolist() if skip is not None else None
            return [
                (i, preserved[s])
                for i, s in enumerate(slots.tolist())
                if s in preserved and not (skipped is not None and skipped[i])
            ]

    def _forget_read(self, ref: _PlannedRead) -> None:
        """The read is abandoned before its fetch began (``drop``): no later
        reuse needs to preserve rows for it. Any thread; takes the reads
        lock only."""
        with self._reads_lock:
            self._reads.move(ref, "drop")

    def _drop_hit_locked(self, hit: _PendingHit) -> None:
        """A hit that will never be served: cancel its prefetches and forget
        its pending reads (a running prefetch forgets its own)."""
        for key, fut in hit.futures.items():
            if fut.cancel():
                ref = hit.refs.get(key)
                if ref is not None:
                    self._forget_read(ref)
        for key, ref in hit.refs.items():
            if key not in hit.futures:
                self._forget_read(ref)

    # ============================================================ occupancy hooks

    def _on_reassign(self, tid: Tid, key: TensorName, slots: torch.Tensor) -> None:
        """Occupancy hook (state lock held): a newer write took these rows."""
        rec = self._records.get(tid)
        if rec is not None:
            rec.task.add_reassigned(key, slots)

    def _preserve_pending_reads(self, key: TensorName, slots: torch.Tensor) -> None:
        """Occupancy hook (state and reads locks held): committed rows are
        about to be overwritten or reset; every live planned read of them
        copies them first (planned_read ``preserve``)."""
        self._reads.preserve(key, slots)

    # ============================================================ drains

    def _commit_drained_writes(self) -> None:
        """Publish what the committer finished (state lock held): written
        tasks commit their rows (one occupancy move per key for the whole
        drain); failed tasks drop theirs and make the failure sticky."""
        failed = self._controller.drain_failed()
        if failed:
            self._note_failures_locked(failed)
        done = self._controller.drain_completed()
        if done:
            self._settle_locked(done, "commit")

    def _settle_locked(self, tids: list[Tid], trigger: str) -> list[_TaskRecord]:
        """``commit`` or ``drop`` the rows of drained writes and forget them
        (state lock held). Rows are grouped by their key tuple (one per save
        and schedule), so a drain costs one occupancy move per key group,
        not one per task."""
        groups: dict[tuple[TensorName, ...], tuple[list[torch.Tensor], list[int], list[int]]] = {}
        settled: list[_TaskRecord] = []
        records = self._records
        forget = self._request_tasks.forget
        for tid in tids:
            rec = records.pop(tid, None)
            if rec is None:
                continue
            settled.append(rec)
            forget(rec.req_id, rec.task)
            if rec.req_id not in self._live:
                self._request_tasks.drop_if_idle(rec.req_id)
            for keys, part in rec.parts:
                slot_parts, owners, counts = groups.setdefault(keys, ([], [], []))
                slot_parts.append(part)
                owners.append(tid)
                counts.append(int(part.shape[0]))
        for keys, (slot_parts, owners, counts) in groups.items():
            if trigger == "commit":
                self._counters["rows_committed"] += sum(counts) * len(keys)
            slots = slot_parts[0] if len(slot_parts) == 1 else torch.cat(slot_parts)
            writers = _per_row(owners, counts, int(slots.shape[0]))
            for key in keys:
                self._slot_status.settle(trigger, key, slots, writers)
        return settled

    def _note_failures_locked(self, failed: list[Tid]) -> None:
        self._counters["failed_writes"] += len(failed)
        settled = {rec.task.tid: rec for rec in self._settle_locked(failed, "drop")}
        names = [f"task {tid} (req {settled[tid].req_id!r})" if tid in settled else f"task {tid}" for tid in failed]
        causes = [c for tid in failed if (c := self._controller.failure_of(tid)) is not None]
        first = causes[0] if causes else None
        message = (
            f"omni prefix cache write failed: {', '.join(names)}; rows behind published block hashes never "
            "landed, so the cache can no longer serve hits" + (f" (first: {first})" if first is not None else "")
        )
        logger.error("%s", message)
        if self._failure is None:
            rec = settled.get(failed[0])
            error = OmniPrefixCacheWriteFailedError(
                message,
                tid=first.tid if first is not None else failed[0],
                req_id=first.req_id if first is not None else (rec.req_id if rec is not None else None),
                keys=first.keys if first is not None else (),
                slots=first.slots if first is not None else (),
            )
            error.__cause__ = first.__cause__ if first is not None else None
            self._failure = error

    def _wait_device(self, ctx: StepContext, event: Any, what: str) -> None:
        """Host-wait a device event of ``ctx``'s step. A device fault (the
        CUDA context is gone) becomes the sticky failure, then raises."""
        try:
            event.synchronize()
        except RuntimeError as exc:
            # A dead device context loses every write still in flight, so it
            # is sticky like a failed pool write.
            error = OmniPrefixCacheWriteFailedError(f"step {ctx.step_id}: device fault while waiting its {what}: {exc}")
            error.__cause__ = exc
            with self._state_lock:
                if self._failure is None:
                    self._failure = error
            raise error.again() from exc

    def _raise_if_failed(self) -> None:
        """Sticky failure check at every serving facade entry."""
        with self._state_lock:
            failed = self._controller.drain_failed()
            if failed:
                self._note_failures_locked(failed)
            failure = self._failure
        if failure is not None:
            raise failure.again()

    def _check_open(self) -> None:
        if self._closed:
            raise OmniPrefixCacheShutdownError("omni prefix cache manager is shut down")
