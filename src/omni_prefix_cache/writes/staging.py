"""Staging pages: the reusable host landing zone for one whole step.

Holders move through the ``staging_holder`` spec (spec/staging_holder.yaml):
a step claims a free page at save, each immediate write binds to the page
its step holds, and every holder is released exactly once (materialize or
discard, a failed save, the write's pool write, or its failure). A page is
free exactly when no holder holds it. This is not the CPU block pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch

from omni_prefix_cache.compat.staging_seams import UpstreamClaimSeams
from omni_prefix_cache.device import sync
from omni_prefix_cache.device.copy_engine import CopyEngine
from omni_prefix_cache.interface import (
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    TensorName,
    Tid,
)
from omni_prefix_cache.specs import CompiledMove, compile_machine, load_spec
from omni_prefix_cache.specs.types.staging_holder import HolderState as HolderState  # re-exported
from omni_prefix_cache.specs.types.staging_holder import StagingHolderTrigger, StagingHolderTriggerName
from omni_prefix_cache.telemetry.registry import TELEMETRY

# A staging_holder trigger, by its generated enum or by name.
HolderTrigger = StagingHolderTrigger | StagingHolderTriggerName


class PageViewer(Protocol):
    """What the pool reads of a write whose holder it moves: its tid and
    the page it views (None: it views none)."""

    tid: Tid
    page: int | None


class StagingBufferHolder(NamedTuple):
    """One owner of a staging page: a step (``for_step``) or a task (``for_task``)."""

    kind: Literal["step", "task"]
    owner_id: int

    @classmethod
    def for_step(cls, step_id: int) -> StagingBufferHolder:
        return cls("step", step_id)

    @classmethod
    def for_task(cls, tid: int) -> StagingBufferHolder:
        return cls("task", tid)


# ------------------------------------------------------ spec guards / effects
# Signature (pool, page, holder); called with the pool's condition held.


def _is_step_holder(pool: StagingBufferPool, page: int, holder: StagingBufferHolder) -> bool:
    return holder.kind == "step"


def _is_task_holder(pool: StagingBufferPool, page: int, holder: StagingBufferHolder) -> bool:
    return holder.kind == "task"


def _page_free(pool: StagingBufferPool, page: int, holder: StagingBufferHolder) -> bool:
    return not pool._busy[page]


def _page_busy(pool: StagingBufferPool, page: int, holder: StagingBufferHolder) -> bool:
    return bool(pool._busy[page])


def _wake_claimers_if_free(pool: StagingBufferPool, page: int, holder: StagingBufferHolder) -> None:
    if not pool._busy[page]:
        pool._page_freed.notify_all()


HOLDER_MACHINE = compile_machine(
    load_spec("staging_holder"),
    guards={
        "is_step_holder": _is_step_holder,
        "is_task_holder": _is_task_holder,
        "page_free": _page_free,
        "page_busy": _page_busy,
    },
    effects={"wake_claimers_if_free": _wake_claimers_if_free},
    state_enum=HolderState,
)
# States in which a holder holds its page (the spec's holds_page tag): a move
# into one takes the page, a move out of one lets it go.
_HOLDS_PAGE = HOLDER_MACHINE.tagged("holds_page")


class StagingBufferPool:
    """``depth`` pages of ``capacity`` rows per key, shared by all keys.

    ``_busy[page]`` is the set of holders holding the page. The holder
    lifecycle is the compiled spec; this class holds no table of its own.
    All methods are thread-safe (one condition guards the pool).
    """

    def __init__(
        self, depth: int, capacity: int, *, engine: CopyEngine | None = None, claim_timeout_s: float = 0.0
    ) -> None:
        """``engine``: where ``stage_step`` copies a step's rows from (None:
        host copies only); ``claim_timeout_s``: how long its claim waits
        for a free page."""
        self.depth = depth
        self.capacity = capacity
        self.engine = engine
        self.claim_timeout_s = claim_timeout_s
        # Pages are device-copy landing zones: pinned exactly when a device
        # engine copies into them (its host_empty allocates them).
        self.pin_memory = engine is not None and engine.pin_memory
        self._alloc = None if engine is None else engine.host_empty
        self._bufs: dict[TensorName, torch.Tensor] = {}
        self._busy: list[set[StagingBufferHolder]] = [set() for _ in range(depth)]
        self._page_of: dict[StagingBufferHolder, int] = {}
        self._high_water: dict[str, int] = {}  # highest owner id per kind that ever held a page
        self._page_freed: threading.Condition = sync.Condition()
        self._closed = False

    @property
    def lock(self) -> threading.Condition:
        """The pool's condition (reentrant): hold it to batch several moves."""
        return self._page_freed

    # ----------------------------------------------------------- holder moves

    def holder_state(self, holder: StagingBufferHolder) -> HolderState:
        """HELD while the holder holds a page; RELEASED once it has let go;
        UNHELD before it ever held one.

        Step ids and tids come from counters, so each kind takes its first
        hold in increasing id order: any id at or below the highest that
        ever held a page has had its turn. That makes RELEASED exact with
        no per-holder history (a late, lower id is refused as RELEASED).
        """
        if holder in self._page_of:
            return HolderState.HELD
        if holder.owner_id <= self._high_water.get(holder.kind, -1):
            return HolderState.RELEASED
        return HolderState.UNHELD

    def _apply(
        self,
        trigger: HolderTrigger,
        page: int,
        holder: StagingBufferHolder,
        move: CompiledMove | None = None,
        state: HolderState | None = None,
    ) -> bool:
        """Fire ``trigger`` for ``holder`` on ``page`` under the condition
        (``move``, ``state``: its compiled move and the holder's state, when
        the caller looked them up already). Raises if the spec has no such
        move (or a release names a page the holder does not hold); False if
        a guard refuses."""
        if state is None:
            state = self.holder_state(holder)
        move = move or HOLDER_MACHINE.move(state, trigger)
        if move is None:
            raise OmniPrefixCacheUnmatchError(
                f"staging page {page}: {holder.kind} {holder.owner_id} cannot {trigger} from {state.name}"
            )
        for guard in move.guards:
            if not guard(self, page, holder):
                return False
        if move.dest in _HOLDS_PAGE:
            self._busy[page].add(holder)
            self._page_of[holder] = page
            if holder.owner_id > self._high_water.get(holder.kind, -1):
                self._high_water[holder.kind] = holder.owner_id
        else:
            if self._page_of.get(holder) != page:
                raise OmniPrefixCacheUnmatchError(
                    f"staging page {page}: {holder.kind} {holder.owner_id} cannot {trigger}: not held there"
                )
            self._busy[page].discard(holder)
            del self._page_of[holder]
        recorder = HOLDER_MACHINE.recorder
        if recorder is not None:
            recorder.moved(move, holder, page)
        for effect in move.effects:
            effect(self, page, holder)
        return True

    def try_fire(self, trigger: HolderTrigger, page: int, holder: StagingBufferHolder) -> bool:
        """Fire ``trigger`` for ``holder`` on ``page`` if the spec lets it
        now (see ``enabled``); False, with nothing moved, otherwise."""
        with self._page_freed:
            return self._try_locked(trigger, page, holder)

    def try_fire_tasks(self, trigger: HolderTrigger, tasks: Sequence[PageViewer]) -> list[bool | BaseException]:
        """``try_fire`` of each task's holder on its ``page``, under
        one acquisition (a batched step); False for a task with no page,
        the exception for a holder whose move raised."""
        out: list[bool | BaseException] = [False] * len(tasks)
        moves = HOLDER_MACHINE.by_state(trigger)
        with self._page_freed:
            for i, task in enumerate(tasks):
                page = task.page
                if page is None:
                    continue
                try:
                    out[i] = self._try_locked(trigger, page, StagingBufferHolder("task", task.tid), moves)
                except Exception as exc:
                    out[i] = exc
        return out

    def _try_locked(
        self,
        trigger: HolderTrigger,
        page: int,
        holder: StagingBufferHolder,
        moves: Sequence[CompiledMove | None] | None = None,
    ) -> bool:
        """``try_fire`` under the condition (``moves``: the trigger's
        ``by_state`` row, when the caller looked it up once for a batch)."""
        state = self.holder_state(holder)
        move = moves[state] if moves is not None else HOLDER_MACHINE.move(state, trigger)
        if move is None or (move.dest not in _HOLDS_PAGE and self._page_of.get(holder) != page):
            return False
        return self._apply(trigger, page, holder, move, state)

    def enabled(self, trigger: HolderTrigger, page: int, holder: StagingBufferHolder) -> bool:
        """True if the spec lets ``holder`` fire ``trigger`` on ``page`` now
        (its move exists and its guards pass; a release names its own page)."""
        with self._page_freed:
            move = HOLDER_MACHINE.move(self.holder_state(holder), trigger)
            if move is None or not all(guard(self, page, holder) for guard in move.guards):
                return False
            return move.dest in _HOLDS_PAGE or self._page_of.get(holder) == page

    def fire(self, trigger: HolderTrigger, page: int, holder: StagingBufferHolder) -> None:
        """Fire ``trigger`` for ``holder`` on ``page``; raises naming the
        holder when the spec or a guard refuses it."""
        with self._page_freed:
            self._apply_many(trigger, [(page, holder)])

    def claim(self, holder: StagingBufferHolder, timeout: float) -> int:
        """Claim a free page for a step holder; waits up to ``timeout``
        seconds (<= 0: no wait). Raises OmniPrefixCacheStagingTimeoutError
        naming the holders that keep every page busy, or
        OmniPrefixCacheShutdownError (naming the holder) once the pool is closed."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._page_freed:
            while True:
                if self._closed:
                    raise OmniPrefixCacheShutdownError(f"staging pool shut down while {holder} waited for a page")
                for page in range(self.depth):
                    if self._apply(StagingHolderTrigger.CLAIM, page, holder):
                        return page
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    steps = sorted(h.owner_id for b in self._busy for h in b if h.kind == "step")
                    tasks = sorted(h.owner_id for b in self._busy for h in b if h.kind == "task")
                    raise OmniPrefixCacheStagingTimeoutError(
                        f"no free staging page after {timeout:g}s for step {holder.owner_id}: "
                        f"unconsumed step contexts {steps}, unwritten tasks {tasks} "
                        "(materialize or discard_step every step id)"
                    )
                self._page_freed.wait(timeout=remaining)

    def bind(self, page: int, holder: StagingBufferHolder) -> None:
        """A task holder joins the (busy) page its step holds."""
        with self._page_freed:
            if not self._apply(StagingHolderTrigger.BIND, page, holder):
                raise OmniPrefixCacheUnmatchError(
                    f"staging page {page}: task {holder.owner_id} cannot bind to a page no step holds"
                )

    def release(
        self, page: int, holder: StagingBufferHolder, trigger: HolderTrigger = StagingHolderTrigger.CONSUME
    ) -> None:
        """Release ``holder`` from ``page`` by ``trigger`` (consume, abandon,
        written, fail). Raises if the holder does not hold that page."""
        with self._page_freed:
            if self._page_of.get(holder) != page and holder in self._page_of:
                raise OmniPrefixCacheUnmatchError(
                    f"staging: {holder.kind} {holder.owner_id} holds page {self._page_of[holder]}, not {page}"
                )
            if not self._apply(trigger, page, holder):
                raise OmniPrefixCacheUnmatchError(
                    f"staging page {page}: {trigger} does not release a {holder.kind} holder"
                )

    def _apply_many(self, trigger: HolderTrigger, items: list[tuple[int, StagingBufferHolder]]) -> None:
        """``_apply`` for many holders under one lock (caller holds it); a
        holder the spec or a guard refuses raises before later ones move."""
        for page, holder in items:
            if not self._apply(trigger, page, holder):
                raise OmniPrefixCacheUnmatchError(
                    f"staging page {page}: {holder.kind} {holder.owner_id} cannot {trigger} here"
                )

    def holds(self, holder: StagingBufferHolder) -> bool:
        with self._page_freed:
            return holder in self._page_of

    def close(self) -> None:
        """Wake every waiting claim; later claims raise."""
        with self._page_freed:
            self._closed = True
            self._page_freed.notify_all()

    def page_holders(self, page: int) -> frozenset[StagingBufferHolder]:
        """The holders of ``page``, read without the lock (a checker looks
        between scheduled steps; a racing reader gets a snapshot)."""
        return frozenset(self._busy[page])

    def page_of(self, holder: StagingBufferHolder) -> int | None:
        """The page ``holder`` holds, or None (read as ``page_holders``)."""
        return self._page_of.get(holder)

    def holders(self) -> list[StagingBufferHolder]:
        """Every holder currently holding a page (diagnostics)."""
        with self._page_freed:
            return list(self._page_of)

    def stage_step(
        self,
        tensors: dict[TensorName, torch.Tensor],
        n: int,
        freeze_event: Any,
        step_holder: StagingBufferHolder,
    ) -> StepD2HClaim:
        """Claim a page for ``step_holder`` and launch one whole-step
        device-to-host copy of ``tensors`` (each ``n`` rows) into it on the
        pool's ``engine``.

        Engine thread, outside the manager's state lock (the claim may wait).
        A leftover-only save passes no tensors and still claims a page.
        Raises OmniPrefixCacheUnmatchError when ``n`` exceeds the page, and
        the timeout error when no page frees in ``claim_timeout_s`` seconds.
        On any failure the step holder is released (``abandon``) before raising.
        """
        if tensors and n > self.capacity:
            raise OmniPrefixCacheUnmatchError(
                f"step {step_holder.owner_id} has {n} tokens; staging capacity is {self.capacity} "
                "(size staging_capacity_tokens to max_num_batched_tokens)"
            )
        dp = TELEMETRY.datapath
        start = TELEMETRY.clock() if dp is not None else 0
        page = self.claim(step_holder, self.claim_timeout_s)
        if dp is not None:
            dp.waited("staging_claim", start, TELEMETRY.clock())
        try:
            views = {key: self.views(page, key, n, int(src.shape[-1]), src.dtype) for key, src in tensors.items()}
            # Each key's rows land straight in its slice of the page: no
            # device-side temporary on the copy stream.
            copies = [(views[key], src) for key, src in tensors.items()]
            event, engine = None, self.engine
            if engine is not None and any(engine.is_device(src) for _, src in copies):
                event = engine.launch(freeze_event, copies)
            else:
                start = TELEMETRY.cpu_clock() if dp is not None else 0
                for dst, src in copies:
                    dst.copy_(src)
                if dp is not None:
                    dp.copied("step", sum(dst.nbytes for dst, _ in copies), start, TELEMETRY.cpu_clock())
            if dp is not None and event is not None:
                dp.add("d2h_bytes_total", "step", sum(dst.nbytes for dst, _ in copies))
            return StepD2HClaim(page=page, views=views, event=event)
        except BaseException as exc:
            self.release(page, step_holder, StagingHolderTrigger.ABANDON)
            if isinstance(exc, OmniPrefixCacheUnmatchError) or not isinstance(exc, Exception):
                raise
            # Nothing was registered yet, so nothing is lost but this step.
            raise OmniPrefixCacheUnmatchError(
                f"step {step_holder.owner_id}: copying keys {sorted(tensors)} ({n} rows) into staging page {page} "
                f"failed: {exc!r}"
            ) from exc

    # ----------------------------------------------------------------- buffers

    def _buf(self, key: TensorName, width: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.shape[-1] != width or buf.dtype != dtype:
            shape = (self.depth * self.capacity, width)
            if self._alloc is not None:
                buf = self._alloc(shape, dtype)
            else:
                buf = torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
            self._bufs[key] = buf
        return buf

    def host_bytes(self) -> int:
        """Host bytes held by the pages of every key (pinned when ``pin_memory``)."""
        return sum(buf.numel() * buf.element_size() for buf in list(self._bufs.values()))

    def views(self, page: int, key: TensorName, n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[0:n)`` of ``page`` for ``key`` (allocating the key's pages lazily)."""
        base = page * self.capacity
        return self._buf(key, width, dtype)[base : base + n]


@dataclass(eq=False)
class StepD2HClaim(UpstreamClaimSeams):
    """One step's landing in the staging pool (returned by ``stage_step``).

    ``event`` completes the device-to-host copy; None when already complete.
    """

    page: int
    views: dict[TensorName, torch.Tensor]
    event: Any = None
