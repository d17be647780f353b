"""WriteTask's upstream spellings that the seed suite (tests/test_seed_suite.py)
still calls: the write takeover's old word "reassigned", the staging page's
old name ``staging_slot`` (an attribute, and a constructor keyword through
``upstream_keywords``), and the direct moves ``claim_copy`` / ``mark_done``
/ ``mark_failed`` that the runtime no longer makes (its moves run through
the compiled operations).

``PER_REQUEST_SEAMS`` names the methods upstream's tests wrap on the class
(for example ``monkeypatch.setattr(WriteTask, "mark_host_ready", ...)``) to
fail one request's write; compat's registration strategy
(``compat.registration``) compares them with the originals per save.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from omni_prefix_cache.interface import OmniPrefixCacheInvalidTypeError, TensorName
from omni_prefix_cache.specs.types.write_task import TaskState, WriteTaskTrigger

T = TypeVar("T")

# The per-task methods of a write's copy -> host_ready -> pool write path: the
# ones a wrapper can single one request's write out by. Other methods (chunk
# appends, takeover bookkeeping, the request arrays) are not seams.
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


def upstream_keywords(cls: type[T]) -> type[T]:
    """Class decorator (above ``@dataclass``): the constructor also takes
    upstream's ``staging_slot=`` for ``page``. Raises the invalid-type
    error when both are given."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if "staging_slot" in kwargs:
            if "page" in kwargs:
                raise OmniPrefixCacheInvalidTypeError(
                    f"{cls.__name__}() got both page and staging_slot (upstream's name for page)"
                )
            kwargs["page"] = kwargs.pop("staging_slot")
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def class_member(cls: type, name: str) -> object:
    """``name`` as ``cls`` finds it in its MRO, unbound (None if absent)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


class UpstreamTaskSeams:
    """Mixin of WriteTask: upstream's names over its ``taken_over`` rows and moves."""

    taken_over: dict[TensorName, torch.Tensor]
    add_taken_over: Callable[[TensorName, torch.Tensor], None]
    try_fire: Callable[..., bool]
    try_transition: Callable[[TaskState], bool]
    transition: Callable[[TaskState], None]

    page: int | None

    @property
    def staging_slot(self) -> int | None:
        """The staging page this write views (``page``)."""
        return self.page

    @staging_slot.setter
    def staging_slot(self, page: int | None) -> None:
        self.page = page

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
