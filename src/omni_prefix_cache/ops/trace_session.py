"""Opening a manager's trace (docs/trace.md): ``PrefixCacheConfig.trace_path``
or, when that is None, the file the ``OMNI_PREFIX_CACHE_TRACE`` environment
variable names.

``open_trace`` runs in the manager's constructor before the controller is
built (the controller compiles its traced operations only while a trace is
open), starts recording every machine's moves, and wraps the manager's
facade methods on that one instance: each call records its name, its
arguments' shapes (never the tensors) and how it returned, and is the
context of every move the calling thread records meanwhile. A manager
built with no trace gets none of this: its methods are the class's own.
The wrapped ``shutdown`` closes the trace once it returns.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Callable
from typing import Any

from omni_prefix_cache.interface import PrefixCacheConfig
from omni_prefix_cache.specs.loader import spec_dir
from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.telemetry.trace import TRACE_ENV, Trace, shape_of

# Facade method -> the protocol operation it runs (spec/protocol.yaml); a
# method with no operation ("") still records its call.
FACADE_OPERATIONS = {
    "register_policy": "",
    "new_step_starts": "new_step",
    "save_outputs": "save",
    "materialize": "materialize",
    "discard_step": "discard",
    "shutdown": "shutdown",
    # The request-lifecycle API (issue 25): traced once the manager has it,
    # under the protocol operation of the same name where the spec declares one.
    "delivery_view": "delivery_view",
    "ack_delivery": "ack_delivery",
    "commit_output": "commit_output",
    "retire_owner": "retire_owner",
}


def trace_path(config: PrefixCacheConfig) -> str | None:
    """The file a manager built with ``config`` traces into, or None."""
    return config.trace_path or os.environ.get(TRACE_ENV) or None


def spec_digest() -> dict[str, str]:
    """sha256 (first 16 hex digits) of every spec file, so a validator can
    tell a trace recorded against other specs."""
    return {p.stem: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in sorted(spec_dir().glob("*.yaml"))}


def open_trace(manager: Any, config: PrefixCacheConfig) -> Trace | None:
    """Open the trace ``config`` asks for (None: none asked), record into
    it, and wrap ``manager``'s facade methods. Manager construction only."""
    path = trace_path(config)
    if path is None:
        return None
    header = {"config": dataclasses.asdict(config), "specs": spec_digest()}
    trace = Trace(path, header=header)
    TELEMETRY.start_trace(trace)
    for method, op in FACADE_OPERATIONS.items():
        call = getattr(manager, method, None)
        if callable(call):
            setattr(manager, method, _traced(trace, method, op, call))
    return trace


def _step_of(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if method in ("materialize", "discard_step"):
        step = args[0] if args else kwargs.get("step_id", -1)
        return step if isinstance(step, int) else -1
    return -1


def _traced(trace: Trace, method: str, op: str, call: Callable[..., Any]) -> Callable[..., Any]:
    closes = method == "shutdown"

    @functools.wraps(call)
    def traced(*args: Any, **kwargs: Any) -> Any:
        shapes = {**{str(i): shape_of(a) for i, a in enumerate(args)}, **{k: shape_of(v) for k, v in kwargs.items()}}
        prev = trace.call(method, op, shapes, _step_of(method, args, kwargs))
        try:
            result = call(*args, **kwargs)
        except BaseException as exc:
            trace.returned(method, prev, exc, None)
            raise
        trace.returned(method, prev, None, result if isinstance(result, int) else shape_of(result))
        if closes:
            TELEMETRY.stop_trace(trace)
        return result

    return traced
