"""``OmniTierConnector``: a vLLM KV connector that wraps the configured one
(``OffloadingConnector``, LMCache, ...) so a prefix-cache stage may run behind
a connector that loads KV into new GPU blocks.

vLLM loads it with::

    KVTransferConfig(
        kv_connector="OmniTierConnector",
        kv_connector_module_path="omni_prefix_cache.tier.connector",
        kv_role=...,
        kv_connector_extra_config={
            "omni_tier_inner": {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {...}},
            "omni_tier_max_bytes": N,  # the host tier's budget
            "omni_tier_bytes_per_token": B,  # the tier's bytes per token (hidden + mm rows)
        },
    )

On the scheduler side it (a) caps the inner connector's external hits to the
block-aligned prefix the host tier holds rows for, so vLLM recomputes the rest,
and (b) tells the worker, in each step's ``kv_connector_metadata.omni_tier``
(``tier.metadata.TierStepMetadata``), what the tier holds from now on and
which block-aligned range of which request the connector loaded. Every other
call goes to the inner connector; the worker side hands the inner its own
metadata (``.inner``).

This module imports vLLM at the top: vLLM imports it, nothing in the
package does (the package stays importable without vLLM).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_events import MEDIUM_GPU, BlockRemoved
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorPromMetrics,
    MultiKVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from omni_prefix_cache.errors import OmniPrefixCacheInvalidArgumentError, OmniPrefixCacheUnmatchError
from omni_prefix_cache.tier.index import TierIndex
from omni_prefix_cache.tier.metadata import BlockHash, TierLoad, TierStepMetadata

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        CopyBlocksOp,
        KVConnectorHandshakeMetadata,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

INNER_KEY = "omni_tier_inner"
MAX_BYTES_KEY = "omni_tier_max_bytes"
BYTES_PER_TOKEN_KEY = "omni_tier_bytes_per_token"

# KVConnectorBase_V1's public names this class does not override, with why;
# every other public name is forwarded (tests_vllm checks the two cover the base).
NOT_FORWARDED: Mapping[str, str] = {
    "role": "the wrapper and its inner are built with the same role",
    "has_connector_metadata": "bind_connector_metadata binds the wrapper's own metadata too",
}


@dataclass
class OmniTierConnectorMetadata(KVConnectorMetadata):
    """One step's metadata: the inner connector's, and the host tier's."""

    inner: KVConnectorMetadata
    omni_tier: TierStepMetadata


def _inner_transfer_config(outer: KVTransferConfig) -> KVTransferConfig:
    """The inner connector's ``KVTransferConfig``: ``omni_tier_inner``, with the
    outer's engine id, role and load-failure policy unless it sets them."""
    inner = (outer.kv_connector_extra_config or {}).get(INNER_KEY)
    if not isinstance(inner, Mapping) or not inner.get("kv_connector"):
        raise OmniPrefixCacheInvalidArgumentError(
            f"OmniTierConnector: kv_connector_extra_config[{INNER_KEY!r}] must be a mapping naming the wrapped "
            f"connector's kv_connector, got {inner!r}"
        )
    if inner.get("kv_connector") == "OmniTierConnector":
        raise OmniPrefixCacheInvalidArgumentError("OmniTierConnector: the wrapped connector cannot be itself")
    defaults = {
        "engine_id": outer.engine_id,
        "kv_role": outer.kv_role,
        "kv_load_failure_policy": outer.kv_load_failure_policy,
    }
    return KVTransferConfig(**{**defaults, **inner})


def _inner_vllm_config(vllm_config: VllmConfig) -> VllmConfig:
    """A shallow copy of ``vllm_config`` with the inner connector's transfer config."""
    assert vllm_config.kv_transfer_config is not None
    inner = copy.copy(vllm_config)
    inner.kv_transfer_config = _inner_transfer_config(vllm_config.kv_transfer_config)
    return inner


def _inner_class(kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase_V1]:
    return cast(type[KVConnectorBase_V1], KVConnectorFactory.get_connector_class(kv_transfer_config))


def _positive_int(extra: Mapping[str, Any], key: str) -> int:
    value = extra.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise OmniPrefixCacheInvalidArgumentError(
            f"OmniTierConnector: kv_connector_extra_config[{key!r}] must be a positive int, got {value!r}"
        )
    return value


class OmniTierConnector(KVConnectorBase_V1, SupportsHMA):
    """The configured KV connector, with its external hits capped to what the
    host tier holds and the tier's updates in each step's metadata."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        inner_config = _inner_vllm_config(vllm_config)
        assert inner_config.kv_transfer_config is not None
        self._inner_ktc = inner_config.kv_transfer_config
        self.inner: KVConnectorBase_V1 = _inner_class(self._inner_ktc)(inner_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        # The tier keys group 0's full blocks (the group the library mirrors).
        self.block_size: int = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.index = TierIndex(
            _positive_int(extra, MAX_BYTES_KEY), _positive_int(extra, BYTES_PER_TOKEN_KEY) * self.block_size
        )
        self._hash_block_size = self.block_size  # vLLM's hash block size, known once the manager is bound
        # req_id -> the local computed tokens get_num_new_matched_tokens was given: where its load starts.
        self._matched: dict[str, int] = {}
        # Loads allocated but not yet reported to the worker (their request not scheduled yet).
        self._pending: dict[str, TierLoad] = {}
        # ExternalBlockHash -> tier hash, where vLLM's events carry a converted hash (int block hashes).
        self._external: dict[object, BlockHash] = {}

    # ------------------------------------------------------------ properties, class-level

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.inner.supports_divergent_local_hybrid_hits

    @property
    def requires_kv_delivery(self) -> bool:
        return self.inner.requires_kv_delivery

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        inner = _inner_transfer_config(kv_transfer_config)
        return _inner_class(inner).supports_sleep_mode(inner)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        inner = _inner_vllm_config(vllm_config)
        assert inner.kv_transfer_config is not None
        return _inner_class(inner.kv_transfer_config).get_required_kvcache_layout(inner)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        inner = extra_config.get(INNER_KEY)
        if not isinstance(inner, Mapping):
            return False
        inner_cls = _inner_class(KVTransferConfig(**inner))
        return inner_cls.requires_piecewise_for_cudagraph(dict(inner.get("kv_connector_extra_config", {})))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        # Stats travel keyed by the inner connector's class name (get_kv_connector_stats),
        # MultiConnector's format, so they are rebuilt without the config.
        return cast("KVConnectorStats | None", MultiConnector.build_kv_connector_stats(data))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        inner = _inner_vllm_config(vllm_config)
        assert inner.kv_transfer_config is not None
        inner_cls = _inner_class(inner.kv_transfer_config)
        prom = inner_cls.build_prom_metrics(inner, metric_types, labelnames, per_engine_labelvalues)
        children = {} if prom is None else {inner_cls.__name__: prom}
        return MultiKVConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, children)

    # ------------------------------------------------------------ worker side

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        return self.inner.get_mem_pool_context()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self.inner.bind_connector_metadata(self._inner_meta(connector_metadata))
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self.inner.clear_connector_metadata()
        super().clear_connector_metadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.inner.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        self.inner.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self.inner.restore_kv_caches()

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        self.inner.set_host_xfer_buffer_ops(copy_operation)

    def finish_forward(self) -> None:
        self.inner.finish_forward()

    def reset_capture_state(self) -> None:
        self.inner.reset_capture_state()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.inner.handle_preemptions(self._inner_meta(kv_connector_metadata))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.inner.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.inner.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self.inner.get_kv_connector_stats()
        if stats is None:
            return None
        return cast("KVConnectorStats", MultiKVConnectorStats(data={type(self.inner).__name__: stats}))

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self.inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.inner.get_handshake_metadata()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        # The scheduler side hands it straight to the inner (update_connector_output).
        return self.inner.build_connector_worker_meta()

    def get_finished_count(self) -> int | None:
        return self.inner.get_finished_count()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self.inner.set_xfer_handshake_metadata_pp_aware(metadata)

    @staticmethod
    def _inner_meta(connector_metadata: KVConnectorMetadata) -> KVConnectorMetadata:
        if not isinstance(connector_metadata, OmniTierConnectorMetadata):
            raise OmniPrefixCacheUnmatchError(
                f"OmniTierConnector: the worker was given {type(connector_metadata).__name__}, not the "
                "OmniTierConnectorMetadata its scheduler side builds (scheduler and worker configs differ?)"
            )
        return connector_metadata.inner

    # ------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        # Not super(): its bind_gpu_block_pool would reach the inner a second time.
        self._kv_cache_manager = kv_cache_manager
        self._hash_block_size = kv_cache_manager.block_pool.hash_block_size
        if self.block_size % self._hash_block_size:
            raise OmniPrefixCacheInvalidArgumentError(
                f"OmniTierConnector: KV block size {self.block_size} is not a multiple of vLLM's hash block "
                f"size {self._hash_block_size}"
            )
        self.inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self.inner.get_loaded_kv_cache_group_ids(request)

    def kv_block_hashes(self, request: Request) -> list[BlockHash]:
        """One hash per full KV block of ``request`` (group 0): the last of the
        vLLM hashes that block spans, as vLLM keys a block in its prefix cache."""
        step = self.block_size // self._hash_block_size
        hashes = request.block_hashes
        return [bytes(hashes[end - 1]) for end in range(step, len(hashes) + 1, step)]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The inner's hit past ``num_computed_tokens``, cut to the whole blocks
        the host tier holds from there: vLLM computes the rest. A hit ending
        inside a block the tier would not cover (a partial tail) is refused
        whole, since the inner planned its load to end exactly there."""
        num_tokens, load_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        self._matched.pop(request.request_id, None)
        if not num_tokens:
            return num_tokens, load_async  # None (ask again later) or no hit
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False  # vLLM passes a block-aligned local hit; a load from mid-block has no tier key
        first = num_computed_tokens // bs
        room = (num_computed_tokens + num_tokens) // bs - first
        covered = self.index.covered(self.kv_block_hashes(request), first, room)
        capped = covered * bs
        if capped < num_tokens and (num_computed_tokens + num_tokens) % bs:
            capped = 0
        if capped == 0:
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        return capped, load_async

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        return self.inner.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Forward; a load (``num_external_tokens > 0``) is recorded, its hashes
        pinned, until the step that schedules its request reports it."""
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens <= 0:
            return
        req_id = request.request_id
        # vLLM sets request.num_computed_tokens only after this call (still 0 here
        # for a fresh admission): the load starts at the local hit given to
        # get_num_new_matched_tokens.
        token_start = self._matched.pop(req_id, None)
        if token_start is None or num_external_tokens % self.block_size:
            raise OmniPrefixCacheUnmatchError(
                f"OmniTierConnector: request {req_id!r} was allocated {num_external_tokens} external tokens "
                f"the wrapper never offered whole blocks of (offered from token {token_start})"
            )
        first = token_start // self.block_size
        hashes = tuple(self.kv_block_hashes(request)[first : first + num_external_tokens // self.block_size])
        self.index.pin(req_id, hashes)
        self._pending[req_id] = TierLoad(req_id, token_start, hashes)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OmniTierConnectorMetadata:
        """The inner's metadata and this step's tier updates: release and bind
        from the index, and the loads of the requests scheduled this step."""
        inner = self.inner.build_connector_meta(scheduler_output)
        for req_id in scheduler_output.preempted_req_ids or ():
            self._drop_pending(req_id)
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        scheduled.update(getattr(cached, "resumed_req_ids", ()) or ())
        loads = {req_id: load for req_id, load in self._pending.items() if req_id in scheduled}
        # Drained before the unpins: an entry they let go is released next step,
        # after the worker restored this step's loads from it.
        release, bind = self.index.take_step()
        for req_id in loads:
            del self._pending[req_id]
            self.index.unpin(req_id)
        return OmniTierConnectorMetadata(inner=inner, omni_tier=TierStepMetadata(release, bind, loads))

    def on_new_request(self, request: Request) -> None:
        self.inner.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forward; then cut each load not yet reported to the worker to the
        blocks before its first failed one (vLLM recomputes from there), and
        drop those of requests whose receive failed.

        A load already reported (every sync load: it is reported in the step it
        is allocated) stays as sent: the rows the worker restored are the tier's
        rows for those hashes, right whatever happened to the KV, and vLLM's
        recompute from the first failed block rewrites the same rows."""
        self.inner.update_connector_output(connector_output)
        for req_id in connector_output.failed_recving or ():
            self._drop_pending(req_id)
        invalid = connector_output.invalid_block_ids
        if not invalid or not self._pending or self._kv_cache_manager is None:
            return
        bs = self.block_size
        for req_id, load in list(self._pending.items()):
            (block_ids, *_) = self._kv_cache_manager.get_block_ids(req_id)
            first = load.token_start // bs
            keep = next(
                (i for i, b in enumerate(block_ids[first : first + len(load.hashes)]) if b in invalid),
                len(load.hashes),
            )
            if keep == len(load.hashes):
                continue
            self._drop_pending(req_id)
            if keep:
                self.index.pin(req_id, load.hashes[:keep])
                self._pending[req_id] = TierLoad(req_id, load.token_start, load.hashes[:keep])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forward; then retain the request's computed full blocks still in
        vLLM's prefix cache, their rows in ``block_ids``' slots."""
        result = self.inner.request_finished(request, block_ids)
        self._finished(request, block_ids)
        return result

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` for every KV cache group (the tier keeps group 0's)."""
        if supports_hma(self.inner):
            result = cast(SupportsHMA, self.inner).request_finished_all_groups(request, block_ids)
        else:
            if len(block_ids) != 1:
                raise OmniPrefixCacheUnmatchError(
                    f"OmniTierConnector: request {request.request_id!r} finished with {len(block_ids)} KV cache "
                    f"groups, but the wrapped {type(self.inner).__name__} supports one"
                )
            result = self.inner.request_finished(request, block_ids[0])
        self._finished(request, block_ids[0] if block_ids else [])
        return result

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        return self.inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The inner's events; a ``BlockRemoved`` off the GPU (the connector
        evicted offloaded KV) makes the tier forget those hashes."""
        events = list(self.inner.take_events())
        for event in events:
            if isinstance(event, BlockRemoved) and event.medium != MEDIUM_GPU:
                self.index.forget(self._external.pop(h, h) for h in event.block_hashes)
        return events

    def has_pending_block_frees(self) -> bool:
        return self.inner.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self.inner.has_pending_push_work()

    def reset_cache(self) -> bool | None:
        """Forward; a reset that went through (weights may have changed) also
        releases every tier entry: its rows may be stale now."""
        result = self.inner.reset_cache()
        if result is not False:
            self.index.forget(self.index.held())
        return result

    # ------------------------------------------------------------ helpers

    def _drop_pending(self, req_id: str) -> None:
        self._matched.pop(req_id, None)
        if self._pending.pop(req_id, None) is not None:
            self.index.unpin(req_id)

    def _finished(self, request: Request, block_ids: list[int]) -> None:
        self._drop_pending(request.request_id)
        manager = self._kv_cache_manager
        if manager is None:
            return
        # Tokens of a step still in flight have no rows yet (async scheduling).
        done = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        hashes = self.kv_block_hashes(request)[: min(done // self.block_size, len(block_ids))]
        pool = manager.block_pool
        pairs = []
        for h, block_id in zip(hashes, block_ids):
            if pool.get_cached_block(h, [0]) is None:
                break  # not in vLLM's prefix cache: no later block is reachable by a hit
            pairs.append((h, block_id))
            external = maybe_convert_block_hash(h)
            if external != h:
                self._external[external] = h
        self.index.retain(pairs)
