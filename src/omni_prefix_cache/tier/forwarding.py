"""The forwarding half of ``OmniTierConnector`` (``tier/connector.py``): a vLLM
KV connector that builds the configured one (``omni_tier_inner``) with vLLM's
own factory, as ``MultiConnector`` builds its children, and hands it every call
of ``KVConnectorBase_V1``, scheduler and worker side. ``connector`` adds the
host tier's behaviour on top.

vLLM is imported only when a class of it is first looked up (``_define``): the
package imports without vLLM; only ``tier/connector.py`` looks them up.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

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

# KVConnectorBase_V1's public names the wrapper does not override, with why;
# every other public name is forwarded (tests_vllm checks the two cover the base).
NOT_FORWARDED: Mapping[str, str] = {
    "role": "the wrapper and its inner are built with the same role",
    "has_connector_metadata": "bind_connector_metadata binds the wrapper's own metadata too",
}


_PUBLIC = (
    "WrappedConnectorMetadata",
    "inner_transfer_config",
    "inner_vllm_config",
    "inner_class",
    "ForwardingConnector",
)
_defined: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """The vLLM classes, defined on the first lookup of one (``_define``)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _defined:
        _defined.update(_define())
    return _defined[name]


def _define() -> dict[str, Any]:  # noqa: C901
    """Import vLLM and define this module's classes and helpers (the package imports without vLLM)."""
    from vllm.config.kv_transfer import KVTransferConfig
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

    from omni_prefix_cache.errors import OmniPrefixCacheInvalidArgumentError, OmniPrefixCacheUnmatchError

    @dataclass
    class WrappedConnectorMetadata(KVConnectorMetadata):
        """One step's metadata: the inner connector's, as ``inner``."""

        inner: KVConnectorMetadata

    def inner_transfer_config(outer: KVTransferConfig) -> KVTransferConfig:
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

    def inner_vllm_config(vllm_config: VllmConfig) -> VllmConfig:
        """A shallow copy of ``vllm_config`` with the inner connector's transfer config."""
        assert vllm_config.kv_transfer_config is not None
        inner = copy.copy(vllm_config)
        inner.kv_transfer_config = inner_transfer_config(vllm_config.kv_transfer_config)
        return inner

    def inner_class(kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        return cast(type[KVConnectorBase_V1], KVConnectorFactory.get_connector_class(kv_transfer_config))

    class ForwardingConnector(KVConnectorBase_V1, SupportsHMA):
        """Builds the connector ``omni_tier_inner`` configures, as ``inner``, and
        forwards every call to it; the worker side unwraps the step's metadata."""

        def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            inner_config = inner_vllm_config(vllm_config)
            assert inner_config.kv_transfer_config is not None
            self.inner: KVConnectorBase_V1 = inner_class(inner_config.kv_transfer_config)(
                inner_config, role, kv_cache_config
            )

        # ------------------------------------------------------------ properties, class-level

        @property
        def supports_divergent_local_hybrid_hits(self) -> bool:
            return self.inner.supports_divergent_local_hybrid_hits

        @property
        def requires_kv_delivery(self) -> bool:
            return self.inner.requires_kv_delivery

        @classmethod
        def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
            inner = inner_transfer_config(kv_transfer_config)
            return inner_class(inner).supports_sleep_mode(inner)

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
            inner = inner_vllm_config(vllm_config)
            assert inner.kv_transfer_config is not None
            return inner_class(inner.kv_transfer_config).get_required_kvcache_layout(inner)

        @classmethod
        def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
            inner = extra_config.get(INNER_KEY)
            if not isinstance(inner, Mapping):
                return False
            inner_cls = inner_class(KVTransferConfig(**inner))
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
            inner = inner_vllm_config(vllm_config)
            assert inner.kv_transfer_config is not None
            inner_cls = inner_class(inner.kv_transfer_config)
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
            if not isinstance(connector_metadata, WrappedConnectorMetadata):
                raise OmniPrefixCacheUnmatchError(
                    f"OmniTierConnector: the worker was given {type(connector_metadata).__name__}, not the "
                    "wrapper's metadata its scheduler side builds (scheduler and worker configs differ?)"
                )
            return connector_metadata.inner

        # ------------------------------------------------------------ scheduler side

        def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
            # Not super(): its bind_gpu_block_pool would reach the inner a second time.
            self._kv_cache_manager = kv_cache_manager
            self.inner.bind_kv_cache_manager(kv_cache_manager)

        def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
            return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

        def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
            self.inner.update_state_after_alloc(request, blocks, num_external_tokens)

        def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
            return WrappedConnectorMetadata(inner=self.inner.build_connector_meta(scheduler_output))

        def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
            self.inner.update_connector_output(connector_output)

        def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
            return self.inner.request_finished(request, block_ids)

        def request_finished_all_groups(
            self, request: Request, block_ids: tuple[list[int], ...]
        ) -> tuple[bool, dict[str, Any] | None]:
            if supports_hma(self.inner):
                return cast(SupportsHMA, self.inner).request_finished_all_groups(request, block_ids)
            if len(block_ids) != 1:
                raise OmniPrefixCacheUnmatchError(
                    f"OmniTierConnector: request {request.request_id!r} finished with {len(block_ids)} KV cache "
                    f"groups, but the wrapped {type(self.inner).__name__} supports one"
                )
            return self.inner.request_finished(request, block_ids[0])

        def take_events(self) -> Iterable[KVCacheEvent]:
            return self.inner.take_events()

        def reset_cache(self) -> bool | None:
            return self.inner.reset_cache()

        def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
            self.inner.bind_gpu_block_pool(gpu_block_pool)

        def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
            return self.inner.get_loaded_kv_cache_group_ids(request)

        def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
            return self.inner.get_external_cache_hit_sources(request, num_external_tokens)

        def on_new_request(self, request: Request) -> None:
            self.inner.on_new_request(request)

        def register_finished_partial_tail(
            self, request: Request, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
        ) -> bool:
            return self.inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

        def has_pending_block_frees(self) -> bool:
            return self.inner.has_pending_block_frees()

        def has_pending_push_work(self) -> bool:
            return self.inner.has_pending_push_work()

    scope = locals()
    defined = {name: scope[name] for name in _PUBLIC}
    for obj in defined.values():
        if isinstance(obj, type):  # pickled by name (a step's metadata crosses processes)
            obj.__qualname__, obj.__module__ = obj.__name__, __name__
    return defined
