"""Exact checks of every materialized row against the token-prefix row function."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_prefix_cache.interface import HIDDEN_KEY
from omni_prefix_cache.tools.simulate.rows import rows_from_hashes


@dataclass(frozen=True)
class RowExpectation:
    """What one request of one step must get back from materialize.

    Positions ``[start, end)`` of the request; ``hit`` leading rows of them
    (``start == 0`` then) come from the cache, the rest were computed this step.
    ``hashes`` are the prefix hashes of exactly those positions.
    """

    req_id: str
    start: int
    end: int
    hit: int
    hashes: torch.Tensor


@dataclass(frozen=True)
class Mismatch:
    """One (step, request, key) whose rows were not exactly the expected ones."""

    step: int
    step_id: int
    req_id: str
    key: str
    detail: str

    def __str__(self) -> str:
        return f"step {self.step} (id {self.step_id}) req {self.req_id} key {self.key}: {self.detail}"


@dataclass
class Oracle:
    """Recomputes the expected rows of each materialized step and compares exactly."""

    widths: dict[str, int]  # key -> row width (HIDDEN_KEY included when hidden is cached)
    dtype: torch.dtype
    expect_no_hidden: bool = False  # the policy opts out of hidden: hidden_states must be None
    max_details: int = 20
    mismatches: int = 0
    checked_rows: int = 0
    details: list[Mismatch] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def expected(self, exps: list[RowExpectation]) -> dict[str, list[torch.Tensor]]:
        """Expected rows per key, one tensor per expectation (in order)."""
        if not exps:
            return {k: [] for k in self.widths}
        allh = torch.cat([e.hashes for e in exps])
        sizes = [e.end - e.start for e in exps]
        return {k: list(torch.split(rows_from_hashes(allh, k, w, self.dtype), sizes)) for k, w in self.widths.items()}

    def check(
        self,
        step: int,
        step_id: int,
        exps: list[RowExpectation],
        outs: Any,
        leftover: dict[str, Any] | None = None,
    ) -> int:
        """Compare ``outs`` (a StageCacheOutputs) with ``exps``; return the mismatches found.

        ``leftover`` maps a non-token-major mm key to the payload every
        request of the step must get back (a list passes through whole).
        """
        want = self.expected(exps)
        found: list[Mismatch] = []
        rows = 0
        if self.expect_no_hidden and outs.hidden_states is not None:
            found.append(Mismatch(step, step_id, "*", HIDDEN_KEY, "hidden_states returned under a hidden opt-out"))
        for key in self.widths:
            if key == HIDDEN_KEY:
                table = outs.hidden_states
                if table is None:
                    found.append(Mismatch(step, step_id, "*", key, "hidden_states is None"))
                    continue
            else:
                table = outs.mm_outputs.get(key)
                if table is None:
                    found.append(Mismatch(step, step_id, "*", key, "key missing from mm_outputs"))
                    continue
            for exp, ref in zip(exps, want[key]):
                got = table.get(exp.req_id)
                problem = _compare(exp, ref, got)
                rows += ref.shape[0]
                if problem is not None:
                    found.append(Mismatch(step, step_id, exp.req_id, key, problem))
        for key, want_payload in (leftover or {}).items():
            table = outs.mm_outputs.get(key)
            for exp in exps:
                got = None if table is None else table.get(exp.req_id)
                if not same_payload(got, want_payload):
                    detail = f"leftover {got!r}, expected {want_payload!r}"
                    found.append(Mismatch(step, step_id, exp.req_id, key, detail))
        with self._lock:
            self.checked_rows += rows
            self.mismatches += len(found)
            room = self.max_details - len(self.details)
            if room > 0:
                self.details.extend(found[:room])
        return len(found)


def _compare(exp: RowExpectation, ref: torch.Tensor, got: Any) -> str | None:
    span = f"positions [{exp.start}, {exp.end}) hit={exp.hit}"
    if got is None:
        return f"missing; expected {span}"
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor for {span}, got {type(got).__name__}"
    if got.dtype != ref.dtype:
        return f"dtype {got.dtype}, expected {ref.dtype} for {span}"
    if tuple(got.shape) != tuple(ref.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(ref.shape)} for {span}"
    same = (got == ref).all(dim=1) if got.ndim == 2 else None
    if same is None:
        return None if torch.equal(got, ref) else f"values differ for {span}"
    if bool(same.all()):
        return None
    bad = int((~same).nonzero()[0, 0])
    part = "cached prefix" if bad < exp.hit else "this step's rows"
    return f"first wrong row at position {exp.start + bad} ({part}); {int((~same).sum())} wrong rows of {span}"


def same_payload(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, (list, tuple)):
        return (
            isinstance(got, type(want)) and len(got) == len(want) and all(same_payload(g, w) for g, w in zip(got, want))
        )
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same_payload(got[k], want[k]) for k in want)
    return bool(got == want)
