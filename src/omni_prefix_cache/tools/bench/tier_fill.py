"""The host tier's costs on the engine thread (docs/integration.md, "Behind a KV connector").

Three timings, each the median of ``REPEATS`` fresh eager managers (engine
thread wall time; the fills' fetches run on the prefetch thread and are
waited for outside the timing):

- ``save, blocks bound``: a save that writes ``BLOCKS`` blocks whose hashes
  the tier holds only in those slots (each reuse plans a fill: one planned
  read per key, copy on write of the old rows);
- ``save, nothing bound``: the same save into blocks the tier does not hold
  (the control: the difference is the fill's cost at reuse);
- ``new_step, restore``: a step whose KV connector loaded ``BLOCKS`` blocks,
  restored from the tier into new slots, beside ``new_step, plain``, the same
  step's hit with the rows already in its slots.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, cast

import torch

from omni_prefix_cache.interface import ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.tier.metadata import TierBind, TierLoad, TierStepMetadata
from omni_prefix_cache.tools.simulate.batch import SimInputBatch

BS, BLOCKS, WIDTH, REPEATS = 16, 32, 1024, 7


@dataclass(frozen=True, slots=True)
class TierFillTiming:
    """Medians in microseconds over ``REPEATS`` runs, for ``blocks`` blocks of ``width`` float32 rows."""

    blocks: int
    width: int
    save_bound_us: float
    save_unbound_us: float
    restore_us: float
    plain_hit_us: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _hash(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2


def _step(
    req: str, computed: int, blocks: list[int], n: int, finished: set[str], tier: TierStepMetadata | None
) -> SimpleNamespace:
    new = SimpleNamespace(req_id=req, num_computed_tokens=computed, block_ids=(blocks,))
    meta = None if tier is None else SimpleNamespace(omni_tier=tier)
    return SimpleNamespace(
        num_scheduled_tokens={req: n}, scheduled_new_reqs=[new], finished_req_ids=finished, kv_connector_metadata=meta
    )


def _saved(saved: Any) -> int:
    assert saved is not None, "the step saved nothing"
    return int(saved.step_id)


def _one(bound: bool) -> tuple[float, float, float]:
    """(save us, new_step us, hit-plain new_step us) of one fresh manager."""
    from omni_prefix_cache.engine_helper import PrefixCacheEngineHelper
    from omni_prefix_cache.group_view import FullAttentionGroupView
    from omni_prefix_cache.manager import OmniPrefixCacheManager

    n = BLOCKS * BS
    config = PrefixCacheConfig(num_blocks=4 * BLOCKS + 2, block_size=BS, staging_capacity_tokens=n)
    mgr = OmniPrefixCacheManager(config, eager=True)
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True))
    batch = SimInputBatch(BS)
    helper = PrefixCacheEngineHelper(mgr, FullAttentionGroupView(cast(Any, batch), block_size=BS), consumer="t")
    rows = torch.randn(n, WIDTH)
    first, other, target = list(range(BLOCKS)), list(range(BLOCKS, 2 * BLOCKS)), list(range(2 * BLOCKS, 3 * BLOCKS))
    try:
        helper.begin_step(_step("a", 0, first, n, set(), None))
        batch.set_step(["a"], {"a": first}, {"a": 0})
        mgr.discard_step(_saved(helper.save(rows, None, num_tokens_unpadded=n, num_tokens_padded=n)))
        binds = TierStepMetadata(bind=tuple(TierBind(_hash(i), b) for i, b in enumerate(first)))
        helper.begin_step(_step("c", 0, first if bound else other, n, {"a"}, binds))
        batch.set_step(["c"], {"c": first if bound else other}, {"c": 0})
        t0 = time.perf_counter()
        sid = helper.save(rows, None, num_tokens_unpadded=n, num_tokens_padded=n)
        save_us = (time.perf_counter() - t0) * 1e6
        mgr.discard_step(_saved(sid))
        tier = mgr.components.tier
        assert tier is not None
        tier.settle([_hash(i) for i in range(BLOCKS)], wait=True)  # the fills, off the timing
        # A load of a's blocks into new ones (bound: from the tier) or a's blocks hit in place.
        if bound:
            load = TierStepMetadata(loads={"d": TierLoad("d", 0, tuple(_hash(i) for i in range(BLOCKS)))})
            out = _step("d", n - BS, [*target, 3 * BLOCKS], BS, {"c"}, load)
        else:
            out = _step("d", n - BS, [*first, 3 * BLOCKS], BS, {"c"}, None)
        t0 = time.perf_counter()
        helper.begin_step(out)
        step_us = (time.perf_counter() - t0) * 1e6
        return save_us, step_us, step_us
    finally:
        mgr.shutdown()


def time_tier_fill() -> TierFillTiming:
    """The host tier's engine-thread costs (see the module docstring)."""
    torch.manual_seed(0)
    bound = [_one(True) for _ in range(REPEATS)]
    plain = [_one(False) for _ in range(REPEATS)]
    return TierFillTiming(
        blocks=BLOCKS,
        width=WIDTH,
        save_bound_us=statistics.median(b[0] for b in bound),
        save_unbound_us=statistics.median(p[0] for p in plain),
        restore_us=statistics.median(b[1] for b in bound),
        plain_hit_us=statistics.median(p[2] for p in plain),
    )


def tier_fill_lines(t: TierFillTiming) -> list[str]:
    """The report's lines for ``t``."""
    fill = t.save_bound_us - t.save_unbound_us
    restore = t.restore_us - t.plain_hit_us
    return [
        f"host tier, {t.blocks} blocks of {BS} x {t.width} float32 rows (eager, engine thread, p50 of {REPEATS}):",
        f"  save reusing bound blocks   {t.save_bound_us:9.0f} us   (nothing bound {t.save_unbound_us:9.0f} us: "
        f"fill at reuse {fill:+.0f} us, {fill / t.blocks:+.1f} us/block)",
        f"  new_step restoring a load   {t.restore_us:9.0f} us   (same hit in place {t.plain_hit_us:9.0f} us: "
        f"restore {restore:+.0f} us, {restore / t.blocks:+.1f} us/block)",
    ]


def main() -> None:
    for line in tier_fill_lines(time_tier_fill()):
        print(line)


if __name__ == "__main__":
    main()
