"""The CPU block pool: every cached row, addressed by KV slot id.

One ``(num_blocks * block_size, width)`` slab per tensor name (the hidden
key or an mm key). A slab is opened on first use and never dropped: vLLM
reusing a KV block *is* the eviction, the new tenant's rows simply overwrite
the old ones. The committer thread is the only writer; any thread may gather
rows (a gather returns a copy, never a view into the slab).

Slabs are plain (pageable) host memory: no device copy ever reads or writes
them, so pinning would only lock host memory (and torch's pinned allocator
rounds each block up to a power of two). A slab is an anonymous mapping: the
OS maps zero pages on first touch, so opening one costs neither a zeroing
pass on the engine thread nor resident memory before the committer writes.

Lazy is not free, though: the kernel charges a private writable mapping's
whole size against its commit accounting when it is made, so a pool the
host cannot hold fails at the first save that opens its slabs. The first
save that fixes a key's width checks first (``check_fits``, from the save's
validation, before it changes anything) and refuses with the invalid-argument
error naming the bytes, the host's limit and the knobs. What the limit is
depends on ``/proc/sys/vm/overcommit_memory`` (``host_commit_limit``):

    0 (heuristic, the default)  the kernel refuses one mapping larger than
        RAM + swap (MemTotal + SwapTotal) and grants any smaller one. The
        check holds the whole pool to that bound: a pool above it could
        never be resident, so it would fail at its mmap or, split over
        keys, be OOM-killed as it fills.
    1 (always)  the kernel grants every mapping; nothing is checked. The
        operator chose overcommit: a pool larger than memory is OOM-killed
        when it really fills, not refused here.
    2 (strict)  the kernel refuses a mapping once Committed_AS plus its size
        exceeds CommitLimit (swap + overcommit_ratio% of RAM). The check
        holds the slabs about to open to CommitLimit - Committed_AS (the
        slabs already open are in Committed_AS).

A container's cgroup memory limit is not in ``/proc/meminfo``; it is not
checked (it kills on fill, not at mapping time). Where ``/proc`` cannot be
read (not Linux), nothing is checked. ``MAP_NORESERVE`` is deliberately not
offered: it only defers the failure from a clear error at the first save to
a SIGSEGV or an OOM kill deep inside a later pool write.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omni_prefix_cache.device import sync
from omni_prefix_cache.device.index_tensors import out_of_range
from omni_prefix_cache.device.row_scatter import SlabScatter
from omni_prefix_cache.interface import (
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    TensorName,
)
from omni_prefix_cache.telemetry.registry import TELEMETRY

logger = logging.getLogger(__name__)

# Where host_commit_limit reads the kernel's accounting (a module attribute
# so another root can stand in for it).
PROC_ROOT = Path("/proc")


@dataclass(frozen=True)
class HostCommitLimit:
    """How many more bytes of private anonymous mappings the kernel grants
    a pool (see the module docstring), and how that was worked out."""

    overcommit_memory: int
    bytes: int | None  # None: the kernel grants any mapping (mode 1)
    whole_pool: bool  # True: the bound is on every slab together (mode 0); False: on the new ones (mode 2)
    explained: str


def _meminfo_bytes(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def host_commit_limit(root: Path | None = None) -> HostCommitLimit | None:
    """The kernel's limit on a new pool's slabs, from ``overcommit_memory``
    and ``/proc/meminfo`` under ``root`` (default ``PROC_ROOT``). None when
    they cannot be read or the mode is unknown: nothing to check against."""
    proc = PROC_ROOT if root is None else root
    try:
        mode = int((proc / "sys/vm/overcommit_memory").read_text().strip())
        info = _meminfo_bytes((proc / "meminfo").read_text())
    except (OSError, ValueError):
        return None
    if mode == 1:
        return HostCommitLimit(1, None, False, "overcommit_memory=1: the kernel grants every mapping")
    if mode == 0 and "MemTotal" in info:
        ram, swap = info["MemTotal"], info.get("SwapTotal", 0)
        return HostCommitLimit(
            0,
            ram + swap,
            True,
            f"overcommit_memory=0: a mapping may not exceed RAM + swap = MemTotal {_size(ram)} "
            f"+ SwapTotal {_size(swap)}, and a pool above it can never be resident",
        )
    if mode == 2 and "CommitLimit" in info and "Committed_AS" in info:
        limit, committed = info["CommitLimit"], info["Committed_AS"]
        return HostCommitLimit(
            2,
            max(0, limit - committed),
            False,
            f"overcommit_memory=2: CommitLimit {_size(limit)} - Committed_AS {_size(committed)}",
        )
    return None


def _size(nbytes: int) -> str:
    return f"{nbytes:,} bytes ({nbytes / 2**30:.1f} GiB)"


def _log_opened(key: TensorName, slab: torch.Tensor) -> None:
    # Once per key and pool: the slab is the pool's whole memory for that key.
    logger.info(
        "omni prefix cache: opened CPU pool slab for key %r: %d slots x %d %s = %.1f MiB%s",
        key,
        int(slab.shape[0]),
        int(slab.shape[1]),
        str(slab.dtype).removeprefix("torch."),
        slab.numel() * slab.element_size() / 2**20,
        ", pinned" if slab.is_pinned() else "",
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def zeroed_host(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, unpinned, page-aligned ``(rows, width)`` host tensor whose
    pages the OS maps lazily (an anonymous private mapping; the tensor keeps
    the mapping alive and it is unmapped with the last view)."""
    nbytes = int(rows) * int(width) * torch.empty((), dtype=dtype).element_size()
    raw = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(int(rows), int(width))


class PrefixBlockPool:
    """Per-key CPU slabs indexed by ``slot = block_id * block_size + offset``."""

    def __init__(self, config: PrefixCacheConfig) -> None:
        self._config = config
        self._num_slots = int(config.num_blocks) * int(config.block_size)
        self._slabs: dict[TensorName, torch.Tensor] = {}
        # Each slab's integer views for ``write`` (None: copied with torch), set when it is published.
        self._scatters: dict[TensorName, SlabScatter | None] = {}
        # Serialises slab creation only; reads and the single writer never take it.
        self._open_lock = sync.Lock()

    @property
    def num_slots(self) -> int:
        """Rows per slab: ``num_blocks * block_size``."""
        return self._num_slots

    def new_slab(self, dtype: torch.dtype, width: int) -> torch.Tensor:
        """A zeroed, unpinned slab shaped for this pool, not yet published
        (publish it with :meth:`install_key`). Cheap: its pages are mapped
        on first write, by the committer."""
        if int(width) <= 0:
            raise OmniPrefixCacheUnmatchError(f"prefix block pool: slab width must be positive, got {width}")
        return zeroed_host(self._num_slots, int(width), dtype)

    def check_fits(self, layouts: Mapping[TensorName, tuple[torch.dtype, int]], *, what: str = "") -> None:
        """Refuse to open slabs for ``layouts`` (key -> dtype, width; keys
        that already have a slab are skipped) the host cannot hold (see the
        module docstring). Any thread; reads ``/proc``. Raises the
        invalid-argument error, prefixed by ``what`` (the call), naming the
        bytes needed, the host's limit and the knobs."""
        new = {key: layout for key, layout in layouts.items() if key not in self._slabs}
        if not new:
            return
        limit = host_commit_limit()
        if limit is None or limit.bytes is None:
            return
        needed = {key: self._num_slots * int(width) * _itemsize(dtype) for key, (dtype, width) in new.items()}
        asked = sum(needed.values()) + (self.host_bytes() if limit.whole_pool else 0)
        if asked <= limit.bytes:
            return
        config = self._config
        per_key = ", ".join(
            f"{key!r}: width {int(width)} x {str(dtype).removeprefix('torch.')} = {_size(needed[key])}"
            for key, (dtype, width) in new.items()
        )
        opened = f"; the slabs already open hold {_size(self.host_bytes())}" if self._slabs and limit.whole_pool else ""
        prefix = f"{what}: " if what else ""
        raise OmniPrefixCacheInvalidArgumentError(
            f"{prefix}prefix block pool: num_blocks {config.num_blocks} x block_size {config.block_size} = "
            f"{self._num_slots} slots per key needs {_size(sum(needed.values()))} of host memory for "
            f"{per_key}{opened}; the host allows {_size(limit.bytes)} ({limit.explained}). "
            "Lower num_blocks, cache the key in a smaller dtype, or give the host more memory or swap"
        )

    def ensure_key(self, key: TensorName, dtype: torch.dtype, width: int) -> torch.Tensor:
        """The slab for ``key``, allocated (zeroed) if missing.

        Raises if ``key`` already has a slab of another dtype or width.
        """
        slab = self._slabs.get(key)
        if slab is None:
            with self._open_lock:
                slab = self._slabs.get(key)
                if slab is None:
                    slab = self.new_slab(dtype, width)
                    self._scatters[key] = SlabScatter.of(slab, int(self._config.block_size))
                    self._slabs[key] = slab
                    _log_opened(key, slab)
                    return slab
        self._check_layout(key, slab, dtype, int(width))
        return slab

    def install_key(self, key: TensorName, storage: torch.Tensor) -> None:
        """Publish ``storage`` (allocated elsewhere) as the slab for ``key``.

        ``storage`` must be a 2-D CPU tensor with ``num_slots`` rows. Raises
        if ``key`` already has a different slab: a slab is never replaced, or
        rows already written to it would be lost.
        """
        if storage.ndim != 2 or int(storage.shape[0]) != self._num_slots:
            raise OmniPrefixCacheUnmatchError(
                f"prefix block pool: slab for key {key!r} must be ({self._num_slots}, width), "
                f"got {tuple(storage.shape)}"
            )
        if storage.device.type != "cpu":
            raise OmniPrefixCacheUnmatchError(
                f"prefix block pool: slab for key {key!r} must live on the CPU, got {storage.device}"
            )
        with self._open_lock:
            current = self._slabs.get(key)
            if current is not None and current is not storage:
                raise OmniPrefixCacheUnmatchError(f"prefix block pool: key {key!r} already has a slab; never replaced")
            if current is None:
                self._scatters[key] = SlabScatter.of(storage, int(self._config.block_size))
            self._slabs[key] = storage
        if current is None:
            _log_opened(key, storage)

    def host_bytes(self) -> int:
        """Host bytes the slabs reserve (virtual; pages fill as rows land).
        None of it is pinned."""
        return sum(self.key_nbytes().values())

    def has_key(self, key: TensorName) -> bool:
        """True once ``key`` has a slab."""
        return key in self._slabs

    def keys(self) -> list[TensorName]:
        """Every key with a slab, in opening order."""
        return list(self._slabs)

    def key_nbytes(self) -> dict[TensorName, int]:
        """Bytes of each key's slab, in opening order."""
        return {key: slab.numel() * slab.element_size() for key, slab in list(self._slabs.items())}

    def rows(self, key: TensorName, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of ``key``'s rows at ``slots`` (1-D integer tensor), in order:
        gathered into ``out`` (``(len(slots), width)``, the slab's dtype) and
        returned as it when given, so a caller with a buffer pays one copy.

        Raises naming the key if it has no slab, and naming the slots that
        fall outside ``[0, num_slots)``.
        """
        slab = self._slab(key)
        index = self._index(key, slots)
        if out is not None and (
            tuple(out.shape) != (int(index.numel()), int(slab.shape[1])) or out.dtype != slab.dtype
        ):
            raise OmniPrefixCacheUnmatchError(
                f"prefix block pool: reading {int(index.numel())} rows of key {key!r} ({slab.dtype}, width "
                f"{int(slab.shape[1])}) into a {out.dtype} buffer of shape {tuple(out.shape)}"
            )
        try:
            if out is not None:
                return torch.index_select(slab, 0, index, out=out)
            return slab.index_select(0, index)
        except (IndexError, RuntimeError) as exc:
            self._check_range(key, index.numpy())
            raise OmniPrefixCacheUnmatchError(f"prefix block pool: reading key {key!r} failed: {exc}") from exc

    def baseline(self, key: TensorName, n: int) -> torch.Tensor:
        """``n`` rows of what a slot holds for ``key`` when its tenant never
        wrote it: zeros, as in a fresh slab. Not read from the slab, which
        may still hold a previous tenant's rows."""
        slab = self._slab(key)
        return torch.zeros((int(n), int(slab.shape[1])), dtype=slab.dtype)

    def write(self, key: TensorName, slots: torch.Tensor, host: torch.Tensor) -> None:
        """Overwrite ``key``'s rows at ``slots`` with ``host`` (committer only).

        ``host`` must hold one row per slot in the slab's dtype and width. A
        slot listed twice takes one of its rows (callers coalesce first).
        Rows that fill a block whole are copied as whole blocks, the rest
        row by row (``device.row_scatter``). Raises before writing anything
        on an unknown key, a shape or dtype mismatch, or an out-of-range slot.
        """
        slab = self._slab(key)
        index = self._index(key, slots)
        n = int(index.numel())
        if host.ndim != 2 or int(host.shape[0]) != n or int(host.shape[1]) != int(slab.shape[1]):
            raise OmniPrefixCacheUnmatchError(
                f"prefix block pool: write to key {key!r} has rows {tuple(host.shape)} for {n} slots "
                f"of width {int(slab.shape[1])}"
            )
        if host.dtype != slab.dtype:
            raise OmniPrefixCacheUnmatchError(
                f"prefix block pool: write to key {key!r} has dtype {host.dtype}, slab holds {slab.dtype}"
            )
        if n == 0:
            return
        rows = index.numpy()  # a CPU int64 index (``_index``)
        self._check_range(key, rows)
        if not host.is_cpu:
            host = host.to("cpu", non_blocking=False)
        dp = TELEMETRY.datapath
        if dp is None:
            self._copy(key, slab, index, rows, host)
            return
        start = TELEMETRY.cpu_clock()
        self._copy(key, slab, index, rows, host)
        dp.pool_written(threading.current_thread().name, int(host.nbytes), start, TELEMETRY.cpu_clock())

    def _copy(
        self, key: TensorName, slab: torch.Tensor, index: torch.Tensor, rows: np.ndarray, host: torch.Tensor
    ) -> None:
        # Through the slab's integer views when both sides have one; else torch's row copy.
        view = self._scatters.get(key)
        source = None if view is None else view.source(host)
        if view is None or source is None:
            slab.index_copy_(0, index, host)
            return
        view.scatter(rows, source)

    def _slab(self, key: TensorName) -> torch.Tensor:
        slab = self._slabs.get(key)
        if slab is None:
            raise OmniPrefixCacheUnmatchError(
                f"prefix block pool: unknown key {key!r} (open keys: {sorted(self._slabs)})"
            )
        return slab

    @staticmethod
    def _index(key: TensorName, slots: torch.Tensor) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor):
            slots = torch.as_tensor(slots, dtype=torch.int64)
        if slots.ndim != 1 or slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise OmniPrefixCacheUnmatchError(
                f"prefix block pool: slots for key {key!r} must be a 1-D integer tensor, "
                f"got {slots.dtype} {tuple(slots.shape)}"
            )
        if slots.dtype != torch.int64 or not slots.is_cpu:
            slots = slots.to("cpu", torch.int64)
        return slots

    def _check_range(self, key: TensorName, rows: np.ndarray) -> None:
        if not out_of_range(rows, self._num_slots):  # a view of the CPU int64 index (``_index``)
            return
        bad = rows[(rows < 0) | (rows >= self._num_slots)]
        shown = bad[:8].tolist()
        more = "" if bad.size <= 8 else f" (+{bad.size - 8} more)"
        raise OmniPrefixCacheUnmatchError(
            f"prefix block pool: slots {shown}{more} for key {key!r} are outside [0, {self._num_slots})"
        )

    @staticmethod
    def _check_layout(key: TensorName, slab: torch.Tensor, dtype: torch.dtype, width: int) -> None:
        if slab.dtype != dtype or int(slab.shape[1]) != width:
            raise OmniPrefixCacheUnmatchError(
                f"prefix block pool: key {key!r} holds {slab.dtype} rows of width {int(slab.shape[1])}, "
                f"asked for {dtype} of width {width}"
            )
