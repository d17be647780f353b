"""The KV layout's mutants (kv_layout_gate.py: the rows are keyed by one KV cache
group, ``PrefixCacheConfig.kv_cache_group_index``), registered into the mutant
catalogue by ``register`` (the catalogue passes its own
``_register`` and ``_set``, so this module imports nothing of it). Each one
reads group 0 by hand where the keyed group is meant, the bug hybrid models
had; tests/test_hybrid_groups.py's row oracle judges them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

Register = Callable[..., Callable[[Callable[[contextlib.ExitStack], None]], Callable[..., None]]]
SetAttr = Callable[[contextlib.ExitStack, Any, str, Any], None]
# The composition's models run one KV cache group: a hybrid layout is beyond its world.
OUTSIDE = "hybrid KV layouts: the composition models one KV cache group"


def _init_with(stack: contextlib.ExitStack, set_attr: SetAttr, cls: type, change: Callable[..., Any]) -> None:
    """``cls(*args, **kwargs)`` builds as ``cls(*change(args, kwargs))`` while the mutant is applied."""
    original = vars(cls)["__init__"]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        args, kwargs = change(args, kwargs)
        original(self, *args, **kwargs)

    set_attr(stack, cls, "__init__", init)


def register(register: Register, set_attr: SetAttr) -> None:
    """Register each mutant below with the catalogue."""

    @register(
        "hit_planner_reads_group_0",
        "the hit planner takes a hit's block ids of KV cache group 0, not of the keyed group",
        outside=OUTSIDE,
    )
    def _hits_group_zero(stack: contextlib.ExitStack) -> None:
        # Beside a sliding-window group 0, a hit then reads that group's blocks: slots
        # nothing mirrored, or another request's rows where a block moved between groups.
        import dataclasses

        from omni_prefix_cache.reads.hit_planner import HitPlanner

        def group_zero(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return (dataclasses.replace(args[0], kv_cache_group_index=0), *args[1:]), kwargs

        _init_with(stack, set_attr, HitPlanner, group_zero)

    @register(
        "tier_fill_reads_group_0",
        "the host tier restores a load into the blocks of KV cache group 0, not of the keyed group",
        outside=OUTSIDE,
    )
    def _tier_group_zero(stack: contextlib.ExitStack) -> None:
        # The keyed group's loaded blocks keep their old tenant's rows; the hit serves those.
        from omni_prefix_cache.reads.tier_fill import TierDesk

        _init_with(stack, set_attr, TierDesk, lambda args, kwargs: (args, {**kwargs, "group_index": 0}))
