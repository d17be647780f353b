"""Which KV cache group keys the mirrored rows, and which parallel rank mirrors.

Rows are keyed by KV slot ids, ``block * block_size + offset``, of one KV
cache group. That group must hold a block for every position of a request,
for as long as the request runs, so that a prefix hit's blocks are the
blocks whose slots the rows were written to. A full-attention group does. A
sliding-window or chunked-local group frees the blocks before its window (a
hit longer than the window comes with vLLM's null block there), and a Mamba
group keeps one recurrent state per block, not a row per token: neither can
key the rows, but either may run beside a full-attention group, whose blocks
key them (:func:`select_prefix_cache_kv_group`). Other kinds are refused as
not verified (vLLM's runner, for one, leaves encoder-only groups out of the
input batch's block tables, so a table's index would not be its group's).

Every tensor-parallel rank computes the same final hidden states, and the
engine takes the model runner's output from one rank only: the first tensor
rank of the last pipeline stage (vLLM 0.33's ``MultiprocExecutor``
``_get_output_rank``). Only that rank mirrors
(:func:`is_prefix_cache_mirror_rank`); decode and prefill context parallel
stripe a request's tokens across ranks and are refused
(:func:`check_prefix_cache_context_parallel`).

vLLM is never imported: specs are told apart by their class names (vLLM's
own and any subclass), configs are read by attribute with defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omni_prefix_cache.errors import OmniPrefixCacheUnmatchError

FULL_ATTENTION = "full attention"
SLIDING_WINDOW = "sliding window"
CHUNKED_LOCAL = "chunked local attention"
MAMBA = "Mamba"

# vLLM 0.33's spec classes (kv_cache_interface.py) by kind: a spec whose class
# or any base has the name is that kind. MLA, sink and hidden-state specs
# subclass FullAttentionSpec; SlidingWindowMLASpec subclasses SlidingWindowSpec.
_KIND_OF_CLASS = {
    "FullAttentionSpec": FULL_ATTENTION,
    "SlidingWindowSpec": SLIDING_WINDOW,
    "ChunkedLocalAttentionSpec": CHUNKED_LOCAL,
    "MambaSpec": MAMBA,
}
# The kinds a full-attention group may run beside, and why they cannot key the rows.
BESIDE_FULL_ATTENTION = {
    SLIDING_WINDOW: "it frees the blocks before its window (a longer hit carries vLLM's null block there)",
    CHUNKED_LOCAL: "it frees the blocks of chunks before the current one",
    MAMBA: "it keeps one recurrent state per block, not one row per token",
}
ACCEPTED = (
    "a single full-attention KV cache group, or full-attention groups beside sliding-window, "
    "chunked-local or Mamba groups"
)
_NEEDS = f"omni prefix cache needs {ACCEPTED}"


@dataclass(frozen=True)
class PrefixCacheKVGroup:
    """The KV cache group the rows are keyed by: its index in
    ``kv_cache_config.kv_cache_groups``, the group, and its spec's block
    size (None when the group declares no spec)."""

    index: int
    group: Any
    block_size: int | None


def kv_group_kind(group: Any) -> str | None:
    """What ``group``'s ``kv_cache_spec`` is: one of the kind constants,
    the spec's class name for any other spec, None without a spec. A
    ``UniformTypeKVCacheSpecs`` (one kind, several layer shapes) is the kind
    of its layers' specs. A host-resident group, or one with a role other
    than the default (vLLM's HiSparse groups), is never full attention:
    its block ids come from another pool."""
    spec = getattr(group, "kv_cache_spec", None)
    if spec is None:
        return None
    kind = _spec_kind(spec)
    if kind == FULL_ATTENTION:
        role = getattr(group, "role", None)
        role = getattr(role, "value", role)
        if bool(getattr(group, "host_resident", False)) or role not in (None, "default"):
            return f"{type(spec).__name__} (role={role!r}, host_resident={getattr(group, 'host_resident', False)})"
    return kind


def _spec_kind(spec: Any) -> str:
    names = [cls.__name__ for cls in type(spec).__mro__]
    for name in names:
        kind = _KIND_OF_CLASS.get(name)
        if kind is not None:
            return kind
    layers = getattr(spec, "kv_cache_specs", None)
    if "UniformTypeKVCacheSpecs" in names and isinstance(layers, dict) and layers:
        kinds = {_spec_kind(s) for s in layers.values()}
        if len(kinds) == 1:
            return kinds.pop()
    return type(spec).__name__


def select_prefix_cache_kv_group(groups: Sequence[Any] | None) -> PrefixCacheKVGroup:
    """The group whose slots key the rows: the first full-attention group
    that is not an EAGLE draft group (else the first full-attention group).

    Accepted: one group without a ``kv_cache_spec`` (taken as full attention,
    as before specs were read), and any groups of which at least one is full
    attention and the others sliding-window, chunked-local or Mamba. Raises
    ``OmniPrefixCacheUnmatchError`` naming the groups otherwise: no groups
    (None counts as none), several groups one of which declares no spec,
    a group of another kind, and no full-attention group (none covers every
    position). Pure: any thread."""
    groups = list(groups or ())
    if not groups:
        raise OmniPrefixCacheUnmatchError(f"{_NEEDS}; got 0 groups")
    declared = [kv_group_kind(g) for g in groups]
    if len(groups) == 1 and declared[0] is None:
        return PrefixCacheKVGroup(0, groups[0], None)
    kinds = [k for k in declared if k is not None]
    if len(kinds) < len(declared):
        raise OmniPrefixCacheUnmatchError(
            f"{_NEEDS}; cannot tell which of {len(groups)} KV cache groups is full attention: "
            f"group {declared.index(None)} declares no kv_cache_spec"
        )
    named = ", ".join(f"group {i}: {k}" for i, k in enumerate(kinds))
    other = [(i, k) for i, k in enumerate(kinds) if k != FULL_ATTENTION and k not in BESIDE_FULL_ATTENTION]
    if other:
        i, k = other[0]
        raise OmniPrefixCacheUnmatchError(
            f"{_NEEDS}; group {i} is {k}, a kind the prefix cache was not verified beside ({named})"
        )
    full = [i for i, k in enumerate(kinds) if k == FULL_ATTENTION]
    if not full:
        why = "; ".join(f"{k}: {BESIDE_FULL_ATTENTION[k]}" for k in dict.fromkeys(kinds))
        raise OmniPrefixCacheUnmatchError(
            f"{_NEEDS}; none of the {len(groups)} groups is full attention ({named}), so no group covers "
            f"every position and no group's slots can key every row ({why})"
        )
    index = min(full, key=lambda i: (bool(getattr(groups[i], "is_eagle_group", False)), i))
    block_size = getattr(getattr(groups[index], "kv_cache_spec", None), "block_size", None)
    return PrefixCacheKVGroup(index, groups[index], None if block_size is None else int(block_size))


def check_prefix_cache_hit_alignment(kv_cache_config: Any, block_size: int) -> None:
    """Raise when vLLM's prefix hits may end inside a block of the keyed
    group: ``kv_cache_config.cache_hit_alignment_tokens`` (set by vLLM's
    engine core; None or absent passes) not a multiple of ``block_size``
    (vLLM's fine-grained hits beside a Mamba group in "align" mode)."""
    align = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    if align is not None and int(align) % int(block_size):
        raise OmniPrefixCacheUnmatchError(
            f"omni prefix cache needs prefix hits that end on a block of the full-attention group: "
            f"vLLM's hits land every {int(align)} tokens (kv_cache_config.cache_hit_alignment_tokens), "
            f"not a multiple of its block size {int(block_size)}"
        )


def _size(parallel_config: Any, name: str) -> int:
    return int(getattr(parallel_config, name, 1) or 1)


def check_prefix_cache_context_parallel(parallel_config: Any) -> None:
    """Raise for decode or prefill context parallel in ``parallel_config``
    (vLLM's ``ParallelConfig``; None passes): both stripe a request's tokens
    across ranks, so no rank holds a row for every position."""
    for name, what in (
        ("decode_context_parallel_size", "decode context parallel"),
        ("prefill_context_parallel_size", "prefill context parallel"),
    ):
        size = _size(parallel_config, name)
        if size > 1:
            raise OmniPrefixCacheUnmatchError(
                f"omni prefix cache does not support {what} ({name}={size}): it stripes a request's tokens "
                "across ranks, so no rank computes a row for every position; disable one of them for this stage"
            )


def is_prefix_cache_mirror_rank(parallel_config: Any, rank: int | None = None) -> bool:
    """Whether the worker of ``rank`` (default ``parallel_config.rank``, which
    vLLM's worker sets to its rank within the engine's executor) mirrors:
    the rank whose model runner output the engine returns, the first tensor
    rank of the last pipeline stage (rank ``(pp - 1) * tp``; context parallel
    is refused, see ``check_prefix_cache_context_parallel``). With
    ``distributed_executor_backend="external_launcher"`` each rank runs its
    own engine on its own output: every rank of the last stage mirrors. None
    (no parallel config) is a single rank: True. Raises
    ``OmniPrefixCacheUnmatchError`` for a rank outside ``[0, tp * pp)``."""
    if parallel_config is None:
        return True
    tp = _size(parallel_config, "tensor_parallel_size")
    pp = _size(parallel_config, "pipeline_parallel_size")
    if rank is None:
        rank = getattr(parallel_config, "rank", 0)
    rank = int(rank or 0)
    if not 0 <= rank < tp * pp:
        raise OmniPrefixCacheUnmatchError(
            f"omni prefix cache: worker rank {rank} is outside tensor_parallel_size={tp} x "
            f"pipeline_parallel_size={pp}; pass the rank within the engine's executor (vLLM's parallel_config.rank)"
        )
    last_stage = rank // tp == pp - 1
    if getattr(parallel_config, "distributed_executor_backend", None) == "external_launcher":
        return last_stage
    return last_stage and rank % tp == 0


def check_view_group(view: Any, group_index: int) -> None:
    """Raise when ``view`` reads another KV cache group than the one the
    rows are keyed by (``PrefixCacheConfig.kv_cache_group_index``): its
    writes and the hits would address different slots. A view that declares
    no ``group_index`` (a driver's own) passes."""
    declared = getattr(view, "group_index", None)
    if declared is not None and int(declared) != int(group_index):
        raise OmniPrefixCacheUnmatchError(
            f"group view reads KV cache group {int(declared)}, but PrefixCacheConfig.kv_cache_group_index is "
            f"{int(group_index)}: build the view with group_index={int(group_index)} "
            "(get_prefix_cache_group_view picks it from kv_cache_config.kv_cache_groups)"
        )
