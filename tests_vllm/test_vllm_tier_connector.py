"""OmniTierConnector (tier/connector.py) on vLLM 0.33's real Scheduler, wrapping the real
OffloadingConnector (CPU offload), with the fake worker of tools/simulate/vllm_offload.py:
what vLLM schedules when the wrapper caps a load, and what each step's tier metadata says."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_events import BlockRemoved
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from omni_prefix_cache.errors import OmniPrefixCacheUnmatchError
from omni_prefix_cache.tier.connector import NOT_FORWARDED, OmniTierConnector, OmniTierConnectorMetadata
from omni_prefix_cache.tier.metadata import TierStepMetadata
from omni_prefix_cache.tools.simulate.vllm_offload import OffloadHarness, OffloadOptions, StepRecord
from omni_prefix_cache.tools.simulate.vllm_setup import preempt_request

BS = 16
A = list(range(1, 4 * BS + 1))  # 4 full blocks
A2 = [*A, 7, 8, 9]  # A's 4 blocks, then 3 tokens to compute
SYNC = 1 << 30  # a sync-load budget every load fits


def harness(v: Any, **opts: Any) -> OffloadHarness:
    return OffloadHarness(OffloadOptions(block_size=BS, **opts), v)


def finish(h: OffloadHarness, req_id: str, prompt: list[int], max_tokens: int = 1) -> list[StepRecord]:
    h.add_request(req_id, prompt, max_tokens)
    records = []
    while req_id in h.sched.requests:
        records.append(h.step())
        assert len(records) < 50
    return records


def evict_gpu_copies(h: OffloadHarness, hashes: list[bytes]) -> list[StepRecord]:
    """Run requests that take every GPU block, until none of ``hashes`` is GPU-cached."""
    records: list[StepRecord] = []
    pool = h.sched.kv_cache_manager.block_pool
    for i in range(1, 6):
        records += finish(h, f"x{i}", list(range(1000 * i, 1000 * i + 14 * BS)))
        if all(pool.get_cached_block(x, [0]) is None for x in hashes):
            return records
    raise AssertionError("the GPU prefix cache kept A's blocks")


def stored_then_evicted(h: OffloadHarness) -> tuple[list[bytes], list[int], list[StepRecord]]:
    """Run A to the end (offloaded, retained by the tier), then evict its GPU blocks.
    Returns A's block hashes, its block ids and every step so far."""
    records = finish(h, "a", A)
    blocks = list(records[0].output.scheduled_new_reqs[0].block_ids[0])
    hashes = h.connector.kv_block_hashes(SimpleNamespace(block_hashes=_hashes(h, A)))
    records += evict_gpu_copies(h, hashes)
    return hashes, blocks, records


def _hashes(h: OffloadHarness, prompt: list[int]) -> list[bytes]:
    """The block hashes vLLM gives ``prompt`` (a throwaway Request, never scheduled)."""
    req = h.v.Request("probe", prompt, h.v.SamplingParams(max_tokens=1), None, block_hasher=h._hasher)
    return list(req.block_hashes)


def binds(records: list[StepRecord]) -> dict[bytes, int]:
    out: dict[bytes, int] = {}
    for r in records:
        assert r.tier is not None
        out.update((b.block_hash, b.block_id) for b in r.tier.bind)
    return out


def scheduled_new(record: StepRecord, req_id: str) -> Any:
    return next(n for n in record.output.scheduled_new_reqs if n.req_id == req_id)


# ------------------------------------------------------------ forwarding


def test_every_public_method_of_vllms_connector_base_is_forwarded() -> None:
    """A method a new vLLM adds to KVConnectorBase_V1 fails here instead of silently
    taking the base's default instead of reaching the wrapped connector."""
    public = {n for n in dir(KVConnectorBase_V1) if not n.startswith("_")} | {
        n for n in dir(SupportsHMA) if not n.startswith("_")
    }
    mro = OmniTierConnector.__mro__
    ours = mro[: mro.index(KVConnectorBase_V1)]  # OmniTierConnector, ForwardingConnector
    overridden = {n for n in public if any(n in c.__dict__ for c in ours)}
    assert public - overridden == set(NOT_FORWARDED)
    assert set(NOT_FORWARDED) <= public  # no stale exemption


def test_the_worker_side_hands_the_inner_its_own_metadata(v) -> None:
    h = harness(v)
    conn = h.connector
    calls: list[tuple[str, Any]] = []
    conn.inner = SimpleNamespace(
        bind_connector_metadata=lambda m: calls.append(("bind", m)),
        handle_preemptions=lambda m: calls.append(("preempt", m)),
        clear_connector_metadata=lambda: calls.append(("clear", None)),
    )
    inner = object()
    meta = OmniTierConnectorMetadata(inner=inner, omni_tier=TierStepMetadata())  # type: ignore[arg-type]
    conn.bind_connector_metadata(meta)
    assert conn.has_connector_metadata() and conn._get_connector_metadata() is meta
    conn.handle_preemptions(meta)
    conn.clear_connector_metadata()
    assert calls == [("bind", inner), ("preempt", inner), ("clear", None)]
    assert not conn.has_connector_metadata()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="given object, not the wrapper.s metadata"):
        conn.bind_connector_metadata(inner)  # type: ignore[arg-type]
    h.close()


def test_vllm_builds_the_wrapper_and_its_inner_from_the_config(v) -> None:
    h = harness(v)
    assert type(h.connector) is OmniTierConnector
    assert type(h.connector.inner).__name__ == "OffloadingConnector"
    assert h.connector.inner._kv_cache_manager is h.sched.kv_cache_manager
    assert h.connector.index.capacity == OffloadOptions().tier_max_bytes // (OffloadOptions().tier_bytes_per_token * BS)
    h.close()


# ------------------------------------------------------------ loads


def test_an_async_load_into_new_blocks_is_reported_when_its_request_is_scheduled(v) -> None:
    h = harness(v)
    hashes, a_blocks, records = stored_then_evicted(h)
    bound = binds(records)
    assert [bound[x] for x in hashes[:4]] == a_blocks[:4]  # A's finish bound its 4 blocks
    h.add_request("a2", A2, 2)
    alloc = h.step()
    (job,) = alloc.load_jobs.values()
    assert job.req_id == "a2" and not job.sync
    assert "a2" not in alloc.output.num_scheduled_tokens  # waits for the KV (WAITING_FOR_REMOTE_KVS)
    assert alloc.tier is not None and not alloc.tier.loads  # not reported before it runs
    assert alloc.finished_recving == {"a2"}
    run = h.step()
    new = scheduled_new(run, "a2")
    assert new.num_computed_tokens == 4 * BS
    assert run.output.num_scheduled_tokens["a2"] == len(A2) - 4 * BS
    assert list(new.block_ids[0][:4]) == [int(b) for b in job.dst_spec.block_ids]  # the blocks loaded into
    assert run.tier is not None
    load = run.tier.loads["a2"]
    assert (load.req_id, load.token_start, load.hashes) == ("a2", 0, tuple(hashes[:4]))
    assert h.connector.index.pinned("a2") == ()  # unpinned once reported
    h.close()


def test_a_sync_load_is_reported_in_the_step_that_allocates_it(v) -> None:
    h = harness(v, sync_load_budget_bytes=SYNC)
    hashes, _, _ = stored_then_evicted(h)
    h.add_request("a2", A2, 2)
    r = h.step()
    (job,) = r.load_jobs.values()
    assert job.sync and r.output.num_scheduled_tokens["a2"] == len(A2) - 4 * BS
    assert scheduled_new(r, "a2").num_computed_tokens == 4 * BS
    assert r.tier is not None and r.tier.loads["a2"].hashes == tuple(hashes[:4])
    assert r.tier.loads["a2"].token_start == 0
    h.close()


def test_a_load_after_a_local_hit_starts_at_the_local_hit(v) -> None:
    """token_start is the block-aligned local hit vLLM gave get_num_new_matched_tokens
    (request.num_computed_tokens is still 0 when update_state_after_alloc runs)."""
    h = harness(v, sync_load_budget_bytes=SYNC)
    hashes, _, _ = stored_then_evicted(h)
    finish(h, "p", A[: 2 * BS] + [5])  # A's first 2 blocks back in the GPU prefix cache, recomputed
    h.add_request("a2", A2, 2)
    r = h.step()
    assert scheduled_new(r, "a2").num_computed_tokens == 4 * BS
    assert r.tier is not None
    load = r.tier.loads["a2"]
    assert load.token_start == 2 * BS and load.hashes == tuple(hashes[2:4])
    h.close()


def test_a_whole_prompt_hit_stops_a_block_short_so_vllm_computes_the_last_block(v) -> None:
    """A hit covering the whole prompt would leave vLLM one token to recompute and a hit of
    num_tokens - 1 (not block aligned): the wrapper stops at the last whole block before the
    last token, as vLLM's own prefix cache does, and vLLM computes that block."""
    h = harness(v, sync_load_budget_bytes=SYNC)
    hashes, _, _ = stored_then_evicted(h)
    h.add_request("a3", A, 2)
    r = h.step()
    (job,) = r.load_jobs.values()
    # The inner chose async for its whole-prompt hit (sync needs a token left to compute).
    assert not job.sync and len(job.dst_spec.block_ids) == 3
    r = h.step()
    assert scheduled_new(r, "a3").num_computed_tokens == len(A) - BS
    assert r.output.num_scheduled_tokens["a3"] == BS
    assert r.tier is not None
    load = r.tier.loads["a3"]
    assert load.token_start == 0 and load.hashes == tuple(hashes[:3])
    h.close()


@pytest.mark.parametrize("sync", [0, SYNC], ids=["async", "sync"])
def test_a_hit_the_tier_covers_in_part_is_capped_and_vllm_computes_the_rest(v, sync: int) -> None:
    h = harness(v, sync_load_budget_bytes=sync)
    hashes, _, _ = stored_then_evicted(h)
    h.connector.index.forget(hashes[2:])  # the tier holds A's first 2 blocks only
    h.add_request("a2", A2, 2)
    r = h.step()
    (job,) = r.load_jobs.values()
    assert len(job.dst_spec.block_ids) == 2
    if not sync:
        r = h.step()
    assert scheduled_new(r, "a2").num_computed_tokens == 2 * BS
    assert r.output.num_scheduled_tokens["a2"] == len(A2) - 2 * BS
    assert r.tier is not None and r.tier.loads["a2"].hashes == tuple(hashes[:2])
    h.close()


def test_a_hit_the_tier_does_not_cover_from_its_first_block_loads_nothing(v) -> None:
    h = harness(v)
    hashes, _, _ = stored_then_evicted(h)
    req = h.add_request("a2", A2, 2)
    assert h.connector.inner.get_num_new_matched_tokens(req, 0)[0] == 4 * BS  # the offload has it all
    h.connector.index.forget(hashes[:1])
    r = h.step()
    assert not r.load_jobs
    assert scheduled_new(r, "a2").num_computed_tokens == 0
    assert r.output.num_scheduled_tokens["a2"] == len(A2)
    assert r.tier is not None and not r.tier.loads
    h.close()


# ------------------------------------------------------------ failed loads


def test_a_failed_async_load_is_cut_to_its_blocks_before_the_first_failed_one(v) -> None:
    h = harness(v)
    hashes, _, _ = stored_then_evicted(h)
    h.add_request("a2", A2, 2)
    alloc = h.step(fail_loads={"a2": 2})  # blocks 0-1 land, 2-3 fail
    assert alloc.invalid_block_ids and alloc.finished_recving == {"a2"}
    assert h.request("a2").num_computed_tokens == 2 * BS  # vLLM: the valid prefix
    r = h.step()
    assert scheduled_new(r, "a2").num_computed_tokens == 2 * BS
    assert r.output.num_scheduled_tokens["a2"] == len(A2) - 2 * BS
    assert r.tier is not None and r.tier.loads["a2"].hashes == tuple(hashes[:2])
    h.close()


def test_an_async_load_failed_from_its_first_block_is_dropped_and_the_retry_reported(v) -> None:
    """vLLM frees the blocks of a load that failed whole and looks the request up again:
    the wrapper never reports the failed load, only the retry's, when that one runs."""
    h = harness(v)
    hashes, _, _ = stored_then_evicted(h)
    h.add_request("a2", A2, 2)
    failed = h.step(fail_loads={"a2"})
    assert len(failed.invalid_block_ids) == 4
    assert h.request("a2").num_computed_tokens == 0
    assert h.connector.index.pinned("a2") == () and "a2" not in h.connector._pending
    retry = h.step()
    (job,) = retry.load_jobs.values()
    assert job.req_id == "a2" and not job.sync
    assert retry.tier is not None and not retry.tier.loads
    run = h.step()
    assert scheduled_new(run, "a2").num_computed_tokens == 4 * BS
    assert run.tier is not None and run.tier.loads["a2"].hashes == tuple(hashes[:4])
    h.close()


def test_a_failed_sync_load_stays_reported_and_vllm_recomputes_from_the_failed_block(v) -> None:
    h = harness(v, sync_load_budget_bytes=SYNC)
    hashes, _, _ = stored_then_evicted(h)
    h.add_request("a2", A2, 2)
    r = h.step(fail_loads={"a2": 1})
    assert r.tier is not None and r.tier.loads["a2"].hashes == tuple(hashes[:4])  # sent before the failure
    assert h.request("a2").num_computed_tokens == BS
    nxt = h.step()
    cached = nxt.output.scheduled_cached_reqs
    i = cached.req_ids.index("a2")
    assert cached.num_computed_tokens[i] == BS
    assert nxt.output.num_scheduled_tokens["a2"] == len(A2) - BS
    assert nxt.tier is not None and not nxt.tier.loads
    h.close()


# ------------------------------------------------------------ abort, preemption


def test_an_aborted_request_drops_its_load_in_flight(v) -> None:
    h = harness(v)
    hashes, _, _ = stored_then_evicted(h)
    h.hold_async_loads = True
    h.add_request("a2", A2, 2)
    h.step()
    assert h.connector.index.pinned("a2") == tuple(hashes[:4])
    h.sched.finish_requests("a2", h.v.RequestStatus.FINISHED_ABORTED)
    assert h.connector.index.pinned("a2") == ()
    assert "a2" not in h.connector._pending
    h.close()


def test_a_preempted_request_resumes_with_its_load_reported_as_resumed(v) -> None:
    """vLLM 0.33 never preempts a request whose load is pending (it waits, not runs);
    a request preempted after its load and resumed with a new one is reported through
    scheduled_cached_reqs.resumed_req_ids."""
    h = harness(v, sync_load_budget_bytes=SYNC)
    hashes, _, _ = stored_then_evicted(h)
    h.add_request("a2", A2, 4)
    h.step()  # sync load of A's 4 blocks, prefill of the rest
    h.step()  # decode
    req = h.request("a2")
    a2_blocks = set(h.sched.kv_cache_manager.get_block_ids("a2")[0])
    preempt_request(h.sched, req, 0.0)
    # Its freed blocks leave vLLM's prefix cache, so the resume loads them again.
    h.sched.kv_cache_manager.evict_blocks(a2_blocks)
    seen = []
    while "a2" in h.sched.requests and len(seen) < 20:
        seen.append(h.step())
    resumed = [r for r in seen if "a2" in r.output.scheduled_cached_reqs.resumed_req_ids]
    assert resumed
    assert resumed[0].tier is not None
    load = resumed[0].tier.loads["a2"]
    assert load.token_start == 0 and load.hashes == tuple(hashes[:4])
    assert any(j.req_id == "a2" for j in resumed[0].load_jobs.values())
    assert seen[0].output.preempted_req_ids == {"a2"} or "a2" in seen[0].output.preempted_req_ids
    assert h.connector.index.pinned("a2") == ()
    h.close()


# ------------------------------------------------------------ eviction


def test_a_small_tier_releases_older_hashes_and_vllm_then_recomputes_them(v) -> None:
    h = harness(v, tier_max_bytes=6 * BS * 256, tier_bytes_per_token=256)
    assert h.connector.index.capacity == 6
    hashes, _, records = stored_then_evicted(h)
    released = {x for r in records if r.tier is not None for x in r.tier.release}
    assert set(hashes[:4]) <= released
    assert all(x not in h.connector.index for x in hashes)
    req = h.add_request("a2", A2, 2)
    assert h.connector.inner.get_num_new_matched_tokens(req, 0)[0] == 4 * BS  # still offloaded
    r = h.step()
    assert not r.load_jobs
    assert scheduled_new(r, "a2").num_computed_tokens == 0
    assert r.output.num_scheduled_tokens["a2"] == len(A2)
    h.close()


def test_blocks_the_offload_evicts_are_released_by_the_tier(v) -> None:
    """With KV events on, the OffloadingConnector's BlockRemoved (CPU) makes the tier
    forget those blocks (vLLM 0.33's events carry int hashes: the wrapper maps them back)."""
    h = harness(v, cpu_bytes=20 * 8192)  # 20 offloaded blocks: the x requests push some out
    inner_take = h.connector.inner.take_events
    removed: list[object] = []

    def spy() -> list[Any]:
        events = list(inner_take())
        removed.extend(x for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU" for x in e.block_hashes)
        return events

    h.connector.inner.take_events = spy
    _, _, records = stored_then_evicted(h)
    records.append(h.step())  # what the last update_from_output forgot goes out now
    bound = binds(records)
    gone = {x for x in bound if maybe_convert_block_hash(x) in removed}
    assert gone and len(gone) == len(removed)
    assert all(x not in h.connector.index for x in gone)
    released = [x for r in records if r.tier is not None for x in r.tier.release]
    assert set(released) == gone and len(released) == len(gone)
    h.close()


def test_each_step_reports_a_hash_once(v) -> None:
    h = harness(v, sync_load_budget_bytes=SYNC)
    _, _, records = stored_then_evicted(h)
    for r in records:
        assert isinstance(r.output.kv_connector_metadata, OmniTierConnectorMetadata)
        assert r.tier is not None
        bound = [b.block_hash for b in r.tier.bind]
        assert len(bound) == len(set(bound)) and len(r.tier.release) == len(set(r.tier.release))
    h.close()


# ------------------------------------------------------------ what the worker reports back


def test_a_tier_budget_below_one_block_is_refused_naming_the_config_key(v) -> None:
    """The scheduler side's startup check names omni_tier_max_bytes (it used to say TierIndex max_bytes)."""
    with pytest.raises(Exception, match=r"'omni_tier_max_bytes'\]=4095 holds no block.*omni_tier_bytes_per_token"):
        harness(v, tier_max_bytes=BS * 256 - 1, tier_bytes_per_token=256)


def test_hashes_the_worker_reports_are_forgotten_and_never_offered_again(v) -> None:
    """A hash the worker's tier does not keep (a lost fill, a surplus past its bound) rides back in the
    step's kv_connector_worker_meta; the scheduler side forgets it, so vLLM recomputes those blocks."""
    from omni_prefix_cache.tier import channel

    h = harness(v)
    hashes, _, _ = stored_then_evicted(h)
    assert all(x in h.connector.index for x in hashes[:4])
    reports = channel.TierReports()
    channel.open_reports(reports)
    try:
        reports.report(hashes[1:2])  # block 1's fill was lost on the worker
        out = h.step()  # the fake worker's output carries it (OmniTierWorkerMetadata.forget)
    finally:
        channel.close_reports(reports)
    assert hashes[1] not in h.connector.index and h.connector.forgotten == 1
    assert out.tier is not None
    h.add_request("a2", A2, 2)
    r = h.step()
    r = h.step() if not r.tier or "a2" not in r.tier.loads else r
    assert r.tier is not None and r.tier.loads["a2"].hashes == tuple(hashes[:1])  # capped before the lost block
    assert scheduled_new(r, "a2").num_computed_tokens == BS
    h.close()


def test_a_reported_hash_pinned_by_a_pending_load_is_released_after_the_load(v) -> None:
    """Reported while an async load of it is in flight: the load still goes out (the worker kept the rows
    as a surplus), and the release follows the unpin."""
    from omni_prefix_cache.tier import channel

    h = harness(v)
    hashes, _, _ = stored_then_evicted(h)
    h.hold_async_loads = True
    h.add_request("a2", A2, 2)
    h.step()
    assert h.connector.index.pinned("a2") == tuple(hashes[:4])
    reports = channel.TierReports()
    channel.open_reports(reports)
    try:
        reports.report(hashes[2:3])
        held = h.step()
    finally:
        channel.close_reports(reports)
    assert hashes[2] in h.connector.index  # pinned: forgotten once the load is reported
    assert held.tier is not None and hashes[2] not in held.tier.release
    run = h.release_loads()
    while run.tier is not None and "a2" not in run.tier.loads:
        run = h.step()
    assert run.tier is not None and run.tier.loads["a2"].hashes == tuple(hashes[:4])
    assert hashes[2] not in h.connector.index
    after = h.step()
    assert after.tier is not None and hashes[2] in after.tier.release
    h.close()


def test_workers_metadata_aggregates_the_inners_and_the_reported_hashes(v) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    from omni_prefix_cache.tier.connector import OmniTierWorkerMetadata

    assert OmniTierWorkerMetadata.of(None, ()) is None
    a = OmniTierWorkerMetadata.of(OffloadingWorkerMetadata(completed_jobs={1: 1}), (b"x",))
    b = OmniTierWorkerMetadata.of(OffloadingWorkerMetadata(completed_jobs={2: 1}), (b"y", b"x"))
    c = OmniTierWorkerMetadata.of(None, (b"z",))
    both = a.aggregate(b).aggregate(c)
    assert both.forget == (b"x", b"y", b"z")
    assert both.inner.completed_jobs == {1: 1, 2: 1}
    with pytest.raises(OmniPrefixCacheUnmatchError, match="not the wrapper's worker metadata"):
        a.aggregate(OffloadingWorkerMetadata(completed_jobs={}))


# ------------------------------------------------------------ vLLM 0.33 facts docs/integration.md relies on
# ("What a new deployment needs to know"): a vLLM upgrade that changes one fails here, so the docs follow.


def test_kv_events_alone_publish_on_a_zmq_socket_and_null_binds_none() -> None:
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory, NullEventPublisher

    on = KVEventsConfig(enable_kv_cache_events=True)
    assert (on.publisher, on.endpoint) == ("zmq", "tcp://*:5557")
    quiet = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert isinstance(EventPublisherFactory.create(quiet), NullEventPublisher)


def test_the_scheduler_reads_the_wrappers_load_failure_policy_and_the_inner_inherits_it(v) -> None:
    from vllm.config import KVTransferConfig

    assert KVTransferConfig().kv_load_failure_policy == "fail"
    h = harness(v)  # the harness sets kv_load_failure_policy="recompute" on the wrapper
    assert h.sched.recompute_kv_load_failures
    assert h.connector.inner._kv_transfer_config.kv_load_failure_policy == "recompute"
    h.close()
    failing = harness(v, kv_load_failure_policy="fail")  # vLLM's default: a failed load fails its request
    assert not failing.sched.recompute_kv_load_failures
    assert failing.connector.inner._kv_transfer_config.kv_load_failure_policy == "fail"
    failing.close()


def test_a_finished_id_readmitted_at_once_breaks_the_offloading_connectors_scheduler_side(v) -> None:
    """vLLM 0.33's OffloadingConnector drops its state for an id with the finished request's cleanup one
    step after the finish; a new request under the same id, added at once and decoded, hits KeyError."""
    h = harness(v)
    h.add_request("a", [*A, 9], 4)
    while "a" in h.sched.requests:
        h.step()
    h.add_request("a", [*A, 5, 6], 4)
    with pytest.raises(KeyError, match="'a'"):
        for _ in range(12):
            h.step()
    h.close()
