"""Upstream vLLM-Omni's names, where upstream has them.

``UPSTREAM_ALL`` is upstream's ``vllm_omni.core.prefix_cache.__all__`` with the
module each name is imported from there (upstream 9b356ef); ``UPSTREAM_MODULE_NAMES``
the further names upstream's tests import from a module; ``UPSTREAM_MANAGER_SEAMS``
the manager attributes they read. Every one must resolve here at the same module
path (and the ``__all__`` ones from the package too). The seams are read by name
from that list, as upstream's tests read them; the runtime never does.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import omni_prefix_cache
from omni_prefix_cache import group_view
from omni_prefix_cache.adapter import PrefixCacheStep
from omni_prefix_cache.block_pool import PrefixBlockPool
from omni_prefix_cache.controller import OmniPrefixCacheController, StagingBufferHolder, StepD2HClaim, WriteTask
from omni_prefix_cache.group_view import (
    FullAttentionGroupView,
    check_prefix_cache_block_layout,
    check_prefix_cache_kv_transfer,
    check_prefix_cache_token_accounting,
    get_prefix_cache_group_view,
    stage_prefix_cache_config,
)
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheInvalidTypeError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    WriteSchedule,
    output_progress,
)
from omni_prefix_cache.writes.chunks import BudgetTicket, WriteChunk
from test_request_lifecycle import BS, Engine, K

UPSTREAM_ALL: list[tuple[str, str]] = [
    ("adapter", "PrefixCacheEventKind"),
    ("adapter", "PrefixCacheRequestEvent"),
    ("adapter", "PrefixCacheSchedulerAdapter"),
    ("adapter", "PrefixCacheStep"),
    ("adapter", "PrefixCacheWrite"),
    ("adapter", "PrefixCacheWriteLayout"),
    ("block_pool", "PrefixBlockPool"),
    ("controller", "OmniPrefixCacheController"),
    ("group_view", "FullAttentionGroupView"),
    ("group_view", "check_prefix_cache_kv_groups"),
    ("group_view", "check_prefix_cache_kv_transfer"),
    ("group_view", "get_prefix_cache_group_view"),
    ("group_view", "stage_prefix_cache_config"),
    ("interface", "HIDDEN_KEY"),
    ("interface", "ModelCachePolicy"),
    ("interface", "OmniPrefixCacheStagingTimeoutError"),
    ("interface", "OmniPrefixCacheUnmatchError"),
    ("interface", "PrefixCacheConfig"),
    ("interface", "StageCacheOutputs"),
    ("interface", "WriteSchedule"),
    ("manager", "OmniPrefixCacheManager"),
]

UPSTREAM_MODULE_NAMES: list[tuple[str, str]] = [
    ("adapter", "PrefixCacheRequestOwner"),
    ("controller", "StagingBufferHolder"),
    ("controller", "TaskState"),
    ("controller", "WriteSchedule"),
    ("controller", "WriteTask"),
    ("controller", "_BudgetTicket"),
    ("controller", "_WriteChunk"),
    ("group_view", "check_prefix_cache_block_layout"),
    ("group_view", "check_prefix_cache_token_accounting"),
    ("interface", "PrefixCacheRequestProgress"),
    ("manager", "_is_step_token_tensor"),
    ("manager", "_snapshot_leftover_mm_cpu"),
]

UPSTREAM_MANAGER_SEAMS = (
    "_finished_progress",
    "_hit_prefetch",
    "_hit_spans",
    "_join_finished_tids",
    "_request_progress",
    "_request_tasks",
)


@pytest.mark.parametrize("module, name", UPSTREAM_ALL + UPSTREAM_MODULE_NAMES)
def test_each_upstream_name_imports_from_upstreams_module_path(module: str, name: str) -> None:
    mod = importlib.import_module(f"omni_prefix_cache.{module}")
    # ``from omni_prefix_cache.<module> import <name>``, as upstream's code and tests write it.
    scope: dict[str, Any] = {}
    exec(f"from omni_prefix_cache.{module} import {name}", scope)
    assert scope[name] is getattr(mod, name)


@pytest.mark.parametrize("module, name", UPSTREAM_ALL)
def test_each_name_of_upstreams_all_is_the_packages_too(module: str, name: str) -> None:
    assert name in omni_prefix_cache.__all__
    scope: dict[str, Any] = {}
    exec(f"from omni_prefix_cache import {name}", scope)
    assert scope[name] is getattr(importlib.import_module(f"omni_prefix_cache.{module}"), name)


def test_the_controllers_upstream_chunk_names_are_the_chunk_types_and_nothing_else() -> None:
    controller = importlib.import_module("omni_prefix_cache.controller")
    assert controller._WriteChunk is WriteChunk
    assert controller._BudgetTicket is BudgetTicket
    with pytest.raises(AttributeError, match=r"omni_prefix_cache.controller' has no attribute '_NoSuch'"):
        getattr(controller, "_NoSuch")  # noqa: B009


# ------------------------------------------------------------------ manager seams


def seam(eng: Engine, name: str) -> Any:
    """Upstream's manager attribute ``name``, read as its tests read it."""
    assert name in UPSTREAM_MANAGER_SEAMS
    return getattr(eng.m, name)


@pytest.fixture
def eng() -> Iterator[Engine]:
    e = Engine()
    e.m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"codes"})))
    yield e
    e.m.shutdown()


def test_the_manager_seams_read_progress_hits_and_finish_escalations(eng: Engine) -> None:
    eng.blocks["a"], eng.blocks["b"] = [1, 2], [1, 3]
    out = eng.m.materialize(eng.step([eng.ev("a", K.STARTED)], {"a": (0, 4)}, mm=True), ["a"])
    tenure = output_progress(out)["a"]
    assert seam(eng, "_request_progress") == {"a": tenure} and seam(eng, "_request_progress")["a"] is tenure
    deferred = seam(eng, "_request_tasks").deferred["a"]
    assert not seam(eng, "_hit_spans") and not seam(eng, "_hit_prefetch")

    # A hit registered at new_step_starts, prefetching, until its save.
    eng.seq += 1
    eng.m.new_step_starts(PrefixCacheStep((eng.ev("b", K.STARTED, hit=BS, owner=2),), (("b", 1),), eng.seq))
    assert seam(eng, "_hit_spans") == {"b": (BS, [1])}
    futures = seam(eng, "_hit_prefetch")["b"]
    assert futures[HIDDEN_KEY].result(timeout=5)[:BS, 0].tolist() == [0.0, 1.0, 2.0, 3.0]

    # Finishing "a" escalates its open deferred write: listed until the next save.
    eng.seq += 1
    eng.m.new_step_starts(PrefixCacheStep((eng.ev("a", K.FINISHED),), (("b", 1),), eng.seq))
    assert seam(eng, "_join_finished_tids") == {deferred.tid}
    assert "a" not in seam(eng, "_request_progress") and seam(eng, "_finished_progress")["a"] is tenure
    eng.m.materialize(eng.step([], {"b": (4, 5)}), ["b"])
    assert not seam(eng, "_join_finished_tids") and not seam(eng, "_hit_spans") and not seam(eng, "_hit_prefetch")
    # Weak values: once no output holds the finished tenure, it is gone.
    del out, tenure
    assert "a" not in seam(eng, "_finished_progress")


# ------------------------------------------------------------------ controller names

# What upstream's manager (9b356ef) and tests call on the controller. The operations are the
# controller's own; the rest are compat's aliases of the parts that own them now (the runtime
# calls the parts). Upstream's manager also calls ``in_flight_tasks`` and ``staging_bind``, which
# this library never had.
UPSTREAM_CONTROLLER_OPERATIONS = ("dispatch", "escalate", "join", "join_host_ready", "register", "reserve", "shutdown")
UPSTREAM_CONTROLLER_ALIASES = (
    "append_chunk",
    "drain_completed",
    "drain_failed",
    "fetch_host",
    "get_task",
    "pin_budget",
    "stage_step_host",
    "staging_release",
    "submit",
)


def test_the_controller_answers_what_upstream_calls_on_it_through_its_parts() -> None:
    config = PrefixCacheConfig(num_blocks=4, block_size=BS)
    block_pool = PrefixBlockPool(config)
    block_pool.ensure_key(HIDDEN_KEY, torch.float32, 3)
    ctrl = OmniPrefixCacheController(block_pool, config, eager=False, committer="manual")
    try:
        for name in UPSTREAM_CONTROLLER_OPERATIONS + UPSTREAM_CONTROLLER_ALIASES:
            assert callable(getattr(ctrl, name)), name
        pool, registry = ctrl.parts.staging_pool, ctrl.parts.registry
        step = StagingBufferHolder.for_step(1)
        claim = ctrl.stage_step_host({HIDDEN_KEY: torch.ones(2, 3)}, 2, None, step)
        assert pool.holds(step) and claim.views[HIDDEN_KEY].sum().item() == 6
        ticket = BudgetTicket(nbytes=8)
        task = WriteTask(tid=1, req_id="a", write_n=1, schedule=WriteSchedule.JOIN_ON_FINISH, chunks=[_chunk([0])])
        ctrl.pin_budget(ticket, 1)
        ctrl.register(task, queued=False)
        assert ticket.tids == {1} and ctrl.get_task(1) is task is registry.get(1)
        assert ctrl.append_chunk(task, _chunk([1])) is None and len(task.chunks) == 2
        assert torch.equal(ctrl.fetch_host(task, torch.tensor([1, 0]), HIDDEN_KEY)[:, 0], torch.tensor([1.0, 0.0]))
        ctrl.escalate([1])
        while ctrl.parts.committer.step() is not None:
            pass
        assert ctrl.drain_failed() == [] and ctrl.drain_completed() == [1] and ctrl.get_task(1) is None
        assert block_pool.rows(HIDDEN_KEY, torch.tensor([0, 1]))[:, 0].tolist() == [0.0, 1.0]
        ctrl.staging_release(claim.page, step)
        assert not pool.holds(step)
    finally:
        ctrl.shutdown()


def test_the_staging_page_keeps_upstreams_name_staging_slot() -> None:
    def task(**page: int) -> WriteTask:
        return WriteTask(tid=1, req_id="r", write_n=1, schedule=WriteSchedule.JOIN_NEXT_STEP, chunks=[], **page)

    upstream = task(staging_slot=2)
    assert upstream.page == upstream.staging_slot == 2 and task(page=2).staging_slot == 2
    upstream.staging_slot = 3
    assert upstream.page == 3 and task().staging_slot is None
    with pytest.raises(OmniPrefixCacheInvalidTypeError, match="both page and staging_slot"):
        task(page=1, staging_slot=2)
    assert StepD2HClaim(page=4, views={}).staging_slot == 4


def _chunk(slots: list[int]) -> WriteChunk:
    """One deferred chunk: row ``i`` of ``slots`` holds the slot's own number."""
    rows = torch.tensor(slots, dtype=torch.float32).unsqueeze(1).expand(len(slots), 3).clone()
    return WriteChunk(torch.tensor(slots), {HIDDEN_KEY: rows})


# ------------------------------------------------------------------ group view entry points


def _batch(tables: Any) -> Any:
    return SimpleNamespace(req_ids=["r"], req_id_to_index={"r": 0}, num_computed_tokens_cpu=[0], block_table=tables)


class _Tables:
    """vLLM's ``MultiGroupBlockTable``: ``block_tables`` and ``[0]``."""

    def __init__(self, *groups: Any) -> None:
        self.block_tables = list(groups)

    def __getitem__(self, i: int) -> Any:
        return self.block_tables[i]


def _group(**layout: Any) -> Any:
    return SimpleNamespace(block_table=SimpleNamespace(cpu=torch.tensor([[5, 2]], dtype=torch.int32)), **layout)


FULL = SimpleNamespace(kv_cache_spec=type("FullAttentionSpec", (), {})())
SLIDING = SimpleNamespace(kv_cache_spec=type("SlidingWindowSpec", (), {})())


def test_get_prefix_cache_group_view_checks_the_groups_first_then_builds_the_view() -> None:
    view = get_prefix_cache_group_view(_batch(_Tables(_group())), BS, [FULL])
    assert isinstance(view, FullAttentionGroupView)
    assert view.step_slots_cpu(["r"], {"r": 6}).tolist() == [20, 21, 22, 23, 8, 9]
    assert get_prefix_cache_group_view(_batch(_Tables()), BS, [FULL]) is None  # no block table
    assert get_prefix_cache_group_view(_batch(None), BS, [FULL]) is None
    for groups in (None, [], [SLIDING], [SLIDING, SLIDING], [SimpleNamespace(kv_cache_spec=object())]):
        with pytest.raises(OmniPrefixCacheUnmatchError, match="single full-attention"):
            get_prefix_cache_group_view(_batch(_Tables()), BS, groups)
    # A hybrid model: the view reads the full-attention group's table (here the second).
    sliding_table = SimpleNamespace(block_table=SimpleNamespace(cpu=torch.tensor([[0, 7]], dtype=torch.int32)))
    hybrid = get_prefix_cache_group_view(_batch(_Tables(sliding_table, _group())), BS, [SLIDING, FULL])
    assert hybrid is not None and hybrid.group_index == 1
    assert hybrid.step_slots_cpu(["r"], {"r": 6}).tolist() == [20, 21, 22, 23, 8, 9]
    with pytest.raises(OmniPrefixCacheUnmatchError, match="kernel_block_size"):
        get_prefix_cache_group_view(_batch(_Tables(_group(blocks_per_kv_block=2))), BS, [FULL])


@pytest.mark.parametrize(
    "layout, says",
    [
        ({"use_hybrid_blocks": True}, "kernel_block_size"),
        ({"dcp_world_size": 2}, "decode context parallel"),
        ({"pcp_world_size": 2}, "prefill context parallel"),
        ({"kv_cache_block_size": 2 * BS}, "does not match"),
    ],
)
def test_check_prefix_cache_block_layout_refuses_what_the_slot_math_gets_wrong(layout: dict, says: str) -> None:
    check_prefix_cache_block_layout(_group(), BS)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=says):
        check_prefix_cache_block_layout(_group(**layout), BS)


def test_the_gate_checks_refuse_on_their_own_and_the_stage_config_calls_them(monkeypatch: pytest.MonkeyPatch) -> None:
    check_prefix_cache_kv_transfer(None)
    # Any role refuses (kv_connector_gate): a producer that loads is as wrong as a consumer.
    loaders = (
        SimpleNamespace(kv_role="kv_producer"),
        SimpleNamespace(is_kv_consumer=True),
        SimpleNamespace(kv_role="kv_both"),
    )
    for loader in loaders:
        with pytest.raises(OmniPrefixCacheUnmatchError, match="KV connector"):
            check_prefix_cache_kv_transfer(loader)
    cache = SimpleNamespace(enable_prefix_caching=True, block_size=BS, prefix_match_unit=None)
    check_prefix_cache_token_accounting(cache, None)
    check_prefix_cache_token_accounting(cache, SimpleNamespace(method="ngram"))  # drafts verified row by row
    with pytest.raises(OmniPrefixCacheUnmatchError, match="speculative decoding"):
        check_prefix_cache_token_accounting(cache, SimpleNamespace(method="ngram_gpu"))
    seen: list[Any] = []
    monkeypatch.setattr(group_view, "check_prefix_cache_kv_transfer", seen.append)
    config = stage_prefix_cache_config(
        kv_cache_config=SimpleNamespace(num_blocks=8, kv_cache_groups=[FULL]),
        cache_config=cache,
        kv_transfer_config="the connector",
        scheduler_config=SimpleNamespace(max_num_batched_tokens=16, max_model_len=32),
        model_config=None,
        is_pooling_model=False,
    )
    assert seen == ["the connector"] and config is not None and config.num_blocks == 8
