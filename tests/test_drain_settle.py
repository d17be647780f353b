"""The drain's settle pass (WriteLedger.settle_locked, ChunkRuns, SlotOccupancy.settle_keys)
against a per-chunk reference: the slots of every drained chunk concatenated, one writer per
row, one ``settle`` per key. Randomised over step windows (back-to-back or not), standalone
chunks, several key groups, failed and completed writes, unknown and repeated tids."""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import Any, cast

import pytest
import torch

from omni_prefix_cache.device.index_tensors import per_row
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, ReqId, TensorName, Tid, WriteSchedule
from omni_prefix_cache.steps.request_tasks import RequestTasks, TaskRecord
from omni_prefix_cache.steps.slot_occupancy import SlotOccupancy
from omni_prefix_cache.steps.write_ledger import WriteLedger
from omni_prefix_cache.writes.chunks import ChunkRuns, StepRows, WriteChunk
from omni_prefix_cache.writes.write_task import WriteTask

NUM_SLOTS = 64
KEY_GROUPS: list[tuple[TensorName, ...]] = [("h", "mm"), ("mm2",), ("h",)]
SEEDS = range(150)


def _random_chunks(rng: random.Random) -> list[WriteChunk]:
    """Chunks in drain order: runs of windows of a few steps (mostly back to back, sometimes
    with a gap or out of order), standalone chunks between them, some empty."""
    steps = [
        StepRows(slots=torch.tensor([rng.randrange(NUM_SLOTS) for _ in range(24)]), host={}, tensors={})
        for _ in range(rng.randint(1, 3))
    ]
    cursor = {id(s): 0 for s in steps}
    chunks: list[WriteChunk] = []
    for _ in range(rng.randint(1, 14)):
        if rng.random() < 0.3:
            rows = [rng.randrange(NUM_SLOTS) for _ in range(rng.randint(0, 4))]
            chunk = WriteChunk(slots_cpu=torch.tensor(rows, dtype=torch.int64))
        else:
            step = rng.choice(steps)
            start = cursor[id(step)] if rng.random() < 0.8 else rng.randrange(20)
            end = min(24, start + rng.randint(0, 4))
            cursor[id(step)] = end
            chunk = WriteChunk.of_step(step, start, end)
            if rng.random() < 0.2:
                _ = chunk.slots_cpu  # its window already cut: same rows
        chunks.append(chunk)
    return chunks


@pytest.mark.parametrize("seed", SEEDS)
def test_chunk_runs_gives_every_chunks_slots_and_writers_in_order(seed: int) -> None:
    rng = random.Random(seed)
    chunks = _random_chunks(rng)
    owners = [rng.randint(1, 9) for _ in chunks]
    runs = ChunkRuns()
    for chunk, owner in zip(chunks, owners, strict=True):
        runs.add(chunk, owner)
    want = torch.cat([c.slots_cpu for c in chunks])
    assert torch.equal(runs.slots(), want), f"seed={seed}"
    assert runs.counts == [c.rows for c in chunks], f"seed={seed}"
    assert torch.equal(per_row(runs.owners, runs.counts), per_row(owners, [c.rows for c in chunks])), f"seed={seed}"


def test_chunk_runs_takes_back_to_back_windows_as_one_slice() -> None:
    step = StepRows(slots=torch.arange(10, 30), host={}, tensors={})
    runs = ChunkRuns()
    for tid, start in enumerate(range(2, 12, 2), start=1):
        runs.add(WriteChunk.of_step(step, start, start + 2), tid)
    slots = runs.slots()
    assert slots.tolist() == list(range(12, 22))
    assert slots.untyped_storage().data_ptr() == step.slots.untyped_storage().data_ptr()  # a view, not a copy
    assert runs.owners == [1, 2, 3, 4, 5] and runs.counts == [2] * 5


# ------------------------------------------------------------ settle_locked against the reference


def _reference_settle(ledger: WriteLedger, tids: list[Tid], trigger: str) -> list[TaskRecord]:
    """The drain before it was one pass: per record forget, then per key group the chunks'
    slots concatenated and one ``settle`` per key."""
    groups: dict[tuple[TensorName, ...], tuple[list[WriteChunk], list[Tid]]] = {}
    settled: list[TaskRecord] = []
    requests = ledger.requests
    for tid in tids:
        rec = ledger.records.pop(tid, None)
        if rec is None:
            continue
        settled.append(rec)
        own = requests.tasks.get(rec.req_id)
        if own is not None:
            own.pop(rec.task.tid, None)
            if not own:
                del requests.tasks[rec.req_id]
        if requests.deferred.get(rec.req_id) is rec.task:
            del requests.deferred[rec.req_id]
        if rec.req_id not in ledger._live:
            requests.drop_if_idle(rec.req_id)
        for keys, chunk in rec.parts:
            chunks, owners = groups.setdefault(keys, ([], []))
            chunks.append(chunk)
            owners.append(tid)
    for keys, (chunks, owners) in groups.items():
        counts = [c.rows for c in chunks]
        if trigger == "commit":
            ledger._counters["rows_committed"] += sum(counts) * len(keys)
        slots, writers = torch.cat([c.slots_cpu for c in chunks]), per_row(owners, counts)
        for key in keys:
            ledger._occupancy.settle(trigger, key, slots, writers)
    return settled


def _ledger(seed: int) -> tuple[WriteLedger, list[Tid], list[Tid]]:
    """A ledger with random undrained writes over a random occupancy, and the failed and
    completed tids a drain takes (both may hold unknown or repeated tids)."""
    rng = random.Random(seed)
    occ = SlotOccupancy(NUM_SLOTS)
    for key in ("h", "mm", "mm2"):
        occ.add_key(key)
    live: set[ReqId] = set()
    ledger = WriteLedger(cast(Any, None), cast(Any, None), cast(Any, None), occ, threading.Lock(), live, Counter())
    reqs = [f"r{i}" for i in range(rng.randint(1, 5))]
    live.update(r for r in reqs if rng.random() < 0.5)
    tids: list[Tid] = []
    for tid in range(1, rng.randint(2, 12)):
        rid = rng.choice(reqs)
        chunks = _random_chunks(rng)[: rng.randint(1, 3)]
        parts = [(rng.choice(KEY_GROUPS), c) for c in chunks]
        schedule = WriteSchedule.JOIN_ON_FINISH if rng.random() < 0.3 else WriteSchedule.JOIN_NEXT_STEP
        task = WriteTask(tid=tid, req_id=rid, write_n=ledger.requests.open(rid, tid), schedule=schedule, chunks=chunks)
        ledger.records[tid] = TaskRecord(task, rid, parts)
        if schedule is WriteSchedule.JOIN_ON_FINISH:
            ledger.requests.deferred[rid] = task
        for keys, chunk in parts:  # the write maps its rows (a later write may take some over)
            for key in keys:
                occ.map(key, chunk.slots_cpu, tid)
        tids.append(tid)
    for key in ("h", "mm", "mm2"):  # some rows already committed or reset under the writes
        picked = torch.tensor(sorted(rng.sample(range(NUM_SLOTS), 8)))
        occ.apply(rng.choice(["commit", "reset"]), key, picked, -1, where_enabled=True)
    drained = tids + [99, rng.choice(tids)]
    rng.shuffle(drained)
    cut = rng.randint(0, len(drained))
    return ledger, drained[:cut], drained[cut:]


def _snapshot(ledger: WriteLedger) -> dict[str, Any]:
    occ = ledger._occupancy
    tables = {
        key: (t.state.clone(), t.tids.clone(), t.slot_version.clone())
        for key in occ.keys()
        for t in [occ.get_slot_status(key)]
    }
    requests: RequestTasks = ledger.requests
    return {
        "tables": tables,
        "records": sorted(ledger.records),
        "tasks": {r: list(t) for r, t in requests.tasks.items()},
        "deferred": {r: t.tid for r, t in requests.deferred.items()},
        "opened": dict(requests.opened),
        "counters": dict(ledger._counters),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys() or a["tables"].keys() != b["tables"].keys():
        return False
    for key, tables in a["tables"].items():
        if not all(torch.equal(x, y) for x, y in zip(tables, b["tables"][key], strict=True)):
            return False
    return all(a[k] == b[k] for k in a if k != "tables")


@pytest.mark.parametrize("seed", SEEDS)
def test_settle_locked_settles_what_the_per_chunk_reference_settles(seed: int) -> None:
    ledger, failed, completed = _ledger(seed)
    reference, _, _ = _ledger(seed)
    for trigger, tids in (("drop", failed), ("commit", completed)):  # the drain's order
        got = [rec.task.tid for rec in ledger.settle_locked(tids, trigger)]
        want = [rec.task.tid for rec in _reference_settle(reference, tids, trigger)]
        assert got == want, f"seed={seed} {trigger}"
        assert _same(_snapshot(ledger), _snapshot(reference)), f"seed={seed}: {trigger} of {tids} settled differently"


# ------------------------------------------------------------ settle_keys errors are settle's


def test_settle_keys_moves_each_key_in_order_and_raises_as_settle_would() -> None:
    occ = SlotOccupancy(8)
    occ.add_key("a")
    occ.map("a", torch.tensor([1, 2]), 5)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"unknown key 'b'"):
        occ.settle_keys("commit", ("a", "b"), torch.tensor([1, 2]), torch.tensor([5, 5]))
    assert occ.get_slot_status("a").tids[1:3].tolist() == [-1, -1]  # "a" moved first, as settle per key
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"unknown key 'b'"):
        occ.settle_keys("commit", ("b", "a"), torch.tensor([1]), torch.tensor([5, 5]))  # key checked first
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"3 owners for 2 slots"):
        occ.settle_keys("drop", ("a",), torch.tensor([1, 2]), torch.tensor([5, 5, 5]))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"slots \[9\] outside \[0, 8\)"):
        occ.settle_keys("drop", ("a", "b"), torch.tensor([9]), 5)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"not 'map'"):
        occ.settle_keys("map", ("a",), torch.tensor([1]), 5)
