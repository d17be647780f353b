"""The typed stats snapshot, its dict view, the Prometheus collector, and the pool/budget logs."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path
from types import ModuleType

import pytest
import torch

from omni_prefix_cache import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.group_view import FullAttentionGroupView
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.ops.stats import FIELD_HELP, STAT_FIELDS, CacheStats

ROOT = Path(__file__).resolve().parents[1]


def _engine() -> ModuleType:
    """The minimal example's engine-side stand-ins (scheduler output, input batch, forward)."""
    spec = importlib.util.spec_from_file_location("example_minimal_engine", ROOT / "examples" / "minimal_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_two_requests(eng: ModuleType, **config: int) -> OmniPrefixCacheManager:
    """Request a prefills 8 tokens; b hits those 8 and computes 2; a finishes."""
    batch = eng.InputBatch()
    cfg = PrefixCacheConfig(num_blocks=16, block_size=4, staging_capacity_tokens=64, **config)
    mgr = OmniPrefixCacheManager(cfg, FullAttentionGroupView(batch, block_size=4), eager=True)
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"codes.audio"})))
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    mgr.new_step_starts(eng.SchedulerOutput({"a": 8}, [eng.NewRequest("a", 0, ([0, 1],))]))
    batch.set_rows({"a": (0, [0, 1])})
    mm = {"codes.audio": torch.ones((8, 4))}
    sid = mgr.save_outputs(eng.forward(prompt, 0), mm, num_tokens_unpadded=8, num_tokens_padded=8)
    mgr.materialize(sid, ["a"])
    mgr.new_step_starts(eng.SchedulerOutput({"b": 2}, [eng.NewRequest("b", 8, ([0, 1, 2],))], {"a"}))
    batch.set_rows({"b": (8, [0, 1, 2])})
    mm = {"codes.audio": torch.ones((2, 4))}
    sid = mgr.save_outputs(eng.forward([19, 20], 8), mm, num_tokens_unpadded=2, num_tokens_padded=2)
    mgr.discard_step(sid)
    return mgr


def test_snapshot_counts_queries_hits_steps_and_pool_bytes() -> None:
    mgr = _run_two_requests(_engine())
    try:
        snap = mgr.stats_snapshot()
        view = mgr.stats()
    finally:
        mgr.shutdown()
    assert isinstance(snap, CacheStats)
    assert (snap.prefix_queries_requests_total, snap.prefix_queries_tokens_total) == (2, 18)  # 8, then 8 + 2
    assert (snap.prefix_hits_requests_total, snap.prefix_hits_tokens_total) == (1, 8)
    assert snap.prefix_hit_rate_tokens == pytest.approx(8 / 18)
    assert (snap.steps_saved_total, snap.steps_materialized_total, snap.steps_discarded_total) == (2, 1, 1)
    assert snap.tokens_saved_total == 10 and snap.open_steps == 0 and snap.live_requests == 1
    slots = 16 * 4
    assert dict(snap.pool_bytes) == {HIDDEN_KEY: slots * 8 * 4, "codes.audio": slots * 4 * 4}
    assert snap.pool_bytes_total == slots * 12 * 4
    assert snap.failed_writes_total == 0 and snap.sticky_failure is False and snap.mode == "eager"
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.steps_saved_total = 0  # type: ignore[misc]
    # The dict view: every snapshot field by name, and the historical keys still there.
    for name in STAT_FIELDS:
        assert view[name] == snap.as_dict()[name], name
    for old in ("hit_requests", "hit_tokens", "steps_saved", "failed_writes", "queue_hi", "holders", "staged_bytes"):
        assert old in view
    assert view["hit_tokens"] == view["prefix_hits_tokens_total"] == 8


def test_budget_flushes_are_counted_and_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="omni_prefix_cache")
    eng = _engine()
    batch = eng.InputBatch()
    cfg = PrefixCacheConfig(num_blocks=16, block_size=4, staging_capacity_tokens=64, gpu_staging_bytes=1)
    mgr = OmniPrefixCacheManager(cfg, FullAttentionGroupView(batch, block_size=4), eager=True)
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"codes.audio"})))
    try:
        # One live request over three chunks: each save's deferred clone is over the
        # 1-byte budget while the previous chunk's deferred write is still pending.
        for step in range(3):
            new = [eng.NewRequest("a", 0, ([0, 1, 2],))] if step == 0 else []
            mgr.new_step_starts(eng.SchedulerOutput({"a": 4}, new))
            batch.set_rows({"a": (4 * step, [0, 1, 2])})
            hidden = eng.forward([1, 2, 3, 4], 4 * step)
            sid = mgr.save_outputs(
                hidden, {"codes.audio": torch.ones((4, 4))}, num_tokens_unpadded=4, num_tokens_padded=4
            )
            mgr.materialize(sid, ["a"])
        flushes = mgr.stats_snapshot().budget_flushes_total
    finally:
        mgr.shutdown()
    logged = [r for r in caplog.records if "staging budget full" in r.getMessage()]
    assert flushes >= 1 and len(logged) == flushes
    assert {r.levelno for r in logged} == {logging.DEBUG}


def test_each_pool_slab_is_logged_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="omni_prefix_cache")
    mgr = _run_two_requests(_engine())
    mgr.shutdown()
    opened = [r.getMessage() for r in caplog.records if "opened CPU pool slab" in r.getMessage()]
    assert len(opened) == 2
    assert any(repr(HIDDEN_KEY) in m and "64 slots x 8 float32" in m for m in opened)
    assert all(r.levelno == logging.INFO for r in caplog.records if "opened CPU pool slab" in r.getMessage())


def test_every_field_has_help() -> None:
    assert set(FIELD_HELP) == set(STAT_FIELDS)


def test_prometheus_collector_scrapes_the_snapshot() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from omni_prefix_cache.ops.metrics import OmniPrefixCacheCollector

    mgr = _run_two_requests(_engine())
    registry = prometheus_client.CollectorRegistry()
    registry.register(OmniPrefixCacheCollector(mgr, labels={"stage": "talker"}))
    try:
        text = prometheus_client.generate_latest(registry).decode()
    finally:
        mgr.shutdown()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    stage = (("stage", "talker"),)
    assert samples[("omni_prefix_cache_prefix_hits_tokens_total", stage)] == 8
    assert samples[("omni_prefix_cache_prefix_queries_requests_total", stage)] == 2
    assert samples[("omni_prefix_cache_steps_saved_total", stage)] == 2
    assert samples[("omni_prefix_cache_open_steps", stage)] == 0
    assert samples[("omni_prefix_cache_pool_bytes", (("key", "codes.audio"), *stage))] == 16 * 4 * 4 * 4
    assert samples[("omni_prefix_cache_mode_info", (("mode", "eager"), *stage))] == 1
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert types["omni_prefix_cache_budget_flushes"] == "counter"
    assert types["omni_prefix_cache_write_queue_depth_high"] == "gauge"


def test_stats_doc_lists_every_field() -> None:
    doc = (ROOT / "docs" / "stats.md").read_text()
    assert [name for name in STAT_FIELDS if f"| `{name}` |" not in doc] == []
