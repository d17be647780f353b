"""The host tier's exhaustive check finds nothing on the runtime, and names the
invariant a broken tier breaks."""

from __future__ import annotations

from unittest import mock

import omni_prefix_cache.tier.store as store
from omni_prefix_cache.specs import compile_machine, load_spec
from omni_prefix_cache.specs.types.host_tier import TierState
from omni_prefix_cache.testing.modelcheck.tier_check import check_tier


def test_the_tier_world_holds_every_invariant() -> None:
    result = check_tier(hashes=2, room=1, max_depth=7, raise_violation=True)
    assert result.violation is None, result.report()
    assert result.states > 50


def _with_effect(name: str, fn: object) -> object:
    effects = {**store.TIER_EFFECTS, name: fn}
    return compile_machine(load_spec("host_tier"), guards=store.TIER_GUARDS, effects=effects, state_enum=TierState)


def test_a_release_that_keeps_the_bytes_breaks_bytes_within_bound() -> None:
    leaky = _with_effect("drop_rows", lambda tier, entry, arg: setattr(entry, "rows", None))
    with mock.patch.object(store, "TIER_MACHINE", leaky):
        result = check_tier(hashes=2, room=1, max_depth=7)
    assert result.violation is not None and result.violation.startswith("bytes_within_bound"), result.report()


def test_a_reuse_that_keeps_the_block_breaks_block_iff_bound() -> None:
    sticky = _with_effect("unbind_block", lambda tier, entry, arg: None)
    with mock.patch.object(store, "TIER_MACHINE", sticky):
        result = check_tier(hashes=2, room=1, max_depth=7)
    assert result.violation is not None and result.violation.startswith("block_iff_bound"), result.report()
