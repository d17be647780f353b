"""A fake model runner written against the newest upstream public API.

It imports only what an upstream runner imports from
``vllm_omni.core.prefix_cache`` (here ``omni_prefix_cache``) and drives the
manager the way the upstream runner integration does each step: translate
the scheduler output (before the input batch drops finished requests), run
``new_step_starts``, update the input batch, build the write layout over a
``FullAttentionGroupView`` of that batch, save, then materialize or discard,
and deliver per consumer (``delivery_view`` / ``ack_delivery`` /
``commit_output``). Scheduler outputs are duck-typed like vLLM's: new and
cached requests (``resumed_req_ids``, ``new_block_ids``), finished ids and the
optional ``prefix_cache_*`` fields.

Rows are a pure function of a position's token prefix, so every delivered row
is checked against the tokens alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from omni_prefix_cache import (
    FullAttentionGroupView,
    ModelCachePolicy,
    OmniPrefixCacheManager,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheSchedulerAdapter,
    StageCacheOutputs,
)

BS = 4
WIDTH = 3
Owner = PrefixCacheRequestOwner


def rows_for(tokens: list[int], start: int, end: int) -> torch.Tensor:
    """The model's hidden rows of positions [start, end): each depends only on its prefix."""
    out = torch.empty((end - start, WIDTH))
    for i, p in enumerate(range(start, end)):
        prefix = sum((t + 1) * 31 ** (k % 7) for k, t in enumerate(tokens[: p + 1]))
        out[i] = torch.tensor([float(prefix % 100_003), float(p), float(tokens[p])])
    return out


# ---------------------------------------------------------------- vLLM-shaped inputs


@dataclass
class NewReqData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


def cached_reqs(entries: Iterable[tuple[str, int, list[int] | None]], resumed: Iterable[str] = ()) -> SimpleNamespace:
    """``CachedRequestData``: (req_id, num_computed_tokens, new block ids or None)."""
    rows = list(entries)
    return SimpleNamespace(
        req_ids=[r for r, _, _ in rows],
        resumed_req_ids=set(resumed),
        num_computed_tokens=[c for _, c, _ in rows],
        new_block_ids=[None if b is None else (b,) for _, _, b in rows],
        num_output_tokens=[0 for _ in rows],
    )


def sched(
    new: Iterable[NewReqData] = (),
    cached: SimpleNamespace | None = None,
    tokens: dict[str, int] | None = None,
    *,
    finished: Iterable[str] = (),
    owners: dict[str, Owner] | None = None,
    replacements: Iterable[PrefixCacheRequestEvent] = (),
    sequence: int | None = None,
) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached if cached is not None else cached_reqs([]),
        num_scheduled_tokens=dict(tokens or {}),
        finished_req_ids=set(finished),
        prefix_cache_owners=dict(owners or {}),
        prefix_cache_replacements=tuple(replacements),
        prefix_cache_step_sequence=sequence,
    )


class _Tables:
    def __init__(self, group: Any) -> None:
        self.block_tables = [group]

    def __getitem__(self, i: int) -> Any:
        return self.block_tables[i]


class FakeInputBatch:
    """The slice of vLLM's InputBatch the group view reads, kept up to date
    from each scheduler output as vLLM's ``_update_states`` does."""

    def __init__(self) -> None:
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.num_computed_tokens_cpu = np.zeros(0, dtype=np.int32)
        self.group = SimpleNamespace(block_table=SimpleNamespace(cpu=torch.zeros((0, 1), dtype=torch.int32)))
        self.block_table = _Tables(self.group)
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def update(self, so: Any) -> None:
        for rid in so.finished_req_ids:
            self.blocks.pop(rid, None)
            self.computed.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.blocks[nr.req_id] = list(nr.block_ids[0])
            self.computed[nr.req_id] = nr.num_computed_tokens
        cr = so.scheduled_cached_reqs
        for rid, computed, new in zip(cr.req_ids, cr.num_computed_tokens, cr.new_block_ids, strict=True):
            if rid in cr.resumed_req_ids:
                self.blocks[rid] = list(new[0])  # a resumed request's block ids replace the old ones
            elif new is not None:
                self.blocks[rid] += list(new[0])
            self.computed[rid] = computed
        order = [r for r in so.num_scheduled_tokens if r in self.blocks]
        width = max([1, *(len(self.blocks[r]) for r in order)])
        table = torch.zeros((max(1, len(order)), width), dtype=torch.int32)
        for i, rid in enumerate(order):
            table[i, : len(self.blocks[rid])] = torch.tensor(self.blocks[rid], dtype=torch.int32)
        self.req_ids = order
        self.req_id_to_index = {r: i for i, r in enumerate(order)}
        self.num_computed_tokens_cpu = np.array([self.computed[r] for r in order], dtype=np.int32)
        self.group.block_table.cpu = table


# ---------------------------------------------------------------- the runner


@dataclass
class Step:
    sid: int
    req_ids: list[str]


@dataclass
class Delivered:
    """What each consumer received, per request: positions and rows in order."""

    positions: dict[str, list[int]] = field(default_factory=dict)
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, rid: str, start: int, end: int, rows: torch.Tensor) -> None:
        self.positions.setdefault(rid, []).extend(range(start, end))
        self.rows.setdefault(rid, []).append(rows)


class FakeRunner:
    """A model runner's prefix-cache integration, in the upstream order."""

    def __init__(self, num_blocks: int = 16) -> None:
        self.cache = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=num_blocks, block_size=BS))
        self.cache.register_policy(ModelCachePolicy())
        self.adapter = PrefixCacheSchedulerAdapter()
        self.input_batch = FakeInputBatch()
        self.view = FullAttentionGroupView(self.input_batch, BS)  # type: ignore[arg-type]
        self.tokens: dict[str, list[int]] = {}  # the runner's requests (by id, the newest content)
        self.got: dict[str, Delivered] = {}

    def execute_model(self, so: Any) -> Step | None:
        for nr in so.scheduled_new_reqs:
            self.tokens[nr.req_id] = list(nr.prompt_token_ids)
        step = self.adapter.translate_step(so)
        self.cache.new_step_starts(step)  # before the batch drops finished requests
        self.input_batch.update(so)
        if not step.scheduled_tokens:
            return None
        layout = self.adapter.build_write_layout(self.view, num_scheduled_tokens=dict(step.scheduled_tokens))
        parts = [rows_for(self.tokens[w.req_id], w.token_start, w.token_end) for w in layout.writes]
        hidden = torch.cat(parts) if parts else torch.empty((0, WIDTH))
        n = layout.total_rows
        sid = self.cache.save_outputs(hidden, {}, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)
        return Step(sid, [w.req_id for w in layout.writes if w.row_end > w.row_start])

    def materialize(self, step: Step) -> StageCacheOutputs:
        outs = self.cache.materialize(step.sid, step.req_ids)
        for rid in step.req_ids:  # the full rows it hands over, by position
            start, end = outs.token_ranges[rid]
            assert outs.hidden_states is not None
            assert torch.equal(outs.hidden_states[rid], rows_for(self.tokens[rid], start, end)), (rid, start, end)
        return outs

    def deliver(self, outs: StageCacheOutputs, consumer: str, *, commit: bool = False) -> frozenset[str]:
        """One consumer takes what it has not received of ``outs``."""
        view = self.cache.delivery_view(outs, list(outs.token_ranges), consumer=consumer)
        got = self.got.setdefault(consumer, Delivered())
        assert view.hidden_states is not None
        taken: list[frozenset[str]] = []
        if commit:
            live = self.cache.commit_output(outs, taken.append, delivery=view)
        else:
            self.cache.ack_delivery(view)
            live = frozenset(view.token_ranges)
        for rid in live:
            start, end = view.token_ranges[rid]
            got.add(rid, start, end, view.hidden_states[rid])
        assert not commit or taken == [live]
        return live

    def check_received(self, consumer: str, rid: str, upto: int) -> None:
        """``consumer`` got every position of ``rid`` below ``upto`` once, in order, with its rows."""
        got = self.got[consumer]
        assert got.positions[rid] == list(range(upto)), got.positions[rid]
        assert torch.equal(torch.cat(got.rows[rid]), rows_for(self.tokens[rid], 0, upto))


def new(rid: str, tokens: list[int], blocks: list[int], computed: int = 0) -> NewReqData:
    return NewReqData(rid, tokens, (blocks,), computed)


PROMPT = list(range(5, 21))  # the prompt and the tokens it will decode


@pytest.fixture
def runner() -> Any:
    r = FakeRunner()
    yield r
    r.cache.shutdown()


def test_a_resume_recovers_what_a_consumer_viewed_but_never_acknowledged(runner: FakeRunner) -> None:
    # The talker acknowledges step 1; the client takes a view of it and never
    # acknowledges it (its handoff was dropped). A discarded decode step,
    # then a preemption; the request resumes with the 8 cached positions.
    # The resume's hit must start at the client's watermark (0, a consumer
    # the tenure knows), so the client gets every position exactly once.
    own = {"a": Owner(1)}
    s1 = runner.execute_model(sched([new("a", PROMPT, [1, 2, 3])], None, {"a": 8}, owners=own, sequence=1))
    assert s1 is not None
    out1 = runner.materialize(s1)
    runner.deliver(out1, "talker")
    runner.cache.delivery_view(out1, ["a"], consumer="client")  # viewed, never acknowledged
    s2 = runner.execute_model(sched((), cached_reqs([("a", 8, None)]), {"a": 1}, owners=own, sequence=2))
    assert s2 is not None
    runner.cache.discard_step(s2.sid)  # the decode step's output is lost: position 8 was never delivered
    # Preempted: not scheduled for a step, then resumed with its blocks' hit.
    assert runner.execute_model(sched((), None, {}, sequence=3)) is None
    resume = cached_reqs([("a", 8, [1, 2, 3])], resumed=["a"])
    s4 = runner.execute_model(sched((), resume, {"a": 2}, owners=own, sequence=4))
    assert s4 is not None
    out4 = runner.materialize(s4)
    assert out4.token_ranges["a"] == (0, 10)  # recovered from the lowest watermark
    assert out4.scheduled_token_ranges["a"] == (8, 10)
    assert runner.deliver(out4, "client", commit=True) == {"a"}
    runner.deliver(out4, "talker")
    runner.check_received("client", "a", 10)
    runner.check_received("talker", "a", 10)
    # The same step again (a replayed sequence) changes nothing: the next
    # decode continues at 10 for both consumers.
    assert runner.execute_model(sched((), resume, {"a": 2}, owners=own, sequence=4)) is None
    s5 = runner.execute_model(sched((), cached_reqs([("a", 10, None)]), {"a": 1}, owners=own, sequence=5))
    assert s5 is not None
    out5 = runner.materialize(s5)
    assert out5.token_ranges["a"] == (10, 11)
    for consumer in ("talker", "client"):
        runner.deliver(out5, consumer)
        runner.check_received(consumer, "a", 11)


def test_growing_and_shrinking_resumed_hits_deliver_each_position_once(runner: FakeRunner) -> None:
    own = {"a": Owner(1), "b": Owner(2)}
    # b computes a 12-token prompt; a shares its first 8 tokens and runs behind.
    prompt_b = PROMPT[:8] + [40, 41, 42, 43]
    s1 = runner.execute_model(
        sched([new("a", PROMPT, [1, 2, 3]), new("b", prompt_b, [4, 5, 6])], None, {"a": 4, "b": 12}, owners=own)
    )
    assert s1 is not None
    out1 = runner.materialize(s1)
    for consumer in ("talker", "client"):
        runner.deliver(out1, consumer)
    # a is preempted and resumes on b's blocks: a growing hit of 8 (it had computed 4).
    grow = cached_reqs([("a", 8, [4, 5, 7])], resumed=["a"])
    s2 = runner.execute_model(sched((), grow, {"a": 1}, owners=own))
    assert s2 is not None
    out2 = runner.materialize(s2)
    assert out2.token_ranges["a"] == (4, 9)  # served [4, 8) from b's rows, then its own position 8
    runner.deliver(out2, "talker")
    # Preempted again; its blocks lost all but the first: a shrinking hit of 4,
    # below the talker's watermark 9. The client (at 4) still gets [4, 6).
    shrink = cached_reqs([("a", 4, [4, 8])], resumed=["a"])
    s3 = runner.execute_model(sched((), shrink, {"a": 2}, owners=own))
    assert s3 is not None
    out3 = runner.materialize(s3)
    assert out3.token_ranges["a"] == (4, 6)
    talker = runner.cache.delivery_view(out3, ["a"], consumer="talker")
    assert talker.token_ranges["a"] == (6, 6)  # nothing new for the talker
    assert talker.hidden_states is not None and talker.hidden_states["a"].shape[0] == 0
    runner.cache.ack_delivery(talker)
    runner.deliver(out3, "client")
    s4 = runner.execute_model(sched((), cached_reqs([("a", 6, [9])]), {"a": 4}, owners=own))
    assert s4 is not None
    out4 = runner.materialize(s4)
    runner.deliver(out4, "talker")
    runner.deliver(out4, "client")
    runner.check_received("talker", "a", 10)
    runner.check_received("client", "a", 10)
    # A consumer that skipped an output cannot silently continue past it.
    s5 = runner.execute_model(sched((), cached_reqs([("a", 10, None)]), {"a": 1}, owners=own))
    s6 = runner.execute_model(sched((), cached_reqs([("a", 11, None)]), {"a": 1}, owners=own))
    assert s5 is not None and s6 is not None
    runner.cache.discard_step(s5.sid)
    out6 = runner.materialize(s6)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="delivery gap for request 'a' consumer 'client'"):
        runner.cache.delivery_view(out6, ["a"], consumer="client")
    assert out6._progress["a"].delivered_upto == {"talker": 10, "client": 10}


def test_a_replaced_or_reused_id_never_delivers_the_old_owners_rows(runner: FakeRunner) -> None:
    own = {"r": Owner(1)}
    s1 = runner.execute_model(sched([new("r", PROMPT, [1, 2, 3])], None, {"r": 6}, owners=own))
    assert s1 is not None
    old_out = runner.materialize(s1)  # not yet committed when the content is replaced
    replaced = Owner(1, 1)
    control = PrefixCacheRequestEvent("r", PrefixCacheEventKind.REPLACED, owner=replaced, lookup_complete=False)
    new_prompt = [70, 71, 72, 73, 74]
    s2 = runner.execute_model(
        sched(
            [new("r", new_prompt, [4, 5])],
            None,
            {"r": 5},
            owners={"r": replaced},
            replacements=[control],
        )
    )
    assert s2 is not None
    handed: list[frozenset[str]] = []
    view = runner.cache.delivery_view(old_out, ["r"], consumer="talker")
    assert runner.cache.commit_output(old_out, handed.append, delivery=view) == frozenset()
    assert handed == [frozenset()]  # the retired tenure's rows are never handed off
    new_out = runner.materialize(s2)
    assert new_out.token_ranges["r"] == (0, 5)
    assert runner.deliver(new_out, "talker", commit=True) == {"r"}
    runner.check_received("talker", "r", 5)
    # A late acknowledgement of the old output moves only the old tenure.
    runner.cache.ack_delivery(runner.cache.delivery_view(old_out, ["r"], consumer="client"))
    assert old_out._progress["r"].delivered_upto == {"client": 6}
    assert new_out._progress["r"].delivered_upto == {"talker": 5}
    # r finishes; a new admission reuses the id. The old owner's leftover
    # events (the adapter drops them) and outputs move nothing of the new one.
    s3 = runner.execute_model(
        sched([new("r", PROMPT, [6, 7, 8])], None, {"r": 3}, finished=["r"], owners={"r": Owner(2)})
    )
    assert s3 is not None
    out3 = runner.materialize(s3)
    stale = runner.adapter.translate_step(
        sched((), cached_reqs([("r", 5, None)]), {}, owners={"r": replaced}, finished=())
    )
    assert stale.events == ()
    runner.cache.new_step_starts([PrefixCacheRequestEvent("r", PrefixCacheEventKind.FINISHED, owner=replaced)])
    runner.cache.ack_delivery(runner.cache.delivery_view(new_out, ["r"], consumer="client"))
    view3 = runner.cache.delivery_view(out3, ["r"], consumer="client")
    assert view3.token_ranges["r"] == (0, 3) and view3.hidden_states is not None
    assert torch.equal(view3.hidden_states["r"], rows_for(PROMPT, 0, 3))
    runner.cache.ack_delivery(view3)
    assert out3._progress["r"].owner == Owner(2)
    assert out3._progress["r"].delivered_upto == {"client": 3}
    assert new_out._progress["r"].delivered_upto == {"talker": 5, "client": 5}
