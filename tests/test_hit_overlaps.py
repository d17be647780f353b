"""The same-step hit check: which hits' slots this step maps, found with a
few array ops over a table of the pool's slots (``HitPlanner.overlaps``, ``SlotMarks``)."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from omni_prefix_cache.device.index_tensors import SlotMarks
from omni_prefix_cache.reads.hit_planner import HitPlanner


def planner(num_slots: int) -> Any:
    hp: Any = HitPlanner.__new__(HitPlanner)  # overlaps reads only the occupancy's size
    hp._marks = SlotMarks()
    hp._occupancy = SimpleNamespace(num_slots=num_slots)
    return hp


@pytest.mark.parametrize("seed", range(4))
def test_overlaps_matches_set_intersection_and_leaves_the_table_clear(seed: int) -> None:
    rng = random.Random(seed)
    hp = planner(64)
    for _ in range(100):
        step = torch.tensor([rng.randrange(64) for _ in range(rng.randint(1, 12))])
        groups = [torch.tensor([rng.randrange(64) for _ in range(rng.randint(1, 8))]) for _ in range(rng.randint(1, 5))]
        want = [not set(step.tolist()).isdisjoint(g.tolist()) for g in groups]
        assert hp.overlaps(step, groups) == want
        assert not bool(hp._marks._marks.any())


def test_a_failed_lookup_still_clears_the_table() -> None:
    hp = planner(8)
    with pytest.raises(IndexError):
        hp.overlaps(torch.tensor([1, 2]), [torch.tensor([3]), torch.tensor([99])])
    assert not bool(hp._marks._marks.any())
    assert hp.overlaps(torch.tensor([3]), [torch.tensor([3])]) == [True]


def test_empty_groups_share_nothing() -> None:
    marks = SlotMarks()
    groups = [torch.tensor([], dtype=torch.int64), torch.tensor([2]), torch.tensor([], dtype=torch.int64)]
    assert marks.overlaps(8, torch.tensor([2, 5]), groups) == [False, True, False]
    assert marks.overlaps(8, torch.tensor([2]), []) == []


@pytest.mark.parametrize("seed", range(4))
def test_disjoint_and_numpy_groups_answer_as_tensors_do(seed: int) -> None:
    # Reuse of slots no live read holds (the usual case) has its own early
    # answer; numpy id groups (a planned read's cached ids) mean the same.
    rng = random.Random(seed)
    marks = SlotMarks()
    for _ in range(50):
        step = rng.sample(range(32), rng.randint(1, 8))
        others = [s for s in range(64) if s not in step]
        groups = [rng.sample(others, rng.randint(0, 6)) for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.5:  # sometimes one group shares a slot
            groups[rng.randrange(len(groups))].append(rng.choice(step))
        want = [not set(step).isdisjoint(g) for g in groups]
        as_tensors = [torch.tensor(g, dtype=torch.int64) for g in groups]
        as_numpy = [np.array(g, dtype=np.int64) for g in groups]
        assert marks.overlaps(64, torch.tensor(step), as_tensors) == want
        assert marks.overlaps(64, torch.tensor(step), as_numpy) == want
        assert not bool(marks._marks is not None and marks._marks.any())
