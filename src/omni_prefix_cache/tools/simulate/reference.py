"""A synchronous reference manager: the facade's contract with none of its machinery.

Rows are written into per-key slabs at save and merged at once, so the
simulator and its oracle can be checked on their own (and a suspected
manager bug can be replayed against something obviously correct).
"""

from __future__ import annotations

from typing import Any

import torch

from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    StageCacheOutputs,
)


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

    def register_policy(self, policy: ModelCachePolicy) -> None:
        self._policy = policy

    def new_step_starts(self, scheduler_output: Any) -> None:
        self._live -= set(scheduler_output.finished_req_ids)
        self._hits = {}
        self._hit_blocks = {}
        bs = self._cfg.block_size
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self._live and new.num_computed_tokens > 0:
                if new.num_computed_tokens % bs:
                    raise OmniPrefixCacheUnmatchError(f"prefix hit not block aligned for {new.req_id}")
                self._hits[new.req_id] = new.num_computed_tokens
                self._hit_blocks[new.req_id] = list(new.block_ids[0])
            self._live.add(new.req_id)
        self._num_sched = dict(scheduler_output.num_scheduled_tokens)

    def _slab(self, key: str, like: torch.Tensor) -> torch.Tensor:
        slab = self._slabs.get(key)
        if slab is None:
            slab = torch.zeros((self._cfg.num_blocks * self._cfg.block_size, like.shape[-1]), dtype=like.dtype)
            self._slabs[key] = slab
        return slab

    def save_outputs(
        self, hidden: torch.Tensor | None, mm: dict[str, Any], *, num_tokens_unpadded: int, num_tokens_padded: int
    ) -> int:
        n = num_tokens_unpadded
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
        for r in order:
            m = self._num_sched[r]
            hit = self._hits.get(r, 0)
            prefix_slots = None
            if hit:
                blocks = torch.as_tensor(self._hit_blocks[r][: hit // bs], dtype=torch.int64)
                prefix_slots = (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)
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
        return sid

    def materialize(self, step_id: int, req_ids: list[str]) -> StageCacheOutputs:
        out = self._pending.pop(step_id)
        hidden = {r: out[HIDDEN_KEY][r] for r in req_ids} if HIDDEN_KEY in out else None
        mm = {k: {r: t[r] for r in req_ids} for k, t in out.items() if k != HIDDEN_KEY}
        return StageCacheOutputs(hidden_states=hidden, mm_outputs=mm)

    def discard_step(self, step_id: int) -> None:
        self._pending.pop(step_id)

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
