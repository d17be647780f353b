"""Read-only probes of a manager's internals: leaks at shutdown and its stats."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any


def _components(mgr: Any) -> Any:
    """The manager's components (``OmniPrefixCacheManager.components``), or
    None for a manager without them (the reference manager, a test double)."""
    return getattr(mgr, "components", None)


def _controller(mgr: Any) -> Any:
    components = _components(mgr)
    return components.controller if components is not None else getattr(mgr, "controller", None)


def manager_stats(mgr: Any) -> dict[str, Any] | None:
    """``mgr.stats()`` as a plain dict; the controller's ``stats()`` when the manager has none; else None."""
    fn = getattr(mgr, "stats", None)
    if not callable(fn):
        fn = getattr(_controller(mgr), "stats", None)
    if not callable(fn):
        return None
    try:
        got = fn()
    except Exception as exc:  # a broken stats() must not hide the simulation's verdict
        return {"error": f"{type(exc).__name__}: {exc}"}
    if isinstance(got, Mapping):
        return dict(got)
    if hasattr(got, "_asdict"):
        return dict(got._asdict())
    if hasattr(got, "__dict__"):
        return dict(vars(got))
    return {"value": got}


def probe_leaks(mgr: Any) -> dict[str, int | None]:
    """What the manager still holds: staging holders, budget bytes, live tasks, step contexts.

    Values are None where the manager has no such attribute (reported as n/a).
    """
    ctrl = _controller(mgr)
    # The controller's parts (``WriteParts``), or a double that has the tables itself.
    parts = getattr(ctrl, "parts", ctrl)
    out: dict[str, int | None] = {"holders": None, "staged_bytes": None, "tasks": None, "step_contexts": None}
    pool = getattr(parts, "staging_pool", None)
    if pool is not None:
        # Lock-free reads: a probe after an error must not wait on a lock a stuck thread holds.
        out["holders"] = sum(len(pool.page_holders(page)) for page in range(pool.depth))
    budget = getattr(parts, "budget", None)
    if budget is not None:
        out["staged_bytes"] = int(budget.staged_bytes)
    tasks = getattr(getattr(parts, "registry", parts), "tasks", None)
    if tasks is not None:
        out["tasks"] = sum(1 for t in list(tasks.values()) if not _is_terminal(t))
    components = _components(mgr)
    if components is not None:
        out["step_contexts"] = len(components.steps)
    return out


def _is_terminal(task: Any) -> bool:
    term = getattr(task, "is_terminal", None)
    if isinstance(term, bool):
        return term
    state = getattr(task, "state", None)
    return bool(getattr(state, "is_terminal", False))


def wait_quiescent(mgr: Any, timeout_s: float) -> dict[str, int | None]:
    """Poll :func:`probe_leaks` until nothing is held or ``timeout_s`` passes; return the last probe."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe_leaks(mgr)
        if not any(v for v in got.values()) or time.monotonic() >= deadline:
            return got
        time.sleep(0.01)
