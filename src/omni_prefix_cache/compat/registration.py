"""Compat's registration strategy, and installing it (``install_upstream_seams``).

Upstream's tests wrap a per-request seam to fail or watch one request's
write: the controller's ``_scatter`` or ``_run_eager`` (through compat's
setters), or a WriteTask method of the copy and pool-write path patched on
the class (``PER_REQUEST_SEAMS``). Such a wrapper only means what it was
written for while each request's immediate rows are their own write, so a
manager built while compat's seams are installed gets ``PerRequestWhileWrapped``
as its ledger's registration strategy (``steps.registration``): one step
write, as the runtime's, except while a seam is wrapped, when each request's
rows are their own step write (one request in its arrays, in step order).
Upstream's tests patch after building the manager, so the strategy looks per
save (two isinstance checks, one MRO lookup per seam). A manager built while
they are not installed never looks.
"""

from __future__ import annotations

from collections.abc import Sequence

from omni_prefix_cache.compat.write_task_seams import PER_REQUEST_SEAMS, class_member
from omni_prefix_cache.controller import OmniPrefixCacheController
from omni_prefix_cache.interface import ReqId
from omni_prefix_cache.steps import registration
from omni_prefix_cache.steps.registration import Units
from omni_prefix_cache.writes.write_task import WriteTask

# The seams as the class defines them (read at import, before any test patches one).
_ORIGINALS: dict[str, object] = {name: class_member(WriteTask, name) for name in PER_REQUEST_SEAMS}


def task_seam_wrapped() -> bool:
    """True while a ``PER_REQUEST_SEAMS`` method of WriteTask is not the one
    the class defines (patched on WriteTask or on a class it inherits it from)."""
    return any(class_member(WriteTask, name) is not original for name, original in _ORIGINALS.items())


def per_request(req_order: Sequence[ReqId], sizes: Sequence[int]) -> Units:
    """Each request's rows their own write, in step order."""
    return [([rid], [size]) for rid, size in zip(req_order, sizes, strict=True)]


class PerRequestWhileWrapped:
    """The registration strategy of a ledger over ``controller`` built while
    compat's seams are installed: ``per_request`` while a per-request seam is
    wrapped (on this controller, or on WriteTask), else one step write."""

    def __init__(self, controller: OmniPrefixCacheController) -> None:
        self._controller = controller

    def __call__(self, req_order: Sequence[ReqId], sizes: Sequence[int]) -> Units:
        if self._controller.per_request_seam_wrapped() or task_seam_wrapped():
            return per_request(req_order, sizes)
        return registration.one_step_write(req_order, sizes)


def installed() -> bool:
    """Whether managers built now get compat's registration strategy."""
    return registration.installed_factory() is PerRequestWhileWrapped


def install() -> bool:
    """Managers built from now on get compat's registration strategy
    (idempotent). Returns True if this call installed it."""
    if installed():
        return False
    registration.install_factory(PerRequestWhileWrapped)
    return True


def uninstall() -> None:
    """Managers built from now on get the runtime's strategy again (those
    built before keep theirs)."""
    if installed():
        registration.install_factory(None)
