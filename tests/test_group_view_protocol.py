"""``GroupViewLike`` (engine_types) is what the manager reads from its group
view. ``FullAttentionGroupView`` and the simulator's ``SimGroupView`` satisfy
it by member and by call shape; a view lacking a member, or taking the
manager's arguments in another order, does not; and a view with nothing but
the protocol's members drives a whole step."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import pytest
import torch

from omni_prefix_cache.engine_types import GroupViewLike
from omni_prefix_cache.group_view import FullAttentionGroupView
from omni_prefix_cache.interface import PrefixCacheConfig
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.tools.simulate.batch import SimGroupView

BS = 4
METHODS = ("batch_req_ids", "step_slots_cpu")


class _Tables:
    """vLLM's ``input_batch.block_table``: ``block_tables`` and ``[0]``."""

    def __init__(self, group: object) -> None:
        self.block_tables = [group]

    def __getitem__(self, i: int) -> object:
        return self.block_tables[i]


def full_attention_view() -> FullAttentionGroupView:
    group = SimpleNamespace(block_table=SimpleNamespace(cpu=torch.zeros((1, 2), dtype=torch.int32)))
    batch = SimpleNamespace(
        req_ids=["a"],
        req_id_to_index={"a": 0},
        num_computed_tokens_cpu=torch.zeros(1, dtype=torch.int32),
        block_table=_Tables(group),
    )
    return FullAttentionGroupView(batch, BS)  # type: ignore[arg-type]


class _NoSlots:
    """A view without ``step_slots_cpu``."""

    block_size = BS

    def batch_req_ids(self) -> list[str]:
        return []


class _OtherCallShape:
    """``step_slots_cpu`` taking the manager's arguments in the other order."""

    block_size = BS

    def batch_req_ids(self) -> list[str]:
        return []

    def step_slots_cpu(self, num_scheduled: Mapping[str, int], req_ids: Sequence[str]) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)


class _Minimal:
    """Nothing but the protocol's members: every token of the batch on slots 0, 1, ..."""

    block_size = BS

    def batch_req_ids(self) -> list[str]:
        return ["a"]

    def step_slots_cpu(self, req_ids: Sequence[str], num_scheduled: Mapping[str, int]) -> torch.Tensor:
        return torch.arange(sum(num_scheduled[r] for r in req_ids), dtype=torch.int64)


def parameters(obj: object, name: str) -> list[str]:
    """Parameter names of ``obj.name``, without ``self``."""
    params = list(inspect.signature(getattr(obj, name)).parameters)
    return params[1:] if isinstance(obj, type) else params


def conforms(view: object) -> bool:
    """Every member of the protocol, each method with the protocol's parameters."""
    return isinstance(view, GroupViewLike) and all(parameters(view, m) == parameters(GroupViewLike, m) for m in METHODS)


@pytest.mark.parametrize(
    "make", [full_attention_view, lambda: SimGroupView(BS), _Minimal], ids=["full_attention", "simulator", "minimal"]
)
def test_group_views_satisfy_the_protocol(make: type) -> None:
    view = make()
    assert conforms(view)
    assert view.block_size == BS


@pytest.mark.parametrize("view", [_NoSlots(), _OtherCallShape()], ids=["no step_slots_cpu", "other call shape"])
def test_a_view_missing_a_member_or_call_shape_does_not_conform(view: object) -> None:
    assert not conforms(view)


def test_a_view_with_only_the_protocols_members_serves_a_step() -> None:
    mgr = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=4, block_size=BS), _Minimal(), eager=True)
    try:
        mgr.new_step_starts(
            SimpleNamespace(
                scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=0, block_ids=([0],))],
                finished_req_ids=set(),
                num_scheduled_tokens={"a": 2},
            )
        )
        rows = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        sid = mgr.save_outputs(rows, None, num_tokens_unpadded=2, num_tokens_padded=2)
        hidden = mgr.materialize(sid, ["a"]).hidden_states
        assert hidden is not None and torch.equal(hidden["a"], rows)
    finally:
        mgr.shutdown()
