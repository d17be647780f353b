"""Deterministic token-prefix hashes and the rows a fake forward derives from them.

Every output row of the simulated model at position ``p`` is a pure function of
the token ids ``0..p`` of that request (through a rolling 64-bit hash). Two
requests sharing a prefix therefore produce identical rows for it, which is
exactly what a prefix cache relies on, and an oracle can recompute the row any
position must have without keeping a copy of what was saved.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(x: int) -> int:
    """splitmix64 finaliser: a well-spread 64-bit hash of ``x`` (unsigned)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def to_signed64(x: int) -> int:
    """Reinterpret an unsigned 64-bit value as int64 (for torch storage)."""
    return x - (1 << 64) if x >= (1 << 63) else x


def chain_hash(parent: int, tokens: Iterable[int]) -> int:
    """Hash of ``tokens`` appended after a sequence whose hash is ``parent``."""
    h = parent
    for t in tokens:
        h = mix64(h ^ (t * 0x100000001B3 & _MASK64))
    return h


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """vLLM-style full-block hash: a function of the parent block's hash and this block's tokens."""
    return mix64(chain_hash(0x5EED if parent is None else parent, tokens) ^ len(tokens))


class PrefixHashes:
    """Growable int64 tensor: entry ``p`` is the hash of tokens ``0..p``."""

    def __init__(self, capacity: int = 64) -> None:
        self._buf = torch.empty(max(8, capacity), dtype=torch.int64)
        self._n = 0
        self._last = 0x0DDBA11

    def __len__(self) -> int:
        return self._n

    def extend(self, tokens: Iterable[int]) -> None:
        """Append the prefix hashes of ``tokens`` (in order)."""
        vals: list[int] = []
        h = self._last
        for t in tokens:
            h = mix64(h ^ (t * 0x100000001B3 & _MASK64))
            vals.append(to_signed64(h))
        if not vals:
            return
        need = self._n + len(vals)
        if need > self._buf.numel():
            grown = torch.empty(max(need, 2 * self._buf.numel()), dtype=torch.int64)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : need] = torch.tensor(vals, dtype=torch.int64)
        self._n = need
        self._last = h

    def chained(self, tokens: Iterable[int]) -> torch.Tensor:
        """The prefix hashes ``tokens`` would get if appended now, without
        appending them (a speculative draft's positions)."""
        vals: list[int] = []
        h = self._last
        for t in tokens:
            h = mix64(h ^ (t * 0x100000001B3 & _MASK64))
            vals.append(to_signed64(h))
        return torch.tensor(vals, dtype=torch.int64)

    def span(self, start: int, end: int) -> torch.Tensor:
        """Hashes of positions ``[start, end)`` (a view; do not mutate)."""
        if not 0 <= start <= end <= self._n:
            raise IndexError(f"prefix span [{start}, {end}) outside 0..{self._n}")
        return self._buf[start:end]


@functools.cache
def key_salt(key: str) -> int:
    """A stable per-tensor-name salt so hidden and each mm key get different rows."""
    return to_signed64(chain_hash(0xC0FFEE, key.encode()))


def rows_from_hashes(hashes: torch.Tensor, key: str, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``(len(hashes), width)`` rows of ``dtype``; row ``i`` depends only on ``hashes[i]`` and ``key``.

    Values are ``k / 2**bits - 0.5`` with ``bits`` small enough that the dtype
    holds them exactly (16 for float32 and wider, 8 for 16-bit floats), so a
    comparison is exact and no two dtypes disagree on rounding.
    """
    bits = 8 if dtype in (torch.bfloat16, torch.float16) else 16
    cols = torch.arange(width, dtype=torch.int64) * 0x2545F4914F6CDD1D + key_salt(key)
    x = hashes.reshape(-1, 1) * 0x27BB2EE687B0B0FD + cols.reshape(1, -1)
    x = x ^ (x >> 29)
    x = x * 0x6A09E667F3BCC909
    vals = (x >> 37) & ((1 << bits) - 1)
    return (vals.to(torch.float64) / float(1 << bits) - 0.5).to(dtype)
