"""Regression tests of the facade's contract hardening (issue 11): every bad
input and fault gets one of the documented errors, and a rejected call
changes nothing.

Each test names the numbered case of the issue it pins.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import omni_prefix_cache
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
)
from omni_prefix_cache.manager import PREFETCH_THREAD_PREFIX, OmniPrefixCacheManager
from test_manager import (
    MODES,
    Req,
    assert_nothing_held,
    make,
    quiesce,
    start_step,
)


def manager_state(mgr: OmniPrefixCacheManager) -> dict[str, Any]:
    """Every manager-owned table, by value: a rejected call must leave it equal."""
    rt = mgr._ledger.requests
    with mgr._state_lock:
        return {
            "live": set(mgr._live),
            "pending_sched": mgr._pending_sched,
            "pending_hits": dict(mgr._hits.pending),
            "next_step_id": mgr._steps.next_id,
            "step_ctxs": dict(mgr._step_ctxs),
            "records": dict(mgr._ledger.records),
            "tasks": {r: dict(t) for r, t in rt.tasks.items()},
            "deferred": dict(rt.deferred),
            "opened": dict(rt.opened),
            "pending_reads": set(mgr._reads.pending),
            "layouts": dict(mgr._layout.known),
            "counters": dict(mgr._counters),
            "policy": mgr._policy,
            "failure": mgr._ledger.failure,
            "occupancy": {k: mgr._slot_status.state[k].clone() for k in mgr._slot_status.keys()},
        }


@contextmanager
def background_drain_paused(mgr: OmniPrefixCacheManager) -> Iterator[None]:
    """While inside, the committer thread does not drain: after a pass that
    wrote it runs the manager's ``_drain_off_engine`` (its ``after_write``),
    which settles published writes in the manager's tables whenever the
    state lock is free, so a before/after comparison could see a drain the
    call under test never ran. Entering settles what is published so far; a
    drain already under way finds nothing new (the committer publishes
    nothing while it runs one). Writes still run; only their settling waits
    for the next facade entry, as it does when the state lock is busy."""
    committer = mgr._controller._committer
    saved = committer._after_write
    committer._after_write = lambda: None
    try:
        with mgr._state_lock:
            mgr._ledger.commit_drained_locked()
        yield
    finally:
        committer._after_write = saved


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for name in before:
        a, b = before[name], after[name]
        if name == "occupancy":
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        elif name == "pending_reads":
            assert b <= a, name  # the prefetch thread forgets reads it has fetched
        else:
            assert a == b, (name, a, b)


def sched(new: list[Any] = (), finished: Any = (), num: Any = None) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=list(new), finished_req_ids=finished, num_scheduled_tokens=num or {})


def new_req(rid: Any, computed: Any = 0, blocks: Any = ((),)) -> SimpleNamespace:
    return SimpleNamespace(req_id=rid, num_computed_tokens=computed, block_ids=blocks)


# ============================================================ the error types


def test_error_types_are_importable_where_the_errors_live_and_say_what_they_are() -> None:
    from omni_prefix_cache import interface

    for name in (
        "OmniPrefixCacheUnmatchError",
        "OmniPrefixCacheInvalidArgumentError",
        "OmniPrefixCacheInvalidTypeError",
        "OmniPrefixCacheWriteFailedError",
        "OmniPrefixCacheShutdownError",
        "OmniPrefixCacheStagingTimeoutError",
    ):
        assert getattr(omni_prefix_cache, name) is getattr(interface, name)
        assert issubclass(getattr(interface, name), OmniPrefixCacheUnmatchError)
    assert issubclass(OmniPrefixCacheInvalidArgumentError, ValueError)
    assert issubclass(OmniPrefixCacheInvalidTypeError, TypeError)
    assert issubclass(OmniPrefixCacheInvalidTypeError, OmniPrefixCacheInvalidArgumentError)
    for kind in (OmniPrefixCacheWriteFailedError, OmniPrefixCacheShutdownError, OmniPrefixCacheStagingTimeoutError):
        assert not issubclass(kind, (ValueError, TypeError))


# ============================================================ 1. eager write failures are library errors


def _fail_pool_writes(mgr: OmniPrefixCacheManager, key: str) -> list[BaseException]:
    real = mgr._pool.write
    raised: list[BaseException] = []

    def failing(k: str, slots: torch.Tensor, host: torch.Tensor) -> None:
        if k == key:
            exc = RuntimeError(f"injected pool write failure on {k}")
            raised.append(exc)
            raise exc
        real(k, slots, host)

    mgr._pool.write = failing
    return raised


def _assert_write_failed(exc: OmniPrefixCacheWriteFailedError, cause: BaseException, req: str, key: str) -> None:
    assert exc.__cause__ is cause
    assert exc.req_id == req and key in exc.keys and exc.tid is not None and exc.slots
    assert f"{req!r}" in str(exc) and key in str(exc) and "injected" in str(exc)


@pytest.mark.parametrize("eager", MODES)
def test_1_a_failed_pool_write_raises_the_write_failed_error_naming_it(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    drv.check(sid, want)
    quiesce(mgr)
    raised = _fail_pool_writes(mgr, "m")
    if eager:
        with pytest.raises(OmniPrefixCacheWriteFailedError) as info:
            drv.run({"b": Req([1], 0, 4)})
    else:
        sid, _ = drv.run({"b": Req([1], 0, 4)})
        tids = [t.tid for t in list(mgr._controller.parts.registry.tasks.values()) if t.req_id == "b"]
        with pytest.raises(OmniPrefixCacheWriteFailedError) as info:
            mgr._controller.join(tids)
        mgr.discard_step(sid)
    _assert_write_failed(info.value, raised[0], "b", "m")
    assert info.value.slots == tuple(drv.view.slot_ids("b", 0, 4))
    # Sticky, with the same details and cause, from every serving entry.
    for _ in range(2):
        with pytest.raises(OmniPrefixCacheWriteFailedError) as again:
            start_step(mgr, drv.view, {"c": Req([2], 0, 4)})
        _assert_write_failed(again.value, raised[0], "b", "m")
    assert_nothing_held(mgr)


def test_1_an_eager_deferred_write_failing_at_finish_raises_the_write_failed_error(managers: list) -> None:
    policy = ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"d"}))
    mgr, drv = make(True, policy)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([1], 0, 4)})
    drv.check(sid, want)
    raised = _fail_pool_writes(mgr, "d")
    with pytest.raises(OmniPrefixCacheWriteFailedError) as info:
        mgr.new_step_starts(sched(finished={"a"}))  # escalates a's deferred write, inline
    _assert_write_failed(info.value, raised[0], "a", "d")
    with pytest.raises(OmniPrefixCacheWriteFailedError):
        mgr.new_step_starts(sched())


# ============================================================ 2. validate, then mutate


@pytest.mark.parametrize("eager", MODES)
def test_2_a_rejected_new_step_starts_changes_nothing_and_its_retry_loses_nothing(eager: bool, managers: list) -> None:
    """A call rejected for one bad request leaves every table as it was,
    finished requests included; the corrected call then drops the finished
    request, so its id returning with a hit gets the full prefix."""
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0, 1], 0, 8)})
    drv.check(sid, want)
    drv.view.order = ["b"]
    drv.view.blocks["b"], drv.view.start["b"] = [2], 0
    good_b = new_req("b", 0, ([2],))
    bad_calls = [
        sched([good_b, new_req("x", 6, ([0, 1],))], {"a"}, {"b": 4}),  # x's hit is not block aligned
        sched([good_b, new_req("x", 8, ([0],))], {"a"}, {"b": 4}),  # too few group-0 block ids
        sched([good_b], ["a", ["unhashable"]], {"b": 4}),  # a finished id that is no str
        sched([good_b], "a", {"b": 4}),  # a bare str, not a collection of ids
        sched([good_b], {"a"}, {"b": -4}),  # negative scheduled count
        sched([good_b], {"a"}, {"b": 4.0}),  # float scheduled count
        sched([good_b, new_req(7)], {"a"}, {"b": 4}),  # a request id that is no str
        sched([good_b, new_req("x", -4)], {"a"}, {"b": 4}),  # negative computed count
        sched([good_b, new_req("x", 4, ([0.0],))], {"a"}, {"b": 4}),  # a float block id
        sched([good_b], {"a"}, [("b", 4)]),  # not a mapping
    ]
    for call in bad_calls:
        with background_drain_paused(mgr):
            before = manager_state(mgr)
            with pytest.raises(OmniPrefixCacheInvalidArgumentError):
                mgr.new_step_starts(call)
            assert_same_state(before, manager_state(mgr))
    # The retry of the same step, corrected.
    mgr.new_step_starts(sched([good_b], {"a"}, {"b": 4}))
    drv.live = {"b"}
    values = [float(s) for s in drv.view.slot_ids("b", 0, 4)]
    sid = mgr.save_outputs(drv.rows(HIDDEN_KEY, values), {"m": drv.rows("m", values)}, num_tokens_unpadded=4,
                           num_tokens_padded=4)  # fmt: skip
    mgr.discard_step(sid)
    assert "a" not in mgr._live
    # a's id comes back as a new request with a hit on its own blocks.
    sid, want = drv.run({"a": Req([0, 1, 3], 8, 2, hit=8)})
    assert want["a"][HIDDEN_KEY].shape[0] == 10
    drv.check(sid, want)
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_2_a_rejected_save_keeps_the_snapshot_so_the_corrected_save_follows(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0, 1], 0, 8)})
    drv.check(sid, want)
    start_step(mgr, drv.view, {"b": Req([0, 1, 2], 8, 2, hit=8)})
    drv.live.add("b")
    values = [float(s) for s in drv.view.slot_ids("b", 8, 10)]
    hidden, mm = drv.rows(HIDDEN_KEY, values), {"m": drv.rows("m", values)}
    bad_saves: list[tuple[Any, Any, Any, Any]] = [
        (hidden, mm, None, 2),
        (hidden, mm, 2.0, 2),
        (hidden, mm, True, 2),
        (hidden, mm, 3, 3),  # the slot mapping covers 2 tokens
        (hidden, mm, 2, 1),  # padded < unpadded
        (hidden[:1], mm, 2, 2),  # too few hidden rows
        (hidden.double(), mm, 2, 2),  # the hidden key changes dtype
        (hidden[:, :4], mm, 2, 2),  # the hidden key changes width
        (torch.empty(2, 8, device="meta"), mm, 2, 2),  # a device the cache cannot copy from
        (hidden, {"m": torch.empty(2, 3, device="meta")}, 2, 2),
        (hidden, {"m": [torch.empty(1, device="meta")]}, 2, 2),
        (hidden, {HIDDEN_KEY: hidden}, 2, 2),  # the reserved name
        (hidden, {5: hidden}, 2, 2),  # a name that is no str
        (hidden, [("m", mm["m"])], 2, 2),  # not a mapping
        ("hidden", mm, 2, 2),
        (None, mm, 2, 2),  # the policy caches hidden states
    ]
    for h, m, n, p in bad_saves:
        with background_drain_paused(mgr):
            before = manager_state(mgr)
            with pytest.raises(OmniPrefixCacheInvalidArgumentError):
                mgr.save_outputs(h, m, num_tokens_unpadded=n, num_tokens_padded=p)
            assert_same_state(before, manager_state(mgr))
    truth = drv.truth
    for key in (HIDDEN_KEY, "m"):
        for s, v in zip(drv.view.slot_ids("b", 8, 10), values):
            truth[key][s] = v
    sid = mgr.save_outputs(hidden, mm, num_tokens_unpadded=2, num_tokens_padded=2)
    out = mgr.materialize(sid, ["b"])
    want = drv.rows(HIDDEN_KEY, [truth[HIDDEN_KEY][s] for s in drv.view.slot_ids("b", 0, 10)])
    assert torch.equal(out.hidden_states["b"], want)
    assert_nothing_held(mgr)


# ============================================================ 3. shutdown


@pytest.mark.parametrize("eager", MODES)
def test_3_every_entry_after_shutdown_raises_the_shutdown_error_and_nothing_is_held(
    eager: bool, managers: list
) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    drv.check(sid, want)
    saved, _ = drv.run({"b": Req([1], 0, 4)})
    start_step(mgr, drv.view, {"c": Req([0, 2], 4, 1, hit=4)})  # a pending hit, never saved
    mgr.shutdown()
    mgr.shutdown()  # idempotent
    calls = {
        f"materialize(step {saved})": lambda: mgr.materialize(saved, ["b"]),
        f"discard_step(step {saved})": lambda: mgr.discard_step(saved),
        "register_policy": lambda: mgr.register_policy(ModelCachePolicy()),
        "new_step_starts": lambda: mgr.new_step_starts(sched()),
        "save_outputs": lambda: mgr.save_outputs(None, {}, num_tokens_unpadded=0, num_tokens_padded=0),
    }
    for name, call in calls.items():
        with pytest.raises(OmniPrefixCacheShutdownError, match=re.escape(name)):
            call()
    mgr._hits.prefetch.shutdown(wait=True)
    assert not mgr._step_ctxs and not mgr._hits.pending and not mgr._reads.pending
    assert not mgr._controller.parts.staging_pool.holders()
    assert mgr.stats()["open_steps"] == 0


@pytest.mark.parametrize("eager", MODES)
def test_3_a_materialize_waiting_on_a_hit_read_cancelled_by_shutdown_raises_the_shutdown_error(
    eager: bool, managers: list
) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    drv.check(sid, want)
    # Keep both prefetch workers busy so the hit's read stays queued.
    release = threading.Event()
    for _ in range(2):
        mgr._hits.prefetch.submit(release.wait, 10)
    sid, _ = drv.run({"b": Req([0, 1], 4, 1, hit=4)}, finished=["a"])
    waiting = threading.Event()
    real = mgr._materializer.hit_rows

    def hit_rows(*args: Any) -> torch.Tensor:
        waiting.set()
        return real(*args)

    mgr._materializer.hit_rows = hit_rows
    got: list[BaseException] = []

    def consume() -> None:
        try:
            mgr.materialize(sid, ["b"])
        except BaseException as exc:  # noqa: BLE001 - recorded for the assert
            got.append(exc)

    thread = threading.Thread(target=consume)
    thread.start()
    assert waiting.wait(10)
    # Whether the read is cancelled before or while materialize waits on it,
    # the answer is the shutdown error.
    mgr.shutdown()
    release.set()
    thread.join(10)
    assert not thread.is_alive()
    assert len(got) == 1 and isinstance(got[0], OmniPrefixCacheShutdownError), got
    assert not mgr._controller.parts.staging_pool.holders()


# ============================================================ 4. bounded tables: see test_long_run_tables_stay_bounded


@pytest.mark.parametrize("eager", MODES)
def test_4_a_finished_request_leaves_no_entry_behind(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    for i in range(6):
        rid = f"r{i}"
        sid, want = drv.run({rid: Req([i % 4], 0, 4)}, finished=[f"r{i - 1}"] if i else [])
        drv.check(sid, want)
    mgr.new_step_starts(sched(finished={"r5"}))
    quiesce(mgr)
    mgr.new_step_starts(sched())
    rt = mgr._ledger.requests
    assert not mgr._live and not rt.opened and not rt.tasks and not rt.deferred and not mgr._ledger.records


# ============================================================ 5. bad devices, None counts, faults off the write path


@pytest.mark.parametrize("eager", MODES)
def test_5_device_and_none_count_are_invalid_arguments(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    start_step(mgr, drv.view, {"a": Req([0], 0, 4)})
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match="device meta"):
        mgr.save_outputs(torch.zeros(4, 8, device="meta"), {}, num_tokens_unpadded=4, num_tokens_padded=4)
    with pytest.raises(OmniPrefixCacheInvalidTypeError, match="num_tokens_unpadded must be an int, got NoneType"):
        mgr.save_outputs(torch.zeros(4, 8), {}, num_tokens_unpadded=None, num_tokens_padded=4)
    sid = mgr.save_outputs(torch.zeros(4, 8), {}, num_tokens_unpadded=4, num_tokens_padded=4)
    mgr.discard_step(sid)
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_5_a_failed_staging_copy_names_the_step_and_loses_only_that_step(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    pool = mgr._controller.parts.staging_pool
    real = pool.views
    cause = RuntimeError("injected staging view failure")

    def failing(*args: Any) -> torch.Tensor:
        raise cause

    pool.views = failing
    start_step(mgr, drv.view, {"a": Req([0], 0, 4)})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"step 1: copying keys .* into staging page 0") as info:
        mgr.save_outputs(torch.zeros(4, 8), {}, num_tokens_unpadded=4, num_tokens_padded=4)
    assert info.value.__cause__ is cause and not isinstance(info.value, OmniPrefixCacheWriteFailedError)
    pool.views = real
    assert_nothing_held(mgr)
    # Nothing was registered: the snapshot is kept, so the save is retried.
    values = [float(s) for s in drv.view.slot_ids("a", 0, 4)]
    sid = mgr.save_outputs(drv.rows(HIDDEN_KEY, values), {"m": drv.rows("m", values)}, num_tokens_unpadded=4,
                           num_tokens_padded=4)  # fmt: skip
    got = mgr.materialize(sid, ["a"])
    assert torch.equal(got.hidden_states["a"], drv.rows(HIDDEN_KEY, values))
    sid, want = drv.run({"b": Req([1], 0, 4)})
    drv.check(sid, want)


@pytest.mark.parametrize("eager", MODES)
def test_5_a_failed_pool_read_on_the_prefetch_thread_names_the_hit(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    drv.check(sid, want)
    quiesce(mgr)
    real = mgr._pool.rows
    cause = RuntimeError("injected pool read failure")

    def failing(key: str, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if threading.current_thread().name.startswith(PREFETCH_THREAD_PREFIX):
            raise cause
        return real(key, slots, out=out)

    mgr._pool.rows = failing
    sid, _ = drv.run({"b": Req([0, 1], 4, 1, hit=4)}, finished=["a"])
    with pytest.raises(
        OmniPrefixCacheUnmatchError, match=r"prefix hit of request 'b': reading .* slots \[0, 1"
    ) as info:
        mgr.materialize(sid, ["b"])
    assert info.value.__cause__ is cause
    mgr._pool.rows = real
    sid, want = drv.run({"c": Req([2], 0, 4)}, finished=["b"])  # not sticky
    drv.check(sid, want)
    assert_nothing_held(mgr)


# ============================================================ 6. values accepted silently before


@pytest.mark.parametrize("eager", MODES)
def test_6_bool_float_and_str_arguments_are_refused_without_consuming_anything(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    assert sid == 1
    for bad_id in (True, 1.0, "1", None):
        with pytest.raises(OmniPrefixCacheInvalidTypeError, match="step id must be the int"):
            mgr.materialize(bad_id, ["a"])
        with pytest.raises(OmniPrefixCacheInvalidTypeError, match="step id must be the int"):
            mgr.discard_step(bad_id)
    for bad_ids in ("a", b"a", 5, ["a", 5]):
        with pytest.raises(OmniPrefixCacheInvalidTypeError):
            mgr.materialize(sid, bad_ids)
    drv.check(sid, want)  # the step was never consumed by the refused calls
    with pytest.raises(OmniPrefixCacheInvalidArgumentError, match=r"num_scheduled_tokens\['b'\] must be >= 0"):
        mgr.new_step_starts(sched([new_req("b")], (), {"b": -1}))
    with pytest.raises(OmniPrefixCacheInvalidTypeError, match="must be an int, got float"):
        mgr.new_step_starts(sched([new_req("b")], (), {"b": 4.0}))
    start_step(mgr, drv.view, {"b": Req([1], 0, 4)})
    for n, p in ((4.0, 4), (4, 4.0), (True, 4)):
        with pytest.raises(OmniPrefixCacheInvalidTypeError):
            mgr.save_outputs(torch.zeros(4, 8), {}, num_tokens_unpadded=n, num_tokens_padded=p)
    sid = mgr.save_outputs(torch.zeros(4, 8), {}, num_tokens_unpadded=4, num_tokens_padded=4)
    mgr.discard_step(sid)
    assert_nothing_held(mgr)


# ============================================================ 7. stats report an undrained failure


@pytest.mark.parametrize("eager", MODES)
def test_7_stats_report_a_failure_waiting_to_be_drained(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    drv.check(sid, want)
    quiesce(mgr)
    _fail_pool_writes(mgr, "m")
    try:
        sid, _ = drv.run({"b": Req([1], 0, 4)})
    except OmniPrefixCacheWriteFailedError:
        assert eager
    else:
        tids = [t.tid for t in list(mgr._controller.parts.registry.tasks.values()) if t.req_id == "b"]
        with pytest.raises(OmniPrefixCacheWriteFailedError):
            mgr._controller.join(tids)  # the committer failed it; no facade entry has drained it
        mgr.discard_step(sid)
    stats = mgr.stats()
    assert stats["sticky_failure"] and stats["failed_writes"] == 1
    with pytest.raises(OmniPrefixCacheWriteFailedError):
        mgr.new_step_starts(sched())


@pytest.mark.parametrize("eager", MODES)
def test_a_staging_timeout_is_its_own_type_and_the_save_can_be_retried(eager: bool, managers: list) -> None:
    mgr, drv = make(eager, staging_depth=1, staging_claim_timeout_s=0.5)
    managers.append(mgr)
    first, want_first = drv.run({"a": Req([0], 0, 4)})
    drv.view.order, drv.view.blocks["b"], drv.view.start["b"] = ["b"], [1], 0
    drv.live.add("b")
    mgr.new_step_starts(sched([new_req("b", 0, ([1],))], (), {"b": 4}))
    values = [float(s) for s in drv.view.slot_ids("b", 0, 4)]
    hidden, mm = drv.rows(HIDDEN_KEY, values), {"m": drv.rows("m", values)}
    with pytest.raises(OmniPrefixCacheStagingTimeoutError, match=f"unconsumed step contexts \\[{first}\\]"):
        mgr.save_outputs(hidden, mm, num_tokens_unpadded=4, num_tokens_padded=4)
    drv.check(first, want_first)  # what the error says to do
    quiesce(mgr)
    sid = mgr.save_outputs(hidden, mm, num_tokens_unpadded=4, num_tokens_padded=4)
    assert torch.equal(mgr.materialize(sid, ["b"]).hidden_states["b"], hidden)
    assert_nothing_held(mgr)
