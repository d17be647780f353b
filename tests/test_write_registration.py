"""A save's registration of its immediate write (WriteLedger.register_immediate_locked,
WriteTask.step_write, RequestTasks.open_many) and its tenancy (take_tenancy_locked) against
references: the dataclass constructor, one ``open`` per write, one write (one owner) for the
step's rows with every request's rows as state arrays on it."""

from __future__ import annotations

import dataclasses
import random
import threading
from collections import Counter
from typing import Any

import pytest
import torch

from omni_prefix_cache.compat.registration import per_request
from omni_prefix_cache.device import sync
from omni_prefix_cache.interface import ReqId, Tid, WriteSchedule
from omni_prefix_cache.steps.request_tasks import RequestTasks
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy, SlotState
from omni_prefix_cache.steps.step_layout import StepOutputs
from omni_prefix_cache.steps.write_ledger import WriteLedger
from omni_prefix_cache.writes.chunks import StepRequests, StepRows, WriteChunk
from omni_prefix_cache.writes.staging import StepD2HClaim
from omni_prefix_cache.writes.write_task import TaskEvent, WriteTask

# Fields the constructor fills from a factory: fresh objects of the same type, never shared.
FACTORY_FIELDS = {f.name for f in dataclasses.fields(WriteTask) if f.default_factory is not dataclasses.MISSING}


def test_step_write_builds_what_the_constructor_builds() -> None:
    chunk = WriteChunk.of_step(StepRows(slots=torch.arange(4), host={}, tensors={}), 1, 3)
    event = object()
    requests = StepRequests.of(["r", "s"], [1, 1])
    fast = WriteTask.step_write(7, requests, chunk, "freeze", 3, event)
    other = WriteTask.step_write(1, StepRequests.of(["q"], [2]), chunk, None, 0, None)
    slow = WriteTask(
        tid=7,
        req_id="r",
        write_n=1,
        schedule=WriteSchedule.JOIN_NEXT_STEP,
        chunks=[chunk],
        freeze_event="freeze",
        page=3,
        step_d2h_event=event,
        requests=requests,
    )
    # Every field, in field order (a field added to the dataclass must be added to step_write).
    assert list(vars(fast)) == list(vars(slow)) == [f.name for f in dataclasses.fields(WriteTask)]
    for name in vars(slow):
        got, want = getattr(fast, name), getattr(slow, name)
        if name in FACTORY_FIELDS:
            assert type(got) is type(want), name
            if name != "enqueued_time":
                assert got is not want and got is not getattr(other, name), name
        else:
            assert got == want, name
    fresh = [getattr(fast, name) for name in FACTORY_FIELDS if name != "enqueued_time"]
    assert len({id(v) for v in fresh}) == len(fresh)  # no two fields share one object
    assert fast.chunks is not slow.chunks and fast.chunks == [chunk]
    assert fast.enqueued_time <= slow.enqueued_time
    assert not fast.host_ready.is_set() and not fast.done.is_set() and fast.taken_over == {}
    assert fast.req_ids == ("r", "s") and fast.holds_request("s") and not fast.holds_request("q")


def test_step_write_takes_its_lock_from_the_sync_seam() -> None:
    class SeamRLock:
        pass

    chunk = WriteChunk.of_step(StepRows(slots=torch.arange(1), host={}, tensors={}), 0, 1)
    with sync.installed(RLock=SeamRLock):
        task = WriteTask.step_write(1, StepRequests.of(["r"], [1]), chunk, None, 0, None)
    assert isinstance(task.lock, SeamRLock)
    assert isinstance(task.host_ready, TaskEvent) and isinstance(task.done, TaskEvent)


@pytest.mark.parametrize("seed", range(30))
def test_open_many_counts_and_lists_each_requests_writes_in_order(seed: int) -> None:
    rng = random.Random(seed)
    reqs = RequestTasks()
    opened: dict[ReqId, int] = {}  # the reference: write_n so far and undrained tids per request
    undrained: dict[ReqId, list[Tid]] = {}
    tid = 0
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.3:  # some requests' writes drained and the requests dropped
            for rid in list(undrained):
                if rng.random() < 0.5:
                    del reqs.tasks[rid], undrained[rid], opened[rid]
                    reqs.drop_if_idle(rid)
        rids = [f"r{rng.randrange(5)}" for _ in range(rng.randint(0, 6))]  # repeats within a batch too
        tids = list(range(tid + 1, tid + 1 + len(rids)))
        tid += len(rids)
        if rng.random() < 0.3:
            got = [reqs.open(r, t) for r, t in zip(rids, tids, strict=True)]
        else:
            got = reqs.open_many(rids, tids)
        want = []
        for rid, t in zip(rids, tids, strict=True):
            opened[rid] = opened.get(rid, 0) + 1
            undrained.setdefault(rid, []).append(t)
            want.append(opened[rid])
        assert got == want, f"seed={seed}"
        assert reqs.opened == opened, f"seed={seed}"
        assert {r: list(t) for r, t in reqs.tasks.items()} == undrained, f"seed={seed}"


class _Controller:
    """What registration asks of the controller: the registered batch."""

    def __init__(self) -> None:
        self.registered: list[list[WriteTask]] = []

    def register_many(self, tasks: list[WriteTask], queued: bool = True) -> None:
        assert queued
        self.registered.append(list(tasks))


@pytest.mark.parametrize("seed", range(20))
def test_a_step_registers_one_write_for_all_its_requests_and_owns_its_rows(seed: int) -> None:
    rng = random.Random(seed)
    keys = ("h", "mm")
    occ = SlotOccupancy(64)
    for key in (*keys, "other"):
        occ.add_key(key)
    ctrl = _Controller()
    ledger = WriteLedger(ctrl, None, None, occ, threading.Lock(), set(), Counter())  # type: ignore[arg-type]
    for step in range(3):
        req_order: list[ReqId] = [f"r{i}" for i in rng.sample(range(6), rng.randint(1, 6))]
        spans: dict[ReqId, tuple[int, int]] = {}
        start = 0
        for rid in req_order:  # decode (1), prefill (3) and requests with no row this step (0)
            size = rng.choice([0, 1, 1, 3])
            spans[rid] = (start, size)
            start += size
        n = start
        slots = torch.tensor(rng.sample(range(64), n), dtype=torch.int64)
        immediate = {k: torch.randn(n, 2) for k in keys}
        split = StepOutputs(immediate=immediate, leftover={}, deferred_chunks=[])
        claimed = StepD2HClaim(step, {k: v.clone() for k, v in immediate.items()}, None)
        opened_before = dict(ledger.requests.opened)
        first_tid = max(ledger.records, default=0) + 1
        registered: list[WriteTask] = []
        tasks = ledger.register_immediate_locked(split, claimed, req_order, spans, slots, registered)
        assert registered == tasks == ctrl.registered[-1]
        (task,) = tasks
        assert task.tid == first_tid
        assert (task.page, task.schedule) == (step, WriteSchedule.JOIN_NEXT_STEP)
        assert torch.equal(task.chunks[0].slots_cpu, slots)
        assert ledger.records[task.tid].parts == [(keys, task.chunks[0])]
        # Per request: its rows as offsets on the one write, in step order; nothing per request.
        assert task.req_ids == tuple(req_order), f"seed={seed}"
        assert task.requests is not None
        for i, rid in enumerate(req_order):
            lo, size = spans[rid]
            assert task.requests.offsets[i : i + 2] == (lo, lo + size), f"seed={seed}"
        assert ledger.requests.opened == opened_before and not ledger.requests.tasks
        owner = torch.full((n,), task.tid, dtype=torch.int64)
        deferred: list[Tid] = []
        ledger.take_tenancy_locked(split, slots, [spans[r][1] for r in req_order], tasks, deferred)
        for key in keys:
            table = occ.get_slot_status(key)
            assert torch.equal(table.tids[slots], owner), f"seed={seed} step={step} key={key}"
            assert (table.state[slots] == int(SlotState.IN_TRANSIT)).all()
        other: Any = occ.get_slot_status("other")
        assert (other.state[slots] == int(SlotState.ABSENT)).all()


@pytest.mark.parametrize("seed", range(10))
def test_a_per_request_strategy_makes_each_requests_rows_its_own_step_write(seed: int) -> None:
    # A ledger whose registration strategy cuts per request (compat's, while a per-request
    # seam is wrapped): each request's immediate rows are a step write of their own (one
    # request in its arrays), in step order, each owning its rows.
    rng = random.Random(seed)
    occ = SlotOccupancy(64)
    for key in ("h", "other"):
        occ.add_key(key)
    ctrl = _Controller()
    ledger = WriteLedger(ctrl, None, None, occ, threading.Lock(), set(), Counter(), units=per_request)  # type: ignore[arg-type]
    for step in range(3):
        req_order: list[ReqId] = [f"r{i}" for i in rng.sample(range(6), rng.randint(1, 6))]
        sizes = [rng.choice([0, 1, 1, 3]) for _ in req_order]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        spans = {rid: (lo, size) for rid, lo, size in zip(req_order, starts, sizes, strict=True)}
        n = sum(sizes)
        slots = torch.tensor(rng.sample(range(64), n), dtype=torch.int64)
        split = StepOutputs(immediate={"h": torch.randn(n, 2)}, leftover={}, deferred_chunks=[])
        claimed = StepD2HClaim(step, {"h": split.immediate["h"].clone()}, None)
        first_tid = max(ledger.records, default=0) + 1
        registered: list[WriteTask] = []
        tasks = ledger.register_immediate_locked(split, claimed, req_order, spans, slots, registered)
        assert registered == tasks == ctrl.registered[-1]
        assert [t.tid for t in tasks] == list(range(first_tid, first_tid + len(req_order))), f"seed={seed}"
        assert [t.req_ids for t in tasks] == [(rid,) for rid in req_order], f"seed={seed}"
        owner = torch.empty(n, dtype=torch.int64)
        for task, lo, size in zip(tasks, starts, sizes, strict=True):
            assert type(task) is WriteTask and task.schedule is WriteSchedule.JOIN_NEXT_STEP
            assert task.requests is not None and task.requests.offsets == (0, size)
            assert torch.equal(task.chunks[0].slots_cpu, slots[lo : lo + size]), f"seed={seed}"
            owner[lo : lo + size] = task.tid
        ledger.take_tenancy_locked(split, slots, sizes, tasks, [])
        assert torch.equal(occ.get_slot_status("h").tids[slots], owner), f"seed={seed} step={step}"


def test_a_finished_request_escalates_the_step_write_holding_its_rows() -> None:
    # A step's rows are one write: finishing any of its requests escalates that write (the
    # previous step's, the only one the save barrier has not joined), once; a request it
    # does not hold escalates nothing.
    from tests.test_manager import BS, NUM_BLOCKS, BlockView, Driver, Req

    from omni_prefix_cache.interface import PrefixCacheConfig
    from omni_prefix_cache.manager import OmniPrefixCacheManager

    view = BlockView()
    mgr = OmniPrefixCacheManager(
        PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS), view, eager=False, committer="manual"
    )
    try:
        drv = Driver(mgr, view)
        sid, _ = drv.run({"a": Req([0], 0, 4), "b": Req([1], 0, 2)})
        ledger = mgr.components.ledger
        (tid,) = ledger.previous_step_writes
        with mgr.components.state_lock:
            assert ledger.finish_request_locked("b") == [tid]
            assert ledger.finish_request_locked("a") == [tid]
            assert ledger.finish_request_locked("z") == []
        escalated: list[list[Tid]] = []
        ctrl = mgr.components.controller
        real = ctrl.escalate
        ctrl.escalate = lambda tids: (escalated.append(list(tids)), real(tids))[1]  # type: ignore[method-assign]
        mgr.new_step_starts(_finish(["a", "b"]))
        assert escalated == [[tid, tid]]  # the controller escalates each task once
        assert ctrl.parts.registry.tasks[tid].state.name != "PENDING"
        mgr.discard_step(sid)
    finally:
        mgr.shutdown()


def _finish(rids: list[ReqId]) -> Any:
    class Out:
        finished_req_ids = set(rids)
        scheduled_new_reqs: list[Any] = []
        num_scheduled_tokens: dict[ReqId, int] = {}

    return Out()
