"""The host tier's mutants (spec/host_tier.yaml), registered into the mutant
catalogue by ``register`` (the catalogue passes its own
``_register`` and ``_set``, so this module imports nothing of it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

Register = Callable[..., Callable[[Callable[[contextlib.ExitStack], None]], Callable[..., None]]]
# The composition's models assume the tier idle (tier_loads, tier_joins false): its own world and tests judge these.
OUTSIDE = "the host tier: its spec's world and tests, not the composition's"
SetAttr = Callable[[contextlib.ExitStack, Any, str, Any], None]


def register(register: Register, set_attr: SetAttr) -> None:
    """Register each mutant below with the catalogue."""

    @register(
        "tier_fill_skipped_at_save",
        "a save reuses a bound block without starting the host tier's fill",
        outside=OUTSIDE,
    )
    def _fill_skipped(stack: contextlib.ExitStack) -> None:
        # The entry stays BOUND to a block that now holds another tenant's
        # rows; a later load restores those.
        from omni_prefix_cache.reads.tier_fill import TierDesk

        set_attr(stack, TierDesk, "fill_reused", lambda self, slots: None)

    @register(
        "tier_release_keeps_bytes", "releasing a held entry of the host tier does not free its bytes", outside=OUTSIDE
    )
    def _release_keeps_bytes(stack: contextlib.ExitStack) -> None:
        import omni_prefix_cache.tier.store as store
        from omni_prefix_cache.specs import compile_machine, load_spec
        from omni_prefix_cache.specs.types.host_tier import TierState

        effects = {**store.TIER_EFFECTS, "drop_rows": lambda tier, entry, arg: setattr(entry, "rows", None)}
        leaky = compile_machine(load_spec("host_tier"), guards=store.TIER_GUARDS, effects=effects, state_enum=TierState)
        set_attr(stack, store, "TIER_MACHINE", leaky)

    @register(
        "tier_surplus_unreported",
        "a fill kept past the worker's byte bound (or lost) is never reported: the scheduler side offers it again",
        outside=OUTSIDE,
    )
    def _surplus_unreported(stack: contextlib.ExitStack) -> None:
        import omni_prefix_cache.tier.store as store
        from omni_prefix_cache.specs import compile_machine, load_spec
        from omni_prefix_cache.specs.types.host_tier import TierState

        effects = {**store.TIER_EFFECTS, "report_hash": lambda tier, entry, arg: None}
        silent = compile_machine(
            load_spec("host_tier"), guards=store.TIER_GUARDS, effects=effects, state_enum=TierState
        )
        set_attr(stack, store, "TIER_MACHINE", silent)
