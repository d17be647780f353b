"""``FullAttentionGroupView.step_slots_cpu`` / ``slots_for`` against the
definition, position by position: ``table[row, pos // bs] * bs + pos % bs``
for the scheduled positions of each request, positions past the table's
last column dropped. Tables as vLLM holds them (an int32 CPU tensor, the
computed counts a numpy array) and as tensors; power-of-two and other block
sizes; decode (one token each), one request, and mixed prefill steps."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from omni_prefix_cache.group_view import FullAttentionGroupView


def batch(rng: random.Random, bs: int, numpy_counts: bool) -> tuple[Any, list[str], list[list[int]], list[int]]:
    n = rng.randint(1, 9)
    width = rng.randint(1, 6)
    ids = [f"r{i}" for i in range(n)]
    table = [[rng.randrange(1000) for _ in range(width)] for _ in range(n)]
    computed = [rng.randrange(width * bs + 1) for _ in range(n)]
    group = SimpleNamespace(block_table=SimpleNamespace(cpu=torch.tensor(table, dtype=torch.int32)))
    counts_cpu: Any = np.array(computed, dtype=np.int32) if numpy_counts else torch.tensor(computed, dtype=torch.int32)
    ib = SimpleNamespace(
        req_ids=list(ids),
        req_id_to_index={r: i for i, r in enumerate(ids)},
        num_computed_tokens_cpu=counts_cpu,
        block_table=_Tables(group),
    )
    return ib, ids, table, computed


class _Tables:
    """vLLM's ``input_batch.block_table``: ``block_tables`` and ``[0]``."""

    def __init__(self, group: Any) -> None:
        self.block_tables = [group]

    def __getitem__(self, i: int) -> Any:
        return self.block_tables[i]


def expected(table: list[list[int]], row: int, start: int, n: int, bs: int) -> list[int]:
    out = []
    for pos in range(start, start + n):
        if pos // bs < len(table[row]):
            out.append(table[row][pos // bs] * bs + pos % bs)
    return out


@pytest.mark.parametrize("bs", [16, 4, 1, 12, 3])
@pytest.mark.parametrize("seed", range(25))
def test_step_slots_follow_the_block_table(bs: int, seed: int) -> None:
    rng = random.Random(seed * 100 + bs)
    ib, ids, table, computed = batch(rng, bs, numpy_counts=seed % 2 == 0)
    view = FullAttentionGroupView(ib, bs)
    shape = rng.choice(["decode", "one", "mixed"])
    order = rng.sample(ids, len(ids))
    if shape == "one":
        order = order[:1]
    sched = {r: (1 if shape == "decode" else rng.randint(0, 2 * bs + 1)) for r in order}
    want: list[int] = []
    for r in order:
        i = ib.req_id_to_index[r]
        want += expected(table, i, computed[i], sched[r], bs)
    got = view.step_slots_cpu(order, sched)
    assert got.dtype == torch.int64 and got.tolist() == want
    r = order[0]
    i = ib.req_id_to_index[r]
    lo = rng.randrange(len(table[i]) * bs + 2)
    hi = lo + rng.randint(0, 2 * bs)
    assert view.slots_for(r, lo, hi).tolist() == expected(table, i, lo, hi - lo, bs)
