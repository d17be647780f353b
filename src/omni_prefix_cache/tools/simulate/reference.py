"""A synchronous reference manager: the facade's contract with none of its machinery.

Rows are written into per-key slabs at save and merged at once, so the
simulator and its oracle can be checked on their own (and a suspected
manager bug can be replayed against something obviously correct).

Both forms of ``new_step_starts``: the seed-era scheduler output, and the
event API's ``PrefixCacheStep`` (owners, tenures, watermarks per consumer,
RESUMED hits recovering ``[lowest watermark, hit_end)``, ``delivery_view``,
``ack_delivery`` and ``commit_output``), with the write layout at save.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from omni_prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheStep, PrefixCacheWriteLayout
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    PrefixCacheRequestProgress,
    StageCacheOutputs,
    output_consumer,
    output_progress,
)

_TERMINAL = (PrefixCacheEventKind.FINISHED, PrefixCacheEventKind.ABORTED)
_OPENING = (PrefixCacheEventKind.STARTED, PrefixCacheEventKind.REPLACED)


class ReferenceManager:
    """Same facade as ``OmniPrefixCacheManager`` (token-major keys only)."""

    def __init__(
        self, config: PrefixCacheConfig, view: Any, *, eager: bool | None = None, alias_live: bool = False
    ) -> None:
        """``alias_live`` is fault injection for tests: return views of the caller's live
        buffers instead of copies (wrong as soon as the next forward overwrites them)."""
        self._alias_live = alias_live
        self._cfg = config
        self._view = view
        self._policy = ModelCachePolicy()
        self._slabs: dict[str, torch.Tensor] = {}
        self._live: set[str] = set()
        self._hits: dict[str, int] = {}
        self._hit_blocks: dict[str, list[int]] = {}
        self._num_sched: dict[str, int] = {}
        self._pending: dict[int, dict[str, dict[str, Any]]] = {}
        self._next_id = 0
        # The event form: current tenures by id, the consumers seen, each step's ranges and tenures.
        self._current: dict[str, PrefixCacheRequestProgress] = {}
        self._consumers: set[str] = set()
        self._hit_starts: dict[str, int] = {}
        self._last_sequence = -1
        # step id -> (output ranges, scheduled ranges, tenures, token-major mm keys)
        self._ranges: dict[int, tuple[dict[str, Any], dict[str, Any], dict[str, Any], frozenset[str]]] = {}
        self._lock = threading.Lock()

    def register_policy(self, policy: ModelCachePolicy) -> None:
        self._policy = policy

    def new_step_starts(self, scheduler_output: Any) -> None:
        if isinstance(scheduler_output, PrefixCacheStep):
            self._event_step(scheduler_output)
            return
        self._live -= set(scheduler_output.finished_req_ids)
        self._hits = {}
        self._hit_blocks = {}
        bs = self._cfg.block_size
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self._live and new.num_computed_tokens > 0:
                if new.num_computed_tokens % bs:
                    raise OmniPrefixCacheUnmatchError(f"prefix hit not block aligned for {new.req_id}")
                self._hits[new.req_id] = new.num_computed_tokens
                self._hit_blocks[new.req_id] = list(new.block_ids[self._cfg.kv_cache_group_index])
            self._live.add(new.req_id)
        self._num_sched = dict(scheduler_output.num_scheduled_tokens)

    def _slab(self, key: str, like: torch.Tensor) -> torch.Tensor:
        slab = self._slabs.get(key)
        if slab is None:
            slab = torch.zeros((self._cfg.num_blocks * self._cfg.block_size, like.shape[-1]), dtype=like.dtype)
            self._slabs[key] = slab
        return slab

    def _event_step(self, step: PrefixCacheStep) -> None:
        """Apply one step's events: a new owner retires the old tenure, a
        complete lookup (first one, or RESUMED) installs a hit from the lowest
        watermark (a consumer seen but absent from the tenure counts at 0)."""
        self._hits, self._hit_blocks, self._hit_starts = {}, {}, {}
        self._num_sched = dict(step.scheduled_tokens)
        if step.sequence is not None:
            if step.sequence <= self._last_sequence:
                return
            self._last_sequence = step.sequence
        events = [e for e in step.events if e.kind in _TERMINAL] + [e for e in step.events if e.kind not in _TERMINAL]
        with self._lock:
            for e in events:
                cur = self._current.get(e.req_id)
                if cur is not None and e.owner is not None and cur.owner is not None and e.owner < cur.owner:
                    continue  # an older owner's event
                if e.kind in _TERMINAL:
                    self._current.pop(e.req_id, None)
                    continue
                opens = e.kind in _OPENING and (cur is None or e.owner is None or e.owner != cur.owner)
                if opens:
                    if cur is not None:
                        cur.retired = True
                    cur = self._current[e.req_id] = PrefixCacheRequestProgress(owner=e.owner)
                if cur is None or not e.lookup_complete:
                    continue
                if opens or e.kind is PrefixCacheEventKind.RESUMED or cur.lookup is None:
                    cur.lookup = (int(e.hit_end), e.block_ids)
                    low = min(cur.delivered_upto.values(), default=0)
                    if low and any(c not in cur.delivered_upto for c in self._consumers):
                        low = 0
                    if e.hit_end > low:
                        self._hits[e.req_id] = int(e.hit_end)
                        self._hit_blocks[e.req_id] = list(e.block_ids[self._cfg.kv_cache_group_index])
                        self._hit_starts[e.req_id] = low

    def save_outputs(
        self,
        hidden: torch.Tensor | None,
        mm: dict[str, Any],
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
        write_layout: PrefixCacheWriteLayout | None = None,
    ) -> int:
        n = num_tokens_unpadded
        if write_layout is not None:
            order = [w.req_id for w in write_layout.writes if w.row_end > w.row_start]
            slots = write_layout.slots_cpu
            tokens = {w.req_id: (w.token_start, w.token_end) for w in write_layout.writes}
        else:
            order = [r for r in self._view.batch_req_ids() if self._num_sched.get(r, 0) > 0]
            slots = self._view.step_slots_cpu(order, self._num_sched)
        if slots.numel() != n:
            raise OmniPrefixCacheUnmatchError(f"slot mapping covers {slots.numel()} tokens, step has {n}")
        keys: dict[str, torch.Tensor] = {}
        leftover: dict[str, Any] = {}
        if hidden is not None and self._policy.needs_full_hidden_states:
            keys[HIDDEN_KEY] = hidden[:n]
        for k, v in mm.items():
            if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[0] in (n, num_tokens_padded):
                keys[k] = v[:n]
            else:
                leftover[k] = _copy(v)
        for k, v in keys.items():
            self._slab(k, v)[slots] = v
        bs = self._cfg.block_size
        out: dict[str, dict[str, Any]] = {k: {} for k in keys}
        start = 0
        ranges: dict[str, tuple[int, int]] = {}
        for r in order:
            m = self._num_sched[r]
            hit = self._hits.get(r, 0)
            low = self._hit_starts.get(r, 0)
            prefix_slots = None
            if hit:
                blocks = torch.as_tensor(self._hit_blocks[r][: hit // bs], dtype=torch.int64)
                prefix_slots = (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)[low:]
            if write_layout is not None:
                ranges[r] = tokens[r]
            for k, v in keys.items():
                rows = v[start : start + m]
                if prefix_slots is not None:
                    rows = torch.cat([self._slabs[k][prefix_slots], rows])
                out[k][r] = rows if self._alias_live else rows.clone()
            for k, v in leftover.items():
                out.setdefault(k, {})[r] = _share(v, start, start + m, n)
            start += m
        sid = self._next_id
        self._next_id += 1
        self._pending[sid] = out
        if write_layout is not None:
            with self._lock:
                for r in order:
                    tenure = self._current.setdefault(r, PrefixCacheRequestProgress())
                    tenure.computed_upto = tenure.saved_upto = ranges[r][1]
                held = {r: (self._hit_starts[r], ranges[r][1]) if r in self._hits else ranges[r] for r in order}
                token_major = frozenset(k for k in keys if k != HIDDEN_KEY)
                self._ranges[sid] = (held, ranges, {r: self._current[r] for r in order}, token_major)
        return sid

    def materialize(self, step_id: int, req_ids: list[str]) -> StageCacheOutputs:
        out = self._pending.pop(step_id)
        hidden = {r: out[HIDDEN_KEY][r] for r in req_ids} if HIDDEN_KEY in out else None
        mm = {k: {r: t[r] for r in req_ids} for k, t in out.items() if k != HIDDEN_KEY}
        if step_id not in self._ranges:
            return StageCacheOutputs(hidden_states=hidden, mm_outputs=mm)
        held, scheduled, tenures, keys = self._ranges.pop(step_id)
        return StageCacheOutputs(
            hidden_states=hidden,
            mm_outputs=mm,
            token_ranges={r: held[r] for r in req_ids},
            scheduled_token_ranges={r: scheduled[r] for r in req_ids},
            cached_mm_keys=keys,
            token_mm_keys=keys,
            _progress={r: tenures[r] for r in req_ids},
        )

    def discard_step(self, step_id: int) -> None:
        self._pending.pop(step_id)
        self._ranges.pop(step_id, None)

    # ------------------------------------------------------------ delivery (event form)

    def delivery_view(self, outputs: StageCacheOutputs, req_ids: Sequence[str], *, consumer: str) -> StageCacheOutputs:
        """The positions ``consumer`` has not received; a gap raises."""
        with self._lock:
            self._consumers.add(consumer)
            ranges = {}
            for r in req_ids:
                start, end = outputs.token_ranges[r]
                seen = output_progress(outputs)[r].delivered_upto.get(consumer, 0)
                if start > seen and end > seen:
                    raise OmniPrefixCacheUnmatchError(f"delivery gap for {r!r} consumer {consumer!r}: {seen} < {start}")
                ranges[r] = (min(end, max(start, seen)), end)
        cut = {r: ranges[r][0] - outputs.token_ranges[r][0] for r in req_ids}
        hidden = None if outputs.hidden_states is None else {r: outputs.hidden_states[r][cut[r] :] for r in req_ids}
        mm = {
            k: {r: v[r][cut[r] :] if k in outputs.token_mm_keys else v[r] for r in req_ids}
            for k, v in outputs.mm_outputs.items()
        }
        progress = {r: output_progress(outputs)[r] for r in req_ids}
        return replace(
            outputs, hidden_states=hidden, mm_outputs=mm, token_ranges=ranges, _progress=progress, _consumer=consumer
        )

    def ack_delivery(self, view: StageCacheOutputs) -> None:
        with self._lock:
            self._ack(view, list(view.token_ranges))

    def _ack(self, view: StageCacheOutputs, req_ids: list[str]) -> None:
        consumer = output_consumer(view)
        assert consumer is not None, "ack of a raw output"
        for r in req_ids:
            start, end = view.token_ranges[r]
            delivered = output_progress(view)[r].delivered_upto
            if start > delivered.get(consumer, 0) and end > delivered.get(consumer, 0):
                raise OmniPrefixCacheUnmatchError(f"delivery gap at ack for {r!r} consumer {consumer!r}")
        for r in req_ids:
            delivered = output_progress(view)[r].delivered_upto
            delivered[consumer] = max(delivered.get(consumer, 0), view.token_ranges[r][1])

    def commit_output(
        self,
        outputs: StageCacheOutputs,
        handoff: Callable[[frozenset[str]], None],
        *,
        delivery: StageCacheOutputs | None = None,
    ) -> frozenset[str]:
        """Drop retired tenures, hand off the live ones and acknowledge their view."""
        with self._lock:
            live = frozenset(
                r for r, t in output_progress(outputs).items() if not t.retired and self._current.get(r, t) is t
            )
            handoff(live)
            if delivery is not None:
                self._ack(delivery, [r for r in delivery.token_ranges if r in live])
        return live

    def shutdown(self) -> None:
        self._pending.clear()


def _copy(value: Any) -> Any:
    """Deep copy of a leftover entry (tensors cloned; lists, tuples and dicts recursed)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def _share(value: Any, start: int, end: int, n: int) -> Any:
    """One request's share of a leftover entry: a tensor whose first dim is the
    step's token count is sliced; anything else goes to every request whole."""
    if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == n:
        return value[start:end].clone()
    return _copy(value)
