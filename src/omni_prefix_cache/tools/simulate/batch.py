"""The engine-side input batch and the duck-typed group view the manager reads."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import torch


class PersistentBatch:
    """vLLM-like persistent batch order.

    Requests not scheduled this step leave holes, new ones fill the first
    holes, then the tail is moved into any remaining holes (condense). The
    resulting order is what the forward's rows follow, and it is not the
    scheduling order.
    """

    def __init__(self) -> None:
        self._rows: list[str | None] = []

    def update(self, scheduled: Sequence[str]) -> list[str]:
        keep = set(scheduled)
        self._rows = [r if r in keep else None for r in self._rows]
        present = {r for r in self._rows if r is not None}
        for r in scheduled:
            if r in present:
                continue
            try:
                self._rows[self._rows.index(None)] = r
            except ValueError:
                self._rows.append(r)
        while self._rows and self._rows[-1] is None:
            self._rows.pop()
        while None in self._rows:
            hole = self._rows.index(None)
            self._rows[hole] = self._rows.pop()
            while self._rows and self._rows[-1] is None:
                self._rows.pop()
        return [r for r in self._rows if r is not None]  # no holes are left


class _BlockTableGroup:
    """Group 0 of vLLM's block table: ``block_table.cpu`` is an int32 (rows, width) tensor."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.dcp_world_size = 1
        self.pcp_world_size = 1
        self.block_table = SimpleNamespace(cpu=torch.zeros((0, 1), dtype=torch.int32))


class _BlockTable:
    def __init__(self, group: _BlockTableGroup) -> None:
        self._group = group
        self.block_tables = [group]

    def __getitem__(self, idx: int) -> _BlockTableGroup:
        return self._group


class SimInputBatch:
    """The slice of vLLM's InputBatch a group view reads, rebuilt for every step."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.num_computed_tokens_cpu = torch.zeros((0,), dtype=torch.int32)
        self._group = _BlockTableGroup(block_size)
        self.block_table = _BlockTable(self._group)

    def set_step(self, order: list[str], blocks: Mapping[str, Sequence[int]], computed: Mapping[str, int]) -> None:
        width = max([1, *(len(blocks[r]) for r in order)])
        table = torch.zeros((max(1, len(order)), width), dtype=torch.int32)
        for i, r in enumerate(order):
            b = blocks[r]
            if b:
                table[i, : len(b)] = torch.as_tensor(list(b), dtype=torch.int32)
        self.req_ids = list(order)
        self.req_id_to_index = {r: i for i, r in enumerate(order)}
        self.num_computed_tokens_cpu = torch.as_tensor([int(computed[r]) for r in order] or [0], dtype=torch.int32)
        self._group.block_table.cpu = table


class SimGroupView:
    """The project's :class:`FullAttentionGroupView` over a simulated input batch.

    ``set_step`` installs the batch of the step being run. Calls from threads
    other than the engine thread are counted: a manager reading the view from
    a lagging materialize would see the next step's batch.
    """

    def __init__(self, block_size: int) -> None:
        from omni_prefix_cache.group_view import FullAttentionGroupView

        self.block_size = block_size
        self.input_batch = SimInputBatch(block_size)
        self._inner = FullAttentionGroupView(self.input_batch, block_size)
        self._engine_thread = threading.get_ident()
        self.off_thread_calls = 0

    def set_step(self, order: list[str], blocks: Mapping[str, Sequence[int]], computed: Mapping[str, int]) -> None:
        self._engine_thread = threading.get_ident()
        self.input_batch.set_step(order, blocks, computed)

    def _note_thread(self) -> None:
        if threading.get_ident() != self._engine_thread:
            self.off_thread_calls += 1

    def batch_req_ids(self) -> list[str]:
        self._note_thread()
        return self._inner.batch_req_ids()

    def step_slots_cpu(self, req_ids: Sequence[str], num_scheduled: Mapping[str, int]) -> torch.Tensor:
        self._note_thread()
        return self._inner.step_slots_cpu(req_ids, num_scheduled)

    def token_range(self, req_id: str, num_scheduled: int) -> tuple[int, int]:
        self._note_thread()
        return self._inner.token_range(req_id, num_scheduled)
