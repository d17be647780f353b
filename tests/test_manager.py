"""The manager facade end to end, in eager mode and with the threaded CPU
committer (eager=False), plus every bad input the facade must refuse without
leaving a staging holder or budget behind.

The driver below keeps its own truth of what each KV slot holds: every step
writes values unique to (step, slot), so a hit served from a stale tenant,
a wrong step or an unwritten slot shows up as a wrong row.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_prefix_cache.controller import StagingBufferHolder
from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
)
from omni_prefix_cache.manager import PREFETCH_THREAD_PREFIX, OmniPrefixCacheManager

BS = 4
NUM_BLOCKS = 32
WIDTHS = {HIDDEN_KEY: 8, "m": 3, "d": 2}  # hidden, an immediate mm key, a deferred mm key
MODES = [pytest.param(True, id="eager"), pytest.param(False, id="threaded")]


class BlockView:
    """The group view the manager reads: per request its block ids and how
    many tokens it had computed before this step; rows follow ``order``."""

    block_size = BS

    def __init__(self) -> None:
        self.order: list[str] = []
        self.blocks: dict[str, list[int]] = {}
        self.start: dict[str, int] = {}

    def batch_req_ids(self) -> list[str]:
        return list(self.order)

    def token_range(self, req: str, count: int) -> tuple[int, int]:
        return self.start[req], self.start[req] + count

    def slot_ids(self, req: str, lo: int, hi: int) -> list[int]:
        return [self.blocks[req][p // BS] * BS + p % BS for p in range(lo, hi)]

    def step_slots_cpu(self, req_ids: Iterable[str], num_scheduled: dict[str, int]) -> torch.Tensor:
        out: list[int] = []
        for req in req_ids:
            k = int(num_scheduled.get(req, 0))
            if k > 0:
                out.extend(self.slot_ids(req, self.start[req], self.start[req] + k))
        return torch.tensor(out, dtype=torch.int64)


@dataclass
class Req:
    blocks: list[int]
    start: int  # tokens computed before this step
    count: int  # tokens scheduled this step
    hit: int = 0  # num_computed_tokens reported as a prefix hit (new requests only)


@dataclass
class Driver:
    """Drives one manager like an engine and predicts every output row."""

    mgr: OmniPrefixCacheManager
    view: BlockView
    keys: tuple[str, ...] = (HIDDEN_KEY, "m")
    step: int = 0
    truth: dict[str, dict[int, float]] = field(default_factory=lambda: {k: {} for k in WIDTHS})
    live: set[str] = field(default_factory=set)

    def value(self, slot: int) -> float:
        return float(self.step * 1000 + slot)

    def rows(self, key: str, values: list[float]) -> torch.Tensor:
        scale = {HIDDEN_KEY: 1.0, "m": 2.0, "d": 3.0}[key]
        return (torch.tensor(values, dtype=torch.float32) * scale).unsqueeze(1).repeat(1, WIDTHS[key])

    def run(
        self,
        reqs: dict[str, Req],
        *,
        finished: Iterable[str] = (),
        new: Iterable[str] | None = None,
        padded: int | None = None,
    ) -> tuple[int, dict[str, dict[str, torch.Tensor]]]:
        """One step; returns the step id and the rows materialize must give."""
        self.step += 1
        view = self.view
        view.order = list(reqs)
        for rid, r in reqs.items():
            view.blocks[rid] = r.blocks
            view.start[rid] = r.start
        new_ids = list(reqs) if new is None else list(new)
        self.live -= set(finished)
        # Only a request the manager does not know yet is a hit.
        hits = {rid for rid in new_ids if reqs[rid].hit > 0 and rid not in self.live}
        self.live |= set(new_ids)
        sched = SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(req_id=rid, num_computed_tokens=reqs[rid].hit, block_ids=(list(reqs[rid].blocks),))
                for rid in new_ids
            ],
            finished_req_ids=set(finished),
            num_scheduled_tokens={rid: r.count for rid, r in reqs.items()},
        )
        self.mgr.new_step_starts(sched)
        values: list[float] = []
        for rid, r in reqs.items():
            values.extend(self.value(s) for s in view.slot_ids(rid, r.start, r.start + r.count))
        n = len(values)
        pad = n if padded is None else padded
        outs = {key: self.rows(key, values) for key in self.keys}
        hidden = outs.pop(HIDDEN_KEY, torch.zeros(n, WIDTHS[HIDDEN_KEY]))
        if pad > n:
            hidden = torch.cat([hidden, torch.full((pad - n, hidden.shape[1]), -1.0)])
        # This step's rows are the slots' new content, also for a hit on a
        # block this very step (re)computes.
        for rid, r in reqs.items():
            for s in view.slot_ids(rid, r.start, r.start + r.count):
                for key in self.keys:
                    self.truth[key][s] = self.value(s)
        expected: dict[str, dict[str, torch.Tensor]] = {}
        for rid, r in reqs.items():
            lo = 0 if rid in hits else r.start
            slots = view.slot_ids(rid, lo, r.start + r.count)
            expected[rid] = {key: self.rows(key, [self.truth[key].get(s, 0.0) for s in slots]) for key in self.keys}
        sid = self.mgr.save_outputs(hidden, outs, num_tokens_unpadded=n, num_tokens_padded=pad)
        return sid, expected

    def check(self, sid: int, expected: dict[str, dict[str, torch.Tensor]]) -> None:
        got = self.mgr.materialize(sid, list(expected))
        for rid, per_key in expected.items():
            for key, want in per_key.items():
                have = got.hidden_states[rid] if key == HIDDEN_KEY else got.mm_outputs[key][rid]
                assert torch.equal(have, want), (rid, key, have[:, 0].tolist(), want[:, 0].tolist())


def make(eager: bool, policy: ModelCachePolicy | None = None, **cfg: Any) -> tuple[OmniPrefixCacheManager, Driver]:
    config = PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, **cfg)
    view = BlockView()
    mgr = OmniPrefixCacheManager(config, view, eager=eager)
    keys: tuple[str, ...] = (HIDDEN_KEY, "m")
    if policy is not None:
        mgr.register_policy(policy)
        keys = ((HIDDEN_KEY,) if policy.needs_full_hidden_states else ()) + ("m",) + tuple(sorted(policy.deferred_keys))
    return mgr, Driver(mgr, view, keys=keys)


def quiesce(mgr: OmniPrefixCacheManager) -> None:
    """Wait for every queued write (not pending deferred ones) to finish."""
    ctrl = mgr._controller
    busy = [
        t.tid for t in list(ctrl.parts.registry.tasks.values()) if t.state.name not in ("PENDING", "WRITTEN", "FAILED")
    ]
    ctrl.join(busy)


def assert_nothing_held(mgr: OmniPrefixCacheManager, *, staged_bytes: int = 0) -> None:
    quiesce(mgr)
    assert not mgr._step_ctxs
    assert not mgr._controller.parts.staging_pool.holders(), mgr._controller.parts.staging_pool.holders()
    assert mgr._controller.parts.budget.staged_bytes == staged_bytes


# ============================================================ end to end, both committers


@pytest.mark.parametrize("eager", MODES)
def test_threaded_mode_runs_a_real_committer(eager: bool, managers: list) -> None:
    mgr, _ = make(eager)
    managers.append(mgr)
    assert (mgr._controller._worker is None) is eager


@pytest.mark.parametrize("eager", MODES)
def test_rows_pass_through_and_hits_merge_from_the_pool(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0, 1, 2], 0, 10)})
    drv.check(sid, want)
    sid, want = drv.run({"a": Req([0, 1, 2], 10, 1)}, new=[])
    drv.check(sid, want)
    # b shares a's first two blocks (8 cached tokens) and diverges on the third.
    sid, want = drv.run({"b": Req([0, 1, 5], 8, 3, hit=8)}, finished=["a"])
    assert want["b"][HIDDEN_KEY].shape[0] == 11
    drv.check(sid, want)
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_same_step_hit_on_fresh_blocks(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0, 1], 0, 8), "b": Req([0, 1, 2], 8, 2, hit=8)})
    drv.check(sid, want)
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_same_step_hit_on_a_reused_block_reads_the_new_rows(eager: bool, managers: list) -> None:
    """Block 0 held a's rows; this step c recomputes it (vLLM dropped the old
    hash when it reallocated the block) and d hits c's block in the same
    step. The hit planned at new_step_starts saw COMMITTED old rows; it must
    be re-planned against c's write, never served a's rows."""
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    drv.check(sid, want)
    sid, want = drv.run({"c": Req([0, 3], 0, 6), "d": Req([0, 4], 4, 2, hit=4)}, finished=["a"])
    assert want["d"][HIDDEN_KEY][0, 0] == float(drv.step * 1000)  # c's new value, not a's
    drv.check(sid, want)
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_delayed_materialize_after_reuse_serves_preserved_rows(eager: bool, managers: list) -> None:
    """b hits a's block; its prefetch is held back until another request has
    reused and rewritten that block. Copy on write must hand b the old rows."""
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([2], 0, 4)})
    drv.check(sid, want)
    gate = threading.Event()
    real_rows = mgr._pool.rows

    def gated_rows(key: str, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if threading.current_thread().name.startswith(PREFETCH_THREAD_PREFIX):
            assert gate.wait(10)
        return real_rows(key, slots, out=out)

    mgr._pool.rows = gated_rows
    s_hit, want_hit = drv.run({"b": Req([2, 6], 4, 1, hit=4)}, finished=["a"])
    sid, want = drv.run({"b": Req([2, 6], 5, 1)}, new=[])
    drv.check(sid, want)
    sid, want = drv.run({"c": Req([2], 0, 4)}, finished=["b"])  # block 2 reused
    drv.check(sid, want)
    sid, want = drv.run({"z": Req([9], 0, 1)})  # the reuse has landed in the pool
    drv.check(sid, want)
    assert any(ref.preserved for ref in mgr._reads.pending)
    gate.set()
    drv.check(s_hit, want_hit)
    assert not mgr._reads.pending
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_deferred_key_accumulates_flushes_on_finish_and_serves_hits(eager: bool, managers: list) -> None:
    policy = ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"d"}))
    mgr, drv = make(eager, policy)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([1, 2], 0, 6)})
    drv.check(sid, want)
    sid, want = drv.run({"a": Req([1, 2], 6, 1)}, new=[])
    drv.check(sid, want)
    task = mgr._ledger.requests.deferred["a"]
    assert len(task.chunks) == 2 and task.state.name == "PENDING"
    # A hit on a's still-pending deferred rows reads the task's own copy.
    sid, want = drv.run({"a": Req([1, 2], 7, 1), "h": Req([1, 7], 4, 1, hit=4)}, new=["h"])
    drv.check(sid, want)
    sid, want = drv.run({"h": Req([1, 7], 5, 1)}, finished=["a"], new=[])
    drv.check(sid, want)
    quiesce(mgr)
    ctrl = mgr._controller
    ctrl.join([task.tid])
    slots = torch.tensor(drv.view.slot_ids("a", 0, 8))
    assert torch.equal(mgr._pool.rows("d", slots)[:, 0], torch.tensor([drv.truth["d"][s] for s in slots.tolist()]) * 3)


@pytest.mark.parametrize("eager", MODES)
def test_budget_pressure_closes_the_deferred_write_and_opens_another(eager: bool, managers: list) -> None:
    policy = ModelCachePolicy(needs_full_hidden_states=False, deferred_keys=frozenset({"d"}))
    mgr, drv = make(eager, policy, gpu_staging_bytes=3 * 2 * 4)  # three one-row chunks of width 2
    managers.append(mgr)
    first = None
    for pos in range(5):
        sid, want = drv.run({"a": Req([3, 4], pos, 1)}, new=["a"] if pos == 0 else [])
        drv.check(sid, want)
        first = first or mgr._ledger.requests.deferred["a"]
    # The fourth chunk flushed the first write (three chunks); a new one holds the rest.
    now = mgr._ledger.requests.deferred["a"]
    assert now is not first and now.write_n > first.write_n and len(now.chunks) == 2
    assert first.state.name == "WRITTEN" and len(first.chunks) == 3
    assert mgr._controller.parts.budget.staged_bytes == 2 * 2 * 4
    sid, want = drv.run({"z": Req([9], 0, 1)}, finished=["a"])
    drv.check(sid, want)
    assert_nothing_held(mgr, staged_bytes=2 * 4)  # only z's pending one-row chunk is still charged


@pytest.mark.parametrize("eager", MODES)
def test_padded_step_and_multi_dim_token_rows_round_trip(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    view = drv.view
    view.order, view.blocks, view.start = ["a"], {"a": [0, 1]}, {"a": 0}
    sched = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=0, block_ids=([0, 1],))],
        finished_req_ids=set(),
        num_scheduled_tokens={"a": 6},
    )
    mgr.new_step_starts(sched)
    cube = torch.arange(6 * 2 * 3, dtype=torch.float32).reshape(6, 2, 3)
    ref = [torch.arange(5.0)]
    sid = mgr.save_outputs(
        torch.ones(8, 8),
        {"cube": cube, "ref": ref, "flag": torch.tensor(1.0)},
        num_tokens_unpadded=6,
        num_tokens_padded=8,
    )
    out = mgr.materialize(sid, ["a"])
    assert torch.equal(out.mm_outputs["cube"]["a"], cube)
    assert torch.equal(out.mm_outputs["ref"]["a"][0], ref[0]) and torch.equal(
        out.mm_outputs["flag"]["a"], torch.tensor(1.0)
    )
    assert out.hidden_states["a"].shape == (6, 8)
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_lagged_materialize_on_another_thread(eager: bool, managers: list, finish_d: bool = True) -> None:
    """Materialize runs one step behind on a second thread while the engine
    saves the next step (the production shape). The second round reuses
    blocks 0-1; ``finish_d`` ends request d (which holds them) first, as
    vLLM would before reallocating them."""
    mgr, drv = make(eager, staging_depth=3)
    managers.append(mgr)
    jobs: list[tuple[int, dict]] = []
    errors: list[BaseException] = []
    ready = threading.Semaphore(0)

    def consume() -> None:
        for _ in range(12):
            ready.acquire()
            try:
                drv.check(*jobs.pop(0))
            except BaseException as exc:  # reported on the test thread
                errors.append(exc)

    worker = threading.Thread(target=consume)
    worker.start()
    steps = [
        ({"a": Req([0, 1, 2], 0, 8)}, (), None),
        ({"a": Req([0, 1, 2], 8, 1), "b": Req([0, 1, 4], 8, 2, hit=8)}, (), ["b"]),
        ({"a": Req([0, 1, 2], 9, 1), "b": Req([0, 1, 4], 10, 1)}, (), []),
        ({"b": Req([0, 1, 4], 11, 1)}, ("a",), []),
        ({"c": Req([2, 5], 0, 5)}, (), ["c"]),  # reuses a's third block
        ({"d": Req([0, 1, 6], 8, 1, hit=8)}, ("b",), ["d"]),
    ]
    for i, (reqs, finished, new) in enumerate(steps * 2):
        if i == len(steps) and finish_d:
            finished = (*finished, "d")
        reqs = {k: Req(list(v.blocks), v.start, v.count, v.hit) for k, v in reqs.items()}
        jobs.append(drv.run(reqs, finished=finished, new=new))
        ready.release()
    worker.join(30)
    assert not errors, errors[0]
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_lagged_materialize_when_live_blocks_are_overwritten(eager: bool, managers: list) -> None:
    """As above, but d still holds blocks 0-1 when they are reused: its
    pending hit read must be served from its copy-on-write rows."""
    test_lagged_materialize_on_another_thread(eager, managers, finish_d=False)


@pytest.mark.parametrize("eager", MODES)
def test_lock_never_covers_a_wait_a_copy_or_a_dispatch(eager: bool, managers: list) -> None:
    policy = ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"d"}))
    mgr, drv = make(eager, policy, gpu_staging_bytes=64)
    managers.append(mgr)
    ctrl = mgr._controller
    seen: list[tuple[str, bool]] = []
    engine = threading.current_thread()

    def probe(name: str, fn: Any) -> Any:
        def wrapped(*a: Any, **kw: Any) -> Any:
            if threading.current_thread() is engine:
                seen.append((name, mgr._state_lock.locked()))
            else:  # other threads never hold the state lock around these either
                seen.append((name, False))
            return fn(*a, **kw)

        return wrapped

    for name in ("join", "join_host_ready", "escalate", "dispatch", "reserve"):
        setattr(ctrl, name, probe(name, getattr(ctrl, name)))
    # The parts the manager's components hold directly: probed on those objects.
    for part, method, name in (
        (ctrl.parts.host_rows, "fetch", "fetch_host"),
        (ctrl.parts.staging_pool, "stage_step", "stage_step_host"),
    ):
        setattr(part, method, probe(name, getattr(part, method)))
    from test_contract import background_drain_paused  # here: test_contract imports this module

    # ``locked()`` cannot say who holds the state lock: the committer thread's
    # drain after a pass (its after_write) may hold it while the engine's next
    # save runs, so that drain waits for the next facade entry here.
    with background_drain_paused(mgr):
        sid, want = drv.run({"a": Req([0], 0, 4)})
        drv.check(sid, want)
        sid, want = drv.run({"b": Req([0, 1], 4, 2, hit=4)})
        drv.check(sid, want)
        sid, want = drv.run({"z": Req([9], 0, 1)}, finished=["a", "b"])
        drv.check(sid, want)
    names = {name for name, _ in seen}
    assert {"join", "fetch_host", "escalate", "dispatch", "reserve", "stage_step_host"} <= names
    assert not [call for call in seen if call[1]], seen


@pytest.mark.parametrize("eager", MODES)
def test_failed_pool_write_is_sticky(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    drv.check(sid, want)
    quiesce(mgr)  # a's write has landed before the pool starts failing
    real_write = mgr._pool.write

    def failing_write(key: str, slots: torch.Tensor, host: torch.Tensor) -> None:
        if key == "m":
            raise RuntimeError("injected pool write failure")
        real_write(key, slots, host)

    mgr._pool.write = failing_write
    try:
        sid, _ = drv.run({"b": Req([1], 0, 4)})
    except RuntimeError as exc:  # eager: the dispatch itself raises, and releases the step
        assert "injected" in str(exc) and eager
    else:
        mgr.discard_step(sid)
        # Threaded: b's write runs on the committer; wait for it to fail
        # before the pool is repaired, or it may simply succeed later.
        b_writes = [t.tid for t in list(mgr._controller.parts.registry.tasks.values()) if t.req_id == "b"]
        with pytest.raises(OmniPrefixCacheUnmatchError, match="write failed before done"):
            mgr._controller.join(b_writes)
    mgr._pool.write = real_write
    for _ in range(2):
        with pytest.raises(OmniPrefixCacheUnmatchError, match="write failed"):
            drv.run({"c": Req([2], 0, 4)})
    assert_nothing_held(mgr)


# ============================================================ bad input: raise, leave nothing behind


def start_step(mgr: OmniPrefixCacheManager, view: BlockView, reqs: dict[str, Req], *, new: bool = True) -> None:
    view.order = list(reqs)
    for rid, r in reqs.items():
        view.blocks[rid] = r.blocks
        view.start[rid] = r.start
    mgr.new_step_starts(
        SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(req_id=rid, num_computed_tokens=r.hit, block_ids=(list(r.blocks),))
                for rid, r in reqs.items()
                if new
            ],
            finished_req_ids=set(),
            num_scheduled_tokens={rid: r.count for rid, r in reqs.items()},
        )
    )


@pytest.mark.parametrize("eager", MODES)
def test_misaligned_hit_raises_and_registers_nothing(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0, 1], 0, 8)})
    drv.check(sid, want)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"prefix hit not block aligned: request 'b'.*=6"):
        start_step(mgr, drv.view, {"b": Req([0, 1, 2], 6, 2, hit=6), "x": Req([5], 0, 1)})
    assert "x" not in mgr._live and not mgr._hits.pending and mgr._pending_sched is None
    assert_nothing_held(mgr)
    sid, want = drv.run({"b": Req([0, 1, 2], 8, 2, hit=8)}, finished=["a"])
    drv.check(sid, want)


@pytest.mark.parametrize(
    "block_ids, says",
    [(None, "carries no block_ids"), (([],), "carries no block_ids"), (([0],), "comes with only 1 group-0 block ids")],
)
@pytest.mark.parametrize("eager", MODES)
def test_hit_without_enough_group0_block_ids_raises(eager: bool, block_ids: Any, says: str, managers: list) -> None:
    mgr, _ = make(eager)
    managers.append(mgr)
    sched = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="b", num_computed_tokens=8, block_ids=block_ids)],
        finished_req_ids=set(),
        num_scheduled_tokens={"b": 1},
    )
    # "carries no block_ids" is upstream's phrase for a hit with none.
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"prefix hit of request 'b' \(8 tokens, 2 blocks\) " + says):
        mgr.new_step_starts(sched)
    assert not mgr._hits.pending
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_slot_mapping_not_covering_the_step_raises(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    start_step(mgr, drv.view, {"a": Req([0], 0, 2)})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"step 1\).*covers 2 scheduled tokens.*has 4 tokens"):
        mgr.save_outputs(torch.zeros(4, 8), {}, num_tokens_unpadded=4, num_tokens_padded=4)
    assert_nothing_held(mgr)
    # a view whose slot mapping is shorter than the scheduled tokens
    start_step(mgr, drv.view, {"a": Req([0], 0, 2)})
    drv.view.step_slots_cpu = lambda req_ids, num_sched: torch.tensor([0], dtype=torch.int64)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"slot mapping \(1,\) does not cover the step's 2 tokens"):
        mgr.save_outputs(torch.zeros(2, 8), {}, num_tokens_unpadded=2, num_tokens_padded=2)
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_oversized_step_raises(eager: bool, managers: list) -> None:
    mgr, drv = make(eager, staging_capacity_tokens=4)
    managers.append(mgr)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="has 8 tokens; staging capacity is 4"):
        drv.run({"a": Req([0, 1], 0, 8)})
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_unknown_and_twice_consumed_step_ids_raise(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"materialize\(step {sid + 7}\): illegal from UNSAVED"):
        mgr.materialize(sid + 7, ["a"])
    drv.check(sid, want)
    for consume in (lambda: mgr.materialize(sid, ["a"]), lambda: mgr.discard_step(sid)):
        with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"step {sid}\): illegal from CONSUMED"):
            consume()
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_request_ids_outside_the_save_snapshot_raise_and_release(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, _ = drv.run({"a": Req([0], 0, 4)})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"request ids \['late'\] are outside the save snapshot"):
        mgr.materialize(sid, ["a", "late"])
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_too_few_hidden_rows_raise(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    start_step(mgr, drv.view, {"a": Req([0], 0, 4)})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"hidden states \(3, 8\) have fewer than the step's 4"):
        mgr.save_outputs(torch.zeros(3, 8), {}, num_tokens_unpadded=4, num_tokens_padded=4)
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_save_without_new_step_starts_raises(eager: bool, managers: list) -> None:
    mgr, _ = make(eager)
    managers.append(mgr)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="without a new_step_starts"):
        mgr.save_outputs(torch.zeros(1, 8), {}, num_tokens_unpadded=1, num_tokens_padded=1)
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_key_changing_layout_or_reserved_name_raises(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0], 0, 4)})
    drv.check(sid, want)
    start_step(mgr, drv.view, {"a": Req([0, 1], 4, 1)}, new=False)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"key 'm': step rows are torch.float32 \(5,\)"):
        mgr.save_outputs(torch.zeros(1, 8), {"m": torch.zeros(1, 5)}, num_tokens_unpadded=1, num_tokens_padded=1)
    start_step(mgr, drv.view, {"a": Req([0, 1], 4, 1)}, new=False)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="reserved hidden key name"):
        mgr.save_outputs(torch.zeros(1, 8), {HIDDEN_KEY: torch.zeros(1, 8)}, num_tokens_unpadded=1, num_tokens_padded=1)
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_save_failing_after_reserve_hands_the_budget_back(eager: bool, managers: list) -> None:
    policy = ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"d"}))
    mgr, drv = make(eager, policy)
    managers.append(mgr)
    real = mgr._ledger.commit_drained_locked
    calls = {"n": 0}

    def fail_in_save() -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the first call is new_step_starts'; the second, save's
            raise OmniPrefixCacheUnmatchError("injected")
        real()

    mgr._ledger.commit_drained_locked = fail_in_save
    with pytest.raises(OmniPrefixCacheUnmatchError, match="injected"):
        drv.run({"a": Req([0], 0, 4)})
    mgr._ledger.commit_drained_locked = real
    assert_nothing_held(mgr)
    assert not mgr._ledger.records and not mgr._ledger.requests.tasks
    sid, want = drv.run({"a": Req([0], 0, 4)})
    drv.check(sid, want)


@pytest.mark.parametrize("eager", MODES)
def test_unservable_hit_raises_at_materialize_and_releases(eager: bool, managers: list) -> None:
    """Hidden rows that were never written are never served as zeros."""
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, _ = drv.run({"c": Req([5, 6, 7], 8, 4, hit=8)})
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"hidden rows at slots \[20, 21.*never written"):
        mgr.materialize(sid, ["c"])
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_save_of_a_step_without_tokens_charges_and_holds_nothing(eager: bool, managers: list) -> None:
    policy = ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({"d"}))
    mgr, drv = make(eager, policy)
    managers.append(mgr)
    start_step(mgr, drv.view, {})
    sid = mgr.save_outputs(torch.zeros(8, 8), {"d": torch.zeros(8, 2)}, num_tokens_unpadded=0, num_tokens_padded=8)
    out = mgr.materialize(sid, [])
    assert out.hidden_states == {} and out.mm_outputs == {"d": {}}
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_discard_releases_the_step_and_its_task_holders(eager: bool, managers: list) -> None:
    mgr, drv = make(eager, staging_depth=1, staging_claim_timeout_s=5.0)
    managers.append(mgr)
    for i in range(3):
        sid, _ = drv.run({"a": Req([0, 1], i, 1)}, new=["a"] if i == 0 else [])
        busy = mgr._controller.parts.staging_pool.page_holders(0)
        assert StagingBufferHolder.for_step(sid) in busy
        mgr.discard_step(sid)
    assert_nothing_held(mgr)


@pytest.mark.parametrize("eager", MODES)
def test_stats_count_hits_steps_rows_and_holders(eager: bool, managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want = drv.run({"a": Req([0, 1, 2], 0, 10)})
    during = mgr.stats()
    assert during["open_steps"] == 1 and during["holders"]["step"] == 1
    drv.check(sid, want)
    sid, want = drv.run({"b": Req([0, 1, 5], 8, 3, hit=8)}, finished=["a"])
    mgr.discard_step(sid)
    quiesce(mgr)
    stats = mgr.stats()
    assert (stats["hit_requests"], stats["hit_tokens"]) == (1, 8)
    assert (stats["steps_saved"], stats["steps_materialized"], stats["steps_discarded"]) == (2, 1, 1)
    assert stats["tokens_saved"] == 13
    keys = len(want["b"])
    # Written rows count once drained: at the manager's next entry, or, with
    # the committer thread, by it right after its pass (its state lock try won).
    assert stats["rows_committed"] in ((10 * keys,) if eager else (10 * keys, 13 * keys))
    mgr.new_step_starts(SimpleNamespace(scheduled_new_reqs=[], finished_req_ids={"b"}, num_scheduled_tokens={}))
    stats = mgr.stats()
    assert stats["rows_committed"] == 13 * keys
    assert stats["failed_writes"] == 0 and not stats["sticky_failure"]
    assert stats["open_steps"] == 0 and stats["holders"] == {"step": 0, "task": 0}
    assert stats["staged_bytes"] == 0 and sum(stats["tasks_by_state"].values()) == 0


def test_the_committer_thread_drains_only_when_the_state_lock_is_free_and_never_waits_for_it(managers: list) -> None:
    mgr, drv = make(False)
    managers.append(mgr)
    ctrl, pool = mgr._controller, mgr.components.pool
    gate = threading.Event()
    write = pool.write

    def gated(*args: Any) -> None:
        gate.wait(10)
        write(*args)

    pool.write = gated  # the committer's pool writes wait for the gate
    sid, want = drv.run({"a": Req([0, 1, 2], 0, 4)})
    drv.check(sid, want)
    lock = mgr.components.state_lock
    lock.acquire()  # a facade's state segment, while the write lands
    try:
        gate.set()
        quiesce(mgr)
        tried = threading.Thread(target=mgr._drain_off_engine)
        tried.start()
        tried.join(5)
        assert not tried.is_alive(), "the committer's drain waited for the state lock"
        assert list(ctrl.parts.registry.completed), "a drain ran while the state lock was held"
    finally:
        lock.release()
    mgr._drain_off_engine()
    assert not list(ctrl.parts.registry.completed)
    assert mgr.stats()["rows_committed"] == 4 * len(want["a"])
