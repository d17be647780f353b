"""Materialize cuts one gather per key into per-request views: every subset
of a step's requests, in any order, with hits among them, gets exactly its
own rows (pool keys and token-major leftover mm alike), and no two requests
share a row."""

from __future__ import annotations

import random
from itertools import accumulate

import pytest
import torch

from omni_prefix_cache.interface import HIDDEN_KEY
from omni_prefix_cache.reads.materializer import RequestRuns, gather_index
from omni_prefix_cache.steps.step_context import StepContext
from omni_prefix_cache.steps.step_record import StepRecord
from test_manager import MODES, Driver, Req, make


@pytest.mark.parametrize("seed", range(6))
def test_gather_index_concatenates_each_span(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        k = rng.randint(0, 8)
        starts = [rng.randint(0, 40) for _ in range(k)]
        sizes = [rng.choice([0, 1, 1, 3, 6]) for _ in range(k)]
        want = [row for s, n in zip(starts, sizes) for row in range(s, s + n)]
        got = gather_index(starts, sizes)
        assert got.dtype == torch.int64 and got.tolist() == want, (starts, sizes)


def _step_with_a_hit(drv: Driver) -> tuple[int, dict[str, dict[str, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """Step 2 schedules a, b, c (c hits a's first block) and carries a 1-D
    per-token leftover entry and a per-step one. Returns the step id, the
    pool-key rows each request must get, and the two leftover entries."""
    sid, want = drv.run({"a": Req([0, 1], 0, 6)})
    drv.check(sid, want)
    reqs = {"a": Req([0, 1], 6, 1), "b": Req([2, 3], 0, 5), "c": Req([0, 4], 4, 2, hit=4)}
    drv.view.order = list(reqs)
    n = 1 + 5 + 2
    codes = torch.arange(100, 100 + n)
    per_step = torch.tensor([7, 8, 9])
    real_save = drv.mgr.save_outputs

    def save(hidden: torch.Tensor, mm: dict[str, torch.Tensor], **kw: int) -> int:
        return real_save(hidden, {**mm, "codes": codes, "per_step": per_step}, **kw)

    drv.mgr.save_outputs = save  # type: ignore[method-assign]
    try:
        sid, want = drv.run(reqs, new=["b", "c"])
    finally:
        drv.mgr.save_outputs = real_save  # type: ignore[method-assign]
    return sid, want, codes, per_step


@pytest.mark.parametrize("eager", MODES)
@pytest.mark.parametrize("asked", [["a", "b", "c"], ["c", "b", "a"], ["b"], ["c"], ["b", "a"], ["a", "c"], []])
def test_any_subset_gets_exactly_its_rows(eager: bool, asked: list[str], managers: list) -> None:
    mgr, drv = make(eager)
    managers.append(mgr)
    sid, want, codes, per_step = _step_with_a_hit(drv)
    out = mgr.materialize(sid, asked)
    assert out.hidden_states is not None
    assert sorted(out.hidden_states) == sorted(asked)
    spans = {"a": (0, 1), "b": (1, 5), "c": (6, 2)}
    for rid in asked:
        for key in (HIDDEN_KEY, "m"):
            have = out.hidden_states[rid] if key == HIDDEN_KEY else out.mm_outputs[key][rid]
            assert torch.equal(have, want[rid][key]), (rid, key)
        start, rows = spans[rid]
        assert torch.equal(out.mm_outputs["codes"][rid], codes[start : start + rows])
        assert torch.equal(out.mm_outputs["per_step"][rid], per_step)
    # Views of one gather, never of each other's rows nor of the caller's tensors.
    for key in ("m", "codes"):
        spans_seen: list[tuple[int, int]] = []
        for rid in asked:
            t = out.mm_outputs[key][rid]
            assert t.untyped_storage().data_ptr() != codes.untyped_storage().data_ptr()
            lo = t.data_ptr()
            spans_seen.append((lo, lo + t.numel() * t.element_size()))
        spans_seen.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans_seen, spans_seen[1:]))
    ptrs = [out.mm_outputs["per_step"][rid].data_ptr() for rid in asked]
    assert len(set(ptrs)) == len(ptrs)  # request-invariant entries are cloned per request


def _ctx(sizes: list[int]) -> StepContext:
    """A step context of requests r0, r1, ... with these row counts."""
    order = [f"r{i}" for i in range(len(sizes))]
    starts = [0, *accumulate(sizes)]
    spans = {rid: (start, rows) for rid, start, rows in zip(order, starts, sizes)}
    return StepContext(step_id=1, staging=None, n=starts[-1], record=StepRecord.of_rows(order, spans))  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(8))
def test_step_rows_gather_each_subset_once_in_step_order(seed: int) -> None:
    """Any subset (adjacent requests merged into runs; a few runs copied,
    many gathered by index) gets its own rows, in step order, in one new
    tensor its per-request tensors cut without overlap."""
    rng = random.Random(seed)
    for _ in range(40):
        sizes = [rng.choice([1, 1, 2, 5]) for _ in range(rng.randint(1, 30))]
        ctx = _ctx(sizes)
        src = torch.arange(ctx.n * 6, dtype=torch.float32).reshape(ctx.n, 2, 3)
        wanted = {rid for rid in ctx.record.req_ids if rng.random() < rng.choice([0.3, 0.7, 1.0])}
        rows = RequestRuns.of(ctx, wanted)
        assert rows.names == [rid for rid in ctx.record.req_ids if rid in wanted]
        if not wanted:
            continue
        got = rows.gather(src)
        want = [src[ctx.record.span(rid)[0] : sum(ctx.record.span(rid))] for rid in rows.names]
        assert torch.equal(got, torch.cat(want))
        assert got.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
        parts = rows.views(got)
        assert len(parts) == len(rows.names)
        ends = 0
        for part, expect in zip(parts, want):
            assert torch.equal(part, expect)
            assert part.data_ptr() == got.data_ptr() + ends * got.stride(0) * got.element_size()
            ends += int(part.shape[0])
        assert ends == int(got.shape[0])


@pytest.mark.parametrize("eager", MODES)
def test_many_scattered_requests_get_their_rows(eager: bool, managers: list) -> None:
    """Twenty one-token requests over three steps, asked for every other
    one (ten runs: more than are copied one by one, so one index gather),
    the first half (one run) and one alone."""
    mgr, drv = make(eager)
    managers.append(mgr)
    names = [f"q{i}" for i in range(20)]
    for step, asked in enumerate((names[::2], names[:10], ["q7"])):
        reqs = {rid: Req([i], step, 1) for i, rid in enumerate(names)}
        sid, want = drv.run(reqs, new=names if step == 0 else [])
        out = mgr.materialize(sid, asked)
        assert out.hidden_states is not None and list(out.hidden_states) == asked
        for rid in asked:
            assert torch.equal(out.hidden_states[rid], want[rid][HIDDEN_KEY]), rid
            assert torch.equal(out.mm_outputs["m"][rid], want[rid]["m"]), rid
        assert list(out.token_ranges) == asked and all(out.token_ranges[r] == (step, step + 1) for r in asked)
