"""Rows on their way to the pool: the copy stage (spec effect
``copy_to_host``) and reads of a task's rows before its pool write."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from omni_prefix_cache.device.copy_engine import CopyEngine
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, PrefixCacheConfig, TensorName, WriteSchedule
from omni_prefix_cache.specs.batch import Batch, guarded_each
from omni_prefix_cache.telemetry.registry import TELEMETRY
from omni_prefix_cache.writes.chunks import HostRow, WriteChunk
from omni_prefix_cache.writes.write_task import WriteTask

# A planned read's (chunk index, row) per slot, fixed at planning (None: the latest chunk).
Pinned = Sequence[tuple[int, int]] | None


class CopyStage(Protocol):
    """What effect ``copy_to_host`` calls: ``HostRows``, or a stage wrapping
    it (a harness's fault-injecting or probing fake)."""

    def copy_task(self, task: WriteTask) -> None:
        """Effect ``copy_to_host`` for one task: set ``task.copied_rows``."""
        ...

    def copy_batch(self, batch: Batch) -> None:
        """Effect ``copy_to_host`` for a batch; an item that raises leaves it."""
        ...


class HostRows:
    """Copies a task's rows to host memory and reads rows of unwritten tasks
    through ``engine`` (its lanes on CUDA, host copies on CPU)."""

    def __init__(self, engine: CopyEngine, config: PrefixCacheConfig):
        self.engine = engine
        self._piece_bytes = config.copy_chunk_bytes

    def copy_task(self, task: WriteTask) -> None:
        """Effect ``copy_to_host``: the rows the task's host_ready move installs."""
        task.copied_rows = self.copy(task)

    def copy_batch(self, batch: Batch) -> None:
        """Effect ``copy_to_host`` for a batch: ``copy_task`` per task, an
        item that raises leaving the batch. A batch of staging views makes
        no rows (they were copied at save): nothing is called for it."""
        if self.copies_nothing(batch.items):
            return
        guarded_each(batch, self.copy_task)

    @staticmethod
    def copies_nothing(tasks: list[WriteTask]) -> bool:
        """True if ``copy`` makes no rows for any of ``tasks`` (all are
        staging views: their rows were copied at save)."""
        for task in tasks:
            if task.schedule is not WriteSchedule.JOIN_NEXT_STEP:
                return False
        return True

    def copy(self, task: WriteTask) -> list[HostRow]:
        """The copy stage: the host rows the task's host_ready move installs.

        JOIN_NEXT_STEP: host rows are staging views copied at save; nothing
        to copy (the host_ready move waits that copy's event). JOIN_ON_FINISH: one
        owned host tensor per key; each chunk's clone is copied (in
        ``copy_chunk_bytes`` pieces) straight into its own slice. No
        device-side concatenation: nothing is allocated on the copy lane.
        """
        if self.copies_nothing([task]):
            return []
        by_key: dict[TensorName, list[WriteChunk]] = {}
        for chunk in task.chunks:
            for key in chunk.tensors:
                by_key.setdefault(key, []).append(chunk)
        piece_bytes = self._piece_bytes
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        rows_out: list[HostRow] = []
        for key, chunks in by_key.items():
            srcs = [c.tensors[key] for c in chunks]
            total = sum(int(src.shape[0]) for src in srcs)
            host = self.engine.host_empty((total, *srcs[0].shape[1:]), srcs[0].dtype)
            # One key's chunks share a row shape and dtype: one row size for all.
            row_bytes = max(1, math.prod(host.shape[1:]) * host.element_size())
            whole_rows = max(1, piece_bytes // row_bytes)  # the most rows one copy may take
            offset = 0
            for chunk, src in zip(chunks, srcs):
                rows = int(src.shape[0])
                dst = host[offset : offset + rows]
                if 0 < rows <= whole_rows:  # the usual chunk (decode's single row): one copy, no cuts
                    copies.append((dst, src))
                elif rows:
                    for s in range(0, rows, whole_rows):
                        copies.append((dst[s : s + whole_rows], src[s : s + whole_rows]))
                rows_out.append((chunk, key, dst))
                offset += rows
        dp = TELEMETRY.datapath
        start = TELEMETRY.cpu_clock() if dp is not None else 0
        event = self.engine.launch(task.freeze_event, copies)
        if event is not None:
            event.synchronize()
        if dp is not None:
            # On CUDA the lane's events time the copy (device_copy_seconds).
            dp.copied("deferred", sum(dst.nbytes for dst, _ in copies), start, TELEMETRY.cpu_clock())
        return rows_out

    @torch.inference_mode()
    def fetch(
        self,
        task: WriteTask,
        slots: torch.Tensor,
        key: TensorName,
        pinned: Pinned = None,
    ) -> torch.Tensor:
        """Rows of ``slots`` for ``key`` from a task not yet in the pool:
        its host rows once copied, else its device clone (read on the read
        lane). Waits the staging event first. Caller order is preserved.
        ``pinned`` (a planned read's, per slot): the (chunk, row) to read,
        fixed when the read was planned; else the latest chunk holding the
        slot. Raises OmniPrefixCacheUnmatchError naming the task, key and
        slot when the task holds no row for a slot."""
        if task.step_d2h_event is not None:
            task.step_d2h_event.synchronize()
        s2r = task.slot_to_row()
        per_chunk: dict[int, tuple[list[int], list[int]]] = {}
        for pos, slot in enumerate(slots.tolist()):
            where = s2r.get(slot) if pinned is None or pinned[pos][0] < 0 else pinned[pos]
            if where is None:
                raise OmniPrefixCacheUnmatchError(
                    f"task {task.tid} ({task.describe_requests()}) has no row for slot {slot}"
                )
            positions, rows = per_chunk.setdefault(where[0], ([], []))
            positions.append(pos)
            rows.append(where[1])
        out: torch.Tensor | None = None
        for si, (positions, rows) in per_chunk.items():
            src = task.get_host_tensor(si, key)
            if src is None:
                raise OmniPrefixCacheUnmatchError(
                    f"task {task.tid} ({task.describe_requests()}) has no {key!r} rows for slots {slots.tolist()}"
                )
            picked = self._pick_rows(task, src, rows)
            if len(per_chunk) == 1:
                return picked
            if out is None:
                out = torch.empty((slots.numel(), *picked.shape[1:]), dtype=picked.dtype)
            out.index_copy_(0, torch.tensor(positions, dtype=torch.int64), picked)
        if out is None:
            raise OmniPrefixCacheUnmatchError(f"task {task.tid}: no slots requested for {key!r}")
        return out

    def _pick_rows(self, task: WriteTask, src: torch.Tensor, rows: list[int]) -> torch.Tensor:
        first, n = rows[0], len(rows)
        if not self.engine.is_device(src):
            if rows[-1] - first == n - 1 and all(b - a == 1 for a, b in zip(rows, rows[1:])):
                return src[first : first + n]
            return src.index_select(0, torch.tensor(rows, dtype=torch.int64))
        # A device clone: each run of consecutive rows is copied straight
        # into its slice of one host tensor on the read lane. No index
        # tensor and no gathered temporary is allocated on the device (it
        # would sit outside gpu_staging_bytes and vLLM's memory profile).
        out = self.engine.host_empty((n, *src.shape[1:]), src.dtype)
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        start = 0
        for i in range(1, n + 1):
            if i == n or rows[i] != rows[i - 1] + 1:
                copies.append((out[start:i], src[rows[start] : rows[i - 1] + 1]))
                start = i
        self.engine.read(task.freeze_event, copies)
        return out
