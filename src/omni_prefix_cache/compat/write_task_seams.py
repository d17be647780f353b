"""WriteTask's upstream spellings that the seed suite (tests/test_seed_suite.py)
still calls: the write takeover's old word "reassigned", and the direct
moves ``claim_copy`` / ``mark_done`` / ``mark_failed`` that the runtime no
longer makes (its moves run through the compiled operations).

Upstream's tests also wrap a WriteTask method on the class (for example
``monkeypatch.setattr(WriteTask, "mark_host_ready", ...)``) to fail one
request's write. Such a wrapper is only meaningful while each request's
immediate rows are their own task, so ``_SeamWatch`` (the mixin's metaclass)
notices the patch when it is made, at no cost per task, and keeps
``UpstreamTaskSeams.seams_wrapped`` true while one of ``PER_REQUEST_SEAMS``
is patched; the write ledger reads that flag once per save and then
registers the step's immediate rows as one write per request (see
``WriteLedger.register_immediate_locked``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from omni_prefix_cache.interface import TensorName
from omni_prefix_cache.specs.types.write_task import TaskState, WriteTaskTrigger

# The per-task methods of a write's copy -> host_ready -> pool write path: the
# ones a wrapper can single one request's write out by. Other methods (chunk
# appends, takeover bookkeeping, the request arrays) are not seams: a runtime
# mutant patching one of them keeps the production shape (one step write).
PER_REQUEST_SEAMS = frozenset(
    {
        "claim_copy",
        "fire",
        "get_host_tensor",
        "mark_done",
        "mark_failed",
        "mark_host_ready",
        "scatter_rows",
        "set_host_tensor",
        "transition",
        "try_fire",
        "try_transition",
    }
)

# The class-level methods replaced now: (class, name) -> the original.
_WRAPPED: dict[tuple[type, str], object] = {}


def _raw(cls: type, name: str) -> object:
    """``name`` as ``cls`` finds it in its MRO, unbound (None if absent)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


class _SeamWatch(type):
    """Metaclass of ``UpstreamTaskSeams``: replacing (or restoring) one of
    ``PER_REQUEST_SEAMS`` on a watched class after it is built updates
    ``seams_wrapped``.

    Only class-level assignments pass here (``setattr(cls, ...)``); instance
    attributes, method calls and task construction do not, so the hot path
    pays nothing. Other names are not watched (the dataclass decorator sets
    dunders and field defaults while it builds the class)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        key = (cls, name)
        if key not in _WRAPPED and name in PER_REQUEST_SEAMS:
            current = _raw(cls, name)
            if current is not None:
                _WRAPPED[key] = current
        super().__setattr__(name, value)
        _SeamWatch._settle(key)

    def __delattr__(cls, name: str) -> None:
        super().__delattr__(name)
        _SeamWatch._settle((cls, name))

    @staticmethod
    def _settle(key: tuple[type, str]) -> None:
        """Forget ``key`` once its original is back (a monkeypatch undone)."""
        original = _WRAPPED.get(key)
        if original is not None and _raw(*key) is original:
            del _WRAPPED[key]
        type.__setattr__(UpstreamTaskSeams, "seams_wrapped", bool(_WRAPPED))


class UpstreamTaskSeams(metaclass=_SeamWatch):
    """Mixin of WriteTask: upstream's names over its ``taken_over`` rows and moves.

    ``seams_wrapped``: true while one of ``PER_REQUEST_SEAMS`` is replaced
    on a WriteTask class (read by the write ledger once per save)."""

    seams_wrapped: ClassVar[bool] = False

    taken_over: dict[TensorName, torch.Tensor]
    add_taken_over: Callable[[TensorName, torch.Tensor], None]
    try_fire: Callable[..., bool]
    try_transition: Callable[[TaskState], bool]
    transition: Callable[[TaskState], None]

    @property
    def reassigned(self) -> dict[TensorName, torch.Tensor]:
        """The rows a newer write took over (``taken_over``)."""
        return self.taken_over

    def add_reassigned(self, key: TensorName, slots: torch.Tensor) -> None:
        self.add_taken_over(key, slots)

    def claim_copy(self) -> bool:
        """QUEUED -> COPYING. Of racing callers exactly one gets True."""
        return self.try_transition(TaskState.COPYING)

    def mark_done(self) -> None:
        """HOST_READY -> WRITTEN."""
        self.transition(TaskState.WRITTEN)

    def mark_failed(self, *, defer_wake: bool = False) -> bool:
        """Any non-terminal state -> FAILED; False if the spec has no such
        move (already terminal). ``defer_wake``: as ``fire(defer=True)``."""
        return self.try_fire(WriteTaskTrigger.FAIL, defer=defer_wake)
