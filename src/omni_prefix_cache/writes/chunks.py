"""A write's rows: the chunks a WriteTask is made of, and their budget.

``WriteChunk`` is one save's slots and tensors appended onto a write; an
immediate write's chunk is a window of its step's ``StepRows`` (a struct of
arrays), viewed lazily. ``StepRequests`` names the requests a step's write covers (state arrays
in step order). ``BudgetTicket`` is the GPU-byte charge of one
device clone that several chunks view. ``step_runs`` / ``ChunkRuns`` merge
back-to-back windows of one step, so a step is written and settled without
a per-request copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from omni_prefix_cache.interface import ReqId, TensorName, Tid


@dataclass(eq=False)
class BudgetTicket:
    """The GPU-byte charge of one device clone shared by several writes.

    Charged once by ``reserve``; uncharged once, when the last task pinned
    on it releases. Holds no tensors.
    """

    nbytes: int
    tids: set[Tid] = field(default_factory=set)
    freed: bool = False  # uncharged already: it never uncharges again

    def release(self, tid: Tid) -> int:
        """Unpin ``tid``; return the bytes to uncharge: ``nbytes`` exactly
        once (when the last holder leaves), else 0. Idempotent per tid."""
        self.tids.discard(tid)
        if self.tids or self.freed:
            return 0
        self.freed = True
        return self.nbytes


@dataclass(eq=False, slots=True)
class StepRequests:
    """The requests one step's write covers, as state arrays in step order:
    ``req_ids[i]`` owns rows ``[offsets[i], offsets[i + 1])`` of the step's
    ``StepRows``. Nothing on the hot path reads them per request: they are
    for finish/abort escalation (``in``) and for failure messages, which
    name every request, its rows and its slot range."""

    req_ids: tuple[ReqId, ...]
    offsets: tuple[int, ...]  # len(req_ids) + 1 row offsets, offsets[0] == 0
    _members: frozenset[ReqId] | None = None

    @classmethod
    def of(cls, req_ids: Sequence[ReqId], sizes: Sequence[int]) -> StepRequests:
        """``req_ids`` in step order with their row counts."""
        return cls(tuple(req_ids), tuple(itertools.accumulate(sizes, initial=0)))

    def __contains__(self, req_id: object) -> bool:
        members = self._members
        if members is None:
            members = self._members = frozenset(self.req_ids)
        return req_id in members

    def describe(self, slots: torch.Tensor | None) -> str:
        """Every request with its rows and (given the step's ``slots``) its
        slot range, e.g. ``req 'a' rows [0, 4) slots 0..3; req 'b' ...``."""
        listed = None if slots is None else slots.tolist()
        parts: list[str] = []
        for i, rid in enumerate(self.req_ids):
            start, end = self.offsets[i], self.offsets[i + 1]
            text = f"req {rid!r} rows [{start}, {end})"
            if listed is not None and end > start:
                mine = listed[start:end]
                text += f" slots {min(mine)}..{max(mine)}"
            parts.append(text)
        return "; ".join(parts)


@dataclass(eq=False, slots=True)
class StepRows:
    """One save's immediate rows as a struct of arrays: the step's slot
    mapping, its staging views and (device) clones per key, ``n`` rows
    each. Every immediate write of the step views rows ``[start, end)`` of
    it (its ``WriteChunk``), so the step is registered, written to the
    pool and settled without a per-request copy or split, and a pool write
    of a whole step is one ``index_copy_`` per key."""

    slots: torch.Tensor
    host: dict[TensorName, torch.Tensor]
    tensors: dict[TensorName, torch.Tensor]
    _unique: bool | None = None

    def unique_slots(self) -> bool:
        """True if no slot repeats within the step (then its rows may be
        written in one scatter; computed once)."""
        if self._unique is None:
            values = self.slots.tolist()
            self._unique = len(set(values)) == len(values)
        return self._unique


class WriteChunk:
    """One save's slots and tensors appended onto a WriteTask.

    ``slots_cpu``: int64 KV slot ids, in token order; ``tensors``: the
    frozen clone (device, or CPU); ``host``: host rows ``[0:n)``;
    ``budget``: the charge of the clone ``tensors`` views. An immediate
    write's chunk is a window ``[start, end)`` of its step's ``StepRows``
    (``of_step``): its slot, host and clone views are cut only when read.
    """

    __slots__ = ("_slots", "_tensors", "_host", "budget", "step", "start", "end")

    def __init__(
        self,
        slots_cpu: torch.Tensor | None = None,
        tensors: dict[TensorName, torch.Tensor] | None = None,
        host: dict[TensorName, torch.Tensor] | None = None,
        budget: BudgetTicket | None = None,
        rows: int | None = None,
    ) -> None:
        """``rows``: the row count ``slots_cpu`` holds, when the caller
        knows it (a save's deferred chunks: no shape read back per request)."""
        self._slots: torch.Tensor | None = slots_cpu
        self._tensors: dict[TensorName, torch.Tensor] | None = tensors
        self._host: dict[TensorName, torch.Tensor] | None = {} if host is None else host
        self.budget = budget
        self.step: StepRows | None = None
        self.start = 0
        if rows is None:
            rows = 0 if slots_cpu is None else int(slots_cpu.shape[0])
        self.end = rows

    @classmethod
    def of_step(cls, step: StepRows, start: int, end: int) -> WriteChunk:
        """Rows ``[start, end)`` of ``step``, viewed lazily."""
        chunk = cls.__new__(cls)
        chunk._slots = chunk._tensors = chunk._host = None
        chunk.budget = None
        chunk.step, chunk.start, chunk.end = step, start, end
        return chunk

    @property
    def slots_cpu(self) -> torch.Tensor:
        if self._slots is None:
            assert self.step is not None
            self._slots = self.step.slots[self.start : self.end]
        return self._slots

    @slots_cpu.setter
    def slots_cpu(self, value: torch.Tensor) -> None:
        self._slots = value
        self.end = self.start + int(value.shape[0])

    def _window(self, arrays: dict[TensorName, torch.Tensor]) -> dict[TensorName, torch.Tensor]:
        """This chunk's rows of a step's per-key arrays, as views."""
        return {k: v[self.start : self.end] for k, v in arrays.items()}

    @property
    def tensors(self) -> dict[TensorName, torch.Tensor]:
        if self._tensors is None:
            self._tensors = {} if self.step is None else self._window(self.step.tensors)
        return self._tensors

    @tensors.setter
    def tensors(self, value: dict[TensorName, torch.Tensor]) -> None:
        self._tensors = value

    @property
    def host(self) -> dict[TensorName, torch.Tensor]:
        if self._host is None:
            self._host = {} if self.step is None else self._window(self.step.host)
        return self._host

    @host.setter
    def host(self, value: dict[TensorName, torch.Tensor]) -> None:
        self._host = value

    @property
    def rows(self) -> int:
        return self.end - self.start

    def whole_step_view(self) -> bool:
        """True while the chunk is still an untouched window of its step
        (its rows can be written with the step's other windows at once)."""
        return self.step is not None and self._host is None


def step_runs(chunks: Sequence[WriteChunk]) -> list[tuple[StepRows | None, int, int, WriteChunk]]:
    """``chunks`` in order as runs: back-to-back windows of one step merge
    into one ``(step, start, end, first chunk)``; any other chunk is
    ``(None, 0, rows, chunk)``."""
    runs: list[tuple[StepRows | None, int, int, WriteChunk]] = []
    for c in chunks:
        step = c.step
        if step is not None and runs:
            last_step, last_start, last_end, first = runs[-1]
            if last_step is step and last_end == c.start:
                runs[-1] = (step, last_start, c.end, first)
                continue
        runs.append((step, c.start, c.end, c) if step is not None else (None, 0, c.rows, c))
    return runs


class ChunkRuns:
    """The slots of chunks added one by one (in order), with the write
    owning each chunk and its row count, gathered in the caller's own pass
    over the chunks: back-to-back windows of one step are one slice of its
    slot mapping, not a concatenation (as ``step_runs`` merges them)."""

    __slots__ = ("_parts", "_step", "_start", "_end", "owners", "counts")

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._step: StepRows | None = None  # the open run of windows: rows [_start, _end) of _step
        self._start = 0
        self._end = 0
        self.owners: list[Tid] = []
        self.counts: list[int] = []  # rows per chunk

    def add(self, chunk: WriteChunk, owner: Tid) -> None:
        step, start, end = chunk.step, chunk.start, chunk.end
        self.owners.append(owner)
        self.counts.append(end - start)
        if step is not None and step is self._step and start == self._end:
            self._end = end
            return
        self._close_run()
        if step is not None:
            self._step, self._start, self._end = step, start, end
        else:
            self._parts.append(chunk.slots_cpu)

    def _close_run(self) -> None:
        if self._step is not None:
            self._parts.append(self._step.slots[self._start : self._end])
            self._step = None

    def slots(self) -> torch.Tensor:
        """The added chunks' slots in order (at least one chunk added)."""
        self._close_run()
        parts = self._parts
        if len(parts) > 1:
            self._parts = parts = [torch.cat(parts)]
        return parts[0]


# (chunk, key, host rows): one key's rows of one chunk, as a copy stage made them.
HostRow = tuple[WriteChunk, TensorName, torch.Tensor]
