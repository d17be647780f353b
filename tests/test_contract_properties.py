"""Property test of the facade's input handling (issue 11).

Hypothesis drives a serving engine (``testing.serving_model``: requests with
shared prompts, prefix hits, block reuse, finishes) through the manager and,
before any facade call, may first try a malformed version of it: a broken
scheduler output, tensors of the wrong shape, dtype, device or stride,
padding, bad step ids and request id sequences. Every call either succeeds
with exactly the rows the model predicts, or raises one of the documented
error types; a rejected call leaves the manager's tables as they were, the
valid call after it gives exact rows, and at the end nothing is held.

A failure prints the reproduce blob (the ci profile is derandomized, so the
same command replays it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
)
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.testing.serving_model import NewReq, PlannedStep, SchedOut, ServingModel
from test_contract import assert_same_state, background_drain_paused, manager_state

NUM_BLOCKS, BLOCK_SIZE, CAPACITY = 12, 2, 16
WIDTHS = {HIDDEN_KEY: 4, "m": 3}
PREFIXES = [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]

# What the property test tried, by (call, case, outcome); printed with -s.
TRIED: Counter[tuple[str, str, str]] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _print_what_was_tried() -> Iterator[None]:
    """Prints the malformed calls tried, by case and outcome (run with -s)."""
    yield
    for (where, case, outcome), count in sorted(TRIED.items()):
        print(f"{where:16} {case:32} {outcome:9} {count}")
    print(f"total malformed calls: {sum(TRIED.values())}, distinct cases: {len({(w, c) for w, c, _ in TRIED})}")


@dataclass(frozen=True)
class Bad:
    """A malformed call. ``must``: "reject" (an invalid-argument error, and
    nothing changes), "refuse" (any documented error, nothing changes),
    "consume" (a documented error that consumes the step, as documented for
    ids outside the save snapshot) or "either" (an equivalent call: accepted
    with exact rows, or refused with nothing changed)."""

    case: str
    must: str
    call: Callable[[], Any]


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view (every other row of a bigger buffer)."""
    big = torch.full((2 * int(t.shape[0]), *t.shape[1:]), -7.0, dtype=t.dtype)
    big[::2] = t
    return big[::2]


def bad_new_step(mgr: OmniPrefixCacheManager, out: SchedOut, draw: Any) -> Bad:
    rid = next(iter(out.num_scheduled_tokens))
    n = out.num_scheduled_tokens[rid]
    sched = dict(out.num_scheduled_tokens)

    def with_(**kw: Any) -> Callable[[], Any]:
        return lambda: mgr.new_step_starts(replace(out, **kw))

    def extra(req: Any) -> Callable[[], Any]:
        return with_(scheduled_new_reqs=[*out.scheduled_new_reqs, req])

    cases = {
        "finished is a str": with_(finished_req_ids=rid),
        "finished holds an int": with_(finished_req_ids={*out.finished_req_ids, 5}),
        "scheduled count negative": with_(num_scheduled_tokens={**sched, rid: -n}),
        "scheduled count float": with_(num_scheduled_tokens={**sched, rid: float(n)}),
        "scheduled count bool": with_(num_scheduled_tokens={**sched, rid: True}),
        "scheduled count None": with_(num_scheduled_tokens={**sched, rid: None}),
        "scheduled key int": with_(num_scheduled_tokens={**sched, 7: 1}),
        "scheduled not a mapping": with_(num_scheduled_tokens=list(sched.items())),
        "new reqs is a str": with_(scheduled_new_reqs="zz"),
        "new req without req_id": extra({"req_id": "zz"}),
        "new req id int": extra(NewReq(9, 0, ([],))),
        "new req computed negative": extra(NewReq("zz", -2, ([0],))),
        "new req computed float": extra(NewReq("zz", 2.0, ([0],))),
        "hit not block aligned": extra(NewReq("zz", 1, ([0],))),
        "hit without block ids": extra(NewReq("zz", 2, ())),
        "hit with too few block ids": extra(NewReq("zz", 4, ([0],))),
        "hit block id out of range": extra(NewReq("zz", 2, ([NUM_BLOCKS + 3],))),
        "hit block id float": extra(NewReq("zz", 2, ([0.0],))),
        "hit block ids a str": extra(NewReq("zz", 2, "0")),
    }
    case = draw(st.sampled_from(sorted(cases)), label="bad new_step_starts")
    return Bad(case, "reject", cases[case])


def bad_save(mgr: OmniPrefixCacheManager, step: PlannedStep, draw: Any) -> Bad:
    h, m, n = step.hidden, step.mm["m"], step.n

    def save(hidden: Any = h, mm: Any = None, un: Any = n, pad: Any = n) -> Callable[[], Any]:
        mm = {"m": m} if mm is None else mm
        return lambda: mgr.save_outputs(hidden, mm, num_tokens_unpadded=un, num_tokens_padded=pad)

    garbage = torch.full((3, WIDTHS[HIDDEN_KEY]), -9.0)
    reject: dict[str, Callable[[], Any]] = {
        "unpadded None": save(un=None),
        "unpadded float": save(un=float(n)),
        "unpadded bool": save(un=bool(n)),
        "unpadded negative": save(un=-n),
        "unpadded one more": save(un=n + 1, pad=n + 1),
        "unpadded one less": save(un=n - 1),
        "padded below unpadded": save(pad=n - 1),
        "padded float": save(pad=float(n)),
        "hidden None": save(hidden=None),
        "hidden a list": save(hidden=h.tolist()),
        "hidden 1-D": save(hidden=h.reshape(-1)),
        "hidden too few rows": save(hidden=h[: n - 1]),
        "hidden on meta": save(hidden=_meta(h)),
        "mm not a mapping": save(mm=[("m", m)]),
        "mm name int": save(mm={"m": m, 3: m}),
        "mm reserved name": save(mm={"m": m, HIDDEN_KEY: h}),
        "mm on meta": save(mm={"m": _meta(m)}),
        "mm leftover on meta": save(mm={"m": m, "extra": [torch.zeros(2, device="meta")]}),
    }
    if mgr._pool.has_key(HIDDEN_KEY):  # the first save fixes a key's dtype and width
        reject["hidden float64"] = save(hidden=h.double())
        reject["hidden wider"] = save(hidden=torch.cat([h, h[:, :1]], dim=1))
        reject["hidden 3-D"] = save(hidden=h.reshape(n, 2, 2))
    if mgr._pool.has_key("m"):
        reject["mm float64"] = save(mm={"m": m.double()})
    either: dict[str, Callable[[], Any]] = {
        "hidden strided": save(hidden=_strided(h)),
        "mm strided": save(mm={"m": _strided(m)}),
        "hidden padded": save(hidden=torch.cat([h, garbage]), pad=n + 3),
        "hidden and mm padded": save(
            hidden=torch.cat([h, garbage]), mm={"m": torch.cat([m, garbage[:, :3]])}, pad=n + 3
        ),
        "hidden needs grad": save(hidden=h.clone().requires_grad_(True)),
    }
    cases = {**{k: ("reject", v) for k, v in reject.items()}, **{k: ("either", v) for k, v in either.items()}}
    case = draw(st.sampled_from(sorted(cases)), label="bad save_outputs")
    must, call = cases[case]
    return Bad(case, must, call)


def bad_consume(mgr: OmniPrefixCacheManager, sid: int, rids: list[str], draw: Any) -> Bad:
    cases: dict[str, tuple[str, Callable[[], Any]]] = {
        "step id bool": ("reject", lambda: mgr.materialize(bool(sid), rids)),
        "step id float": ("reject", lambda: mgr.materialize(float(sid), rids)),
        "step id str": ("reject", lambda: mgr.materialize(str(sid), rids)),
        "discard step id float": ("reject", lambda: mgr.discard_step(float(sid))),
        "step id unknown": ("refuse", lambda: mgr.materialize(sid + 1000, rids)),
        "discard step id unknown": ("refuse", lambda: mgr.discard_step(sid + 1000)),
        "req ids a str": ("reject", lambda: mgr.materialize(sid, rids[0])),
        "req ids hold an int": ("reject", lambda: mgr.materialize(sid, [*rids, 3])),
        "req ids None inside": ("reject", lambda: mgr.materialize(sid, [None])),
        "req id outside the snapshot": ("consume", lambda: mgr.materialize(sid, [*rids, "nope"])),
    }
    case = draw(st.sampled_from(sorted(cases)), label="bad consume")
    must, call = cases[case]
    return Bad(case, must, call)


def attempt(mgr: OmniPrefixCacheManager, where: str, bad: Bad) -> Any:
    """Run a malformed call and check its outcome; returns the call's result
    when an equivalent call was accepted, else None."""
    with background_drain_paused(mgr):
        before = manager_state(mgr)
        try:
            result = bad.call()
        except OmniPrefixCacheUnmatchError as exc:
            if bad.must == "reject":
                assert isinstance(exc, OmniPrefixCacheInvalidArgumentError), (where, bad.case, exc)
            if bad.must != "consume":
                assert_same_state(before, manager_state(mgr))
            TRIED[(where, bad.case, "refused")] += 1
            event(f"{where}: {bad.case}: refused")
            return None
    assert bad.must == "either", f"{where}: malformed call accepted: {bad.case}"
    TRIED[(where, bad.case, "accepted")] += 1
    event(f"{where}: {bad.case}: accepted")
    return result


def check_rows(model: ServingModel, step: PlannedStep, outs: Any, rids: list[str]) -> None:
    for exp in step.expects:
        if exp.rid not in rids:
            continue
        for key in WIDTHS:
            got = outs.hidden_states[exp.rid] if key == HIDDEN_KEY else outs.mm_outputs[key][exp.rid]
            want = model.expected_rows(exp, key)
            assert got.shape == want.shape and torch.equal(got, want), (exp.rid, key, exp.start, exp.end)


def assert_nothing_leaked(mgr: OmniPrefixCacheManager) -> None:
    ctrl = mgr._controller
    assert not mgr._step_ctxs and not mgr._hits.pending and not mgr._ledger.records
    rt = mgr._ledger.requests
    assert not rt.tasks and not rt.deferred and not rt.opened and not mgr._live
    assert not ctrl.parts.staging_pool.holders()
    assert ctrl.parts.budget.staged_bytes == 0 and not ctrl.parts.registry.tasks and not ctrl.parts.registry.failed


@pytest.mark.parametrize("eager", [pytest.param(True, id="eager"), pytest.param(False, id="threaded")])
@given(data=st.data())
def test_every_call_gives_exact_rows_or_a_documented_error_and_a_refusal_changes_nothing(
    eager: bool, data: st.DataObject
) -> None:
    draw = data.draw
    model = ServingModel(NUM_BLOCKS, BLOCK_SIZE, WIDTHS, PREFIXES)
    config = PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, staging_capacity_tokens=CAPACITY)
    mgr = OmniPrefixCacheManager(config, model.view, eager=eager)
    try:
        for _ in range(draw(st.integers(1, 3), label="arrivals")):
            model.arrive(draw(st.integers(0, 2)), [21])
        for _ in range(draw(st.integers(2, 5), label="steps")):
            if draw(st.booleans(), label="arrive"):
                model.arrive(draw(st.integers(0, 2)), [22, 23][: draw(st.integers(0, 2))])
            running = [r.rid for r in model.running()]
            if running and draw(st.booleans(), label="finish one"):
                model.end(draw(st.sampled_from(running)))
            step = model.schedule(
                admit=lambda req: draw(st.integers(0, 5)), run=lambda req: draw(st.integers(0, 2)), capacity=CAPACITY
            )
            if step is None:
                continue
            if draw(st.booleans(), label="malform new_step_starts"):
                attempt(mgr, "new_step_starts", bad_new_step(mgr, step.out, draw))
            mgr.new_step_starts(step.out)
            sid = None
            if draw(st.booleans(), label="malform save_outputs"):
                sid = attempt(mgr, "save_outputs", bad_save(mgr, step, draw))
            if sid is None:
                sid = mgr.save_outputs(step.hidden, step.mm, num_tokens_unpadded=step.n, num_tokens_padded=step.n)
            rids = [e.rid for e in step.expects]
            if draw(st.booleans(), label="malform consume"):
                bad = bad_consume(mgr, sid, rids, draw)
                attempt(mgr, "materialize", bad)
                if bad.must == "consume":
                    continue
            if draw(st.integers(0, 4), label="discard") == 0:
                mgr.discard_step(sid)
                continue
            subset = draw(st.sampled_from(["all", "tuple", "reversed", "first"]), label="req id sequence")
            ids: Any = {"all": rids, "tuple": tuple(rids), "reversed": rids[::-1], "first": rids[:1]}[subset]
            outs = mgr.materialize(sid, ids)
            check_rows(model, step, outs, list(ids))
            with pytest.raises(OmniPrefixCacheUnmatchError, match="already materialized or discarded"):
                mgr.discard_step(sid)
        # Finish everything; once the writes are drained, no table holds anything.
        for rid in list(model.requests):
            model.end(rid)
        mgr.new_step_starts(SchedOut([], model.finished_pending, {}))
        model.finished_pending = set()
        ctrl = mgr._controller
        ctrl.join([t.tid for t in list(ctrl.parts.registry.tasks.values())])
        mgr.new_step_starts(SchedOut([], set(), {}))
        assert_nothing_leaked(mgr)
    finally:
        mgr.shutdown()
        mgr._hits.prefetch.shutdown(wait=True)
    assert not mgr._reads.pending and not mgr._controller.parts.staging_pool.holders()
