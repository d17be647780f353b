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
"""

from __future__ import annotations

import logging
import mmap

import torch

from omni_prefix_cache.device import sync
from omni_prefix_cache.device.index_tensors import out_of_range
from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError, PrefixCacheConfig, TensorName

logger = logging.getLogger(__name__)


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
            self._check_range(key, index)
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
        Raises before writing anything on an unknown key, a shape or dtype
        mismatch, or an out-of-range slot.
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
        self._check_range(key, index)
        slab.index_copy_(0, index, host.to("cpu", non_blocking=False))

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
        if slots.dtype != torch.int64 or slots.device.type != "cpu":
            slots = slots.to("cpu", torch.int64)
        return slots

    def _check_range(self, key: TensorName, index: torch.Tensor) -> None:
        if index.numel() == 0:
            return
        if not out_of_range(index.numpy(), self._num_slots):  # a CPU int64 index (``_index``)
            return
        bad = index[(index < 0) | (index >= self._num_slots)]
        shown = bad[:8].tolist()
        more = "" if bad.numel() <= 8 else f" (+{bad.numel() - 8} more)"
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
