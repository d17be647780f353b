"""Read-only probes of a manager's internals: leaks at shutdown and its stats."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any


def _controller(mgr: Any) -> Any:
    return getattr(mgr, "_controller", None) or getattr(mgr, "controller", None)


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
    out: dict[str, int | None] = {"holders": None, "staged_bytes": None, "tasks": None, "step_contexts": None}
    pool = getattr(ctrl, "_staging_pool", None)
    busy = getattr(pool, "_busy", None)
    if busy is not None:
        out["holders"] = sum(len(h) for h in list(busy))
    if ctrl is not None and hasattr(ctrl, "_staged_bytes"):
        out["staged_bytes"] = int(ctrl._staged_bytes)
    tasks = getattr(ctrl, "_tasks", None)
    if tasks is not None:
        out["tasks"] = sum(1 for t in list(tasks.values()) if not _is_terminal(t))
    ctxs = getattr(mgr, "_step_ctxs", None)
    if ctxs is not None:
        out["step_contexts"] = len(ctxs)
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
