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
which block-aligned range of which request the connector loaded. The worker
side answers in each step's ``kv_connector_worker_meta``
(``OmniTierWorkerMetadata``): the hashes its tier does not keep as the
scheduler side believes (``tier.channel``), which the scheduler side forgets
so no load of them is offered again. Every other call goes to the inner
connector; the worker side hands the inner its own metadata (``.inner``), and
the scheduler side its own worker metadata.

The classes are defined on their first lookup (``_define``, which imports
vLLM): the module, like the whole package, imports without vLLM, and vLLM's
loader (``getattr`` of the class on the module) defines them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from omni_prefix_cache.tier.forwarding import NOT_FORWARDED as NOT_FORWARDED  # re-exported (tests_vllm)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


MAX_BYTES_KEY = "omni_tier_max_bytes"
BYTES_PER_TOKEN_KEY = "omni_tier_bytes_per_token"


_PUBLIC = ("OmniTierConnectorMetadata", "OmniTierWorkerMetadata", "OmniTierConnector")
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
    from vllm.distributed.kv_events import MEDIUM_GPU, BlockRemoved
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from omni_prefix_cache.errors import OmniPrefixCacheInvalidArgumentError, OmniPrefixCacheUnmatchError
    from omni_prefix_cache.kv_layout_gate import MAMBA, kv_group_kind, select_prefix_cache_kv_group
    from omni_prefix_cache.tier import channel
    from omni_prefix_cache.tier.forwarding import ForwardingConnector, WrappedConnectorMetadata
    from omni_prefix_cache.tier.index import TierIndex
    from omni_prefix_cache.tier.metadata import BlockHash, TierLoad, TierStepMetadata

    @dataclass
    class OmniTierConnectorMetadata(WrappedConnectorMetadata):
        """One step's metadata: the inner connector's (``inner``), and the host tier's."""

        omni_tier: TierStepMetadata

    @dataclass
    class OmniTierWorkerMetadata(KVConnectorWorkerMetadata):
        """One step's worker metadata: the inner connector's (``inner``, None
        when it sent none), and the hashes the worker's host tier does not keep
        as the scheduler side believes (``forget``: a fill lost, a surplus
        past the worker's byte bound, a rebound block)."""

        inner: KVConnectorWorkerMetadata | None
        forget: tuple[BlockHash, ...] = ()

        @classmethod
        def of(cls, inner: KVConnectorWorkerMetadata | None, forget: tuple[BlockHash, ...]) -> Any:
            """What the worker sends: None when neither part has news (vLLM then sends nothing)."""
            if inner is None and not forget:
                return None
            return cls(inner, tuple(forget))

        def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
            """Every worker's news in one (vLLM's KVOutputAggregator, one step's workers)."""
            if not isinstance(other, OmniTierWorkerMetadata):
                raise OmniPrefixCacheUnmatchError(
                    f"OmniTierConnector: a worker sent {type(other).__name__}, not the wrapper's worker metadata "
                    "(workers run different connectors?)"
                )
            inner = self.inner
            if inner is None:
                inner = other.inner
            elif other.inner is not None:
                inner = inner.aggregate(other.inner)
            return OmniTierWorkerMetadata(inner, tuple(dict.fromkeys((*self.forget, *other.forget))))

    def _positive_int(extra: Mapping[str, Any], key: str) -> int:
        value = extra.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise OmniPrefixCacheInvalidArgumentError(
                f"OmniTierConnector: kv_connector_extra_config[{key!r}] must be a positive int, got {value!r}"
            )
        return value

    class OmniTierConnector(ForwardingConnector):
        """The configured KV connector (``inner``; every other call is forwarded),
        with its external hits capped to what the host tier holds and the tier's
        updates in each step's metadata."""

        def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            extra = self._kv_transfer_config.kv_connector_extra_config or {}
            # The tier keys the full blocks of the group the library keys its rows by (the stage
            # gate's choice, kv_layout_gate): a full-attention group, beside any others.
            keyed = select_prefix_cache_kv_group(kv_cache_config.kv_cache_groups)
            self.group_index: int = keyed.index
            self.block_size: int = keyed.group.kv_cache_spec.block_size
            # A Mamba group's state is loaded as of the hit's end, and the inner connector
            # stored it only at the ends it offers: such a hit is served whole or not at all.
            self._whole_hits_only = any(kv_group_kind(g) == MAMBA for g in kv_cache_config.kv_cache_groups)
            max_bytes, per_token = _positive_int(extra, MAX_BYTES_KEY), _positive_int(extra, BYTES_PER_TOKEN_KEY)
            if max_bytes < per_token * self.block_size:
                raise OmniPrefixCacheInvalidArgumentError(
                    f"OmniTierConnector: kv_connector_extra_config[{MAX_BYTES_KEY!r}]={max_bytes} holds no block: "
                    f"one block takes {BYTES_PER_TOKEN_KEY} ({per_token}) x block_size ({self.block_size}) = "
                    f"{per_token * self.block_size} bytes"
                )
            self.index = TierIndex(max_bytes, per_token * self.block_size)
            self.forgotten = 0  # hashes the worker reported and the index forgot (update_connector_output)
            self._hash_block_size = self.block_size  # vLLM's hash block size, known once the manager is bound
            # req_id -> the local computed tokens get_num_new_matched_tokens was given: where its load starts.
            self._matched: dict[str, int] = {}
            # Loads allocated but not yet reported to the worker (their request not scheduled yet).
            self._pending: dict[str, TierLoad] = {}
            self._allocated_now: set[str] = set()  # loads allocated in the step being scheduled
            # ExternalBlockHash -> tier hash, where vLLM's events carry a converted hash (int block hashes).
            self._external: dict[object, BlockHash] = {}

        # ------------------------------------------------------------ worker side

        def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
            """The inner's worker metadata, wrapped with the hashes this
            process's host tier reported since the last step (``tier.channel``):
            the scheduler side's ``update_connector_output`` forgets them."""
            return cast(
                "KVConnectorWorkerMetadata | None",
                OmniTierWorkerMetadata.of(self.inner.build_connector_worker_meta(), channel.drain()),
            )

        # ------------------------------------------------------------ scheduler side

        def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
            self._hash_block_size = kv_cache_manager.block_pool.hash_block_size
            if self.block_size % self._hash_block_size:
                raise OmniPrefixCacheInvalidArgumentError(
                    f"OmniTierConnector: KV block size {self.block_size} is not a multiple of vLLM's hash block "
                    f"size {self._hash_block_size}"
                )
            super().bind_kv_cache_manager(kv_cache_manager)

        def kv_block_hashes(self, request: Request) -> list[BlockHash]:
            """One hash per full KV block of ``request`` in the keyed group: the last
            of the vLLM hashes that block spans, as vLLM keys a block in its prefix cache."""
            step = self.block_size // self._hash_block_size
            hashes = request.block_hashes
            return [bytes(hashes[end - 1]) for end in range(step, len(hashes) + 1, step)]

        def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
            """The inner's hit past ``num_computed_tokens``, cut to the whole blocks
            the host tier holds from there, short of the last token: vLLM computes
            the rest. A hit ending inside a block the tier would not cover (a
            partial tail) is refused whole, since the inner planned its load to end
            exactly there; so is any shortened hit beside a Mamba group, whose
            state the inner stored only as of the end it offered."""
            num_tokens, load_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
            self._matched.pop(request.request_id, None)
            if not num_tokens:
                return num_tokens, load_async  # None (ask again later) or no hit
            bs = self.block_size
            if num_computed_tokens % bs:
                return 0, False  # vLLM passes a block-aligned local hit; a load from mid-block has no tier key
            first = num_computed_tokens // bs
            # A hit may not reach the last token: vLLM would then recompute only that token and
            # report num_computed_tokens = num_tokens - 1, a hit the manager cannot serve (not
            # block aligned). Like vLLM's own prefix cache, it stops at the last whole block before.
            last = (request.num_tokens - 1) // bs
            room = min((num_computed_tokens + num_tokens) // bs, last) - first
            if room <= 0:
                return 0, False
            covered = self.index.covered(self.kv_block_hashes(request), first, room)
            capped = covered * bs
            if capped < num_tokens and ((num_computed_tokens + num_tokens) % bs or self._whole_hits_only):
                capped = 0
            if capped == 0:
                return 0, False
            self._matched[request.request_id] = num_computed_tokens
            return capped, load_async

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
            self._allocated_now.add(req_id)

        def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OmniTierConnectorMetadata:
            """The inner's metadata and this step's tier updates: release and bind
            from the index, and the loads of the requests scheduled this step."""
            inner = self.inner.build_connector_meta(scheduler_output)
            cached = scheduler_output.scheduled_cached_reqs
            scheduled = {r.req_id for r in scheduler_output.scheduled_new_reqs}
            scheduled.update(getattr(cached, "resumed_req_ids", ()) or ())
            # A request preempted since the last step loses its blocks: a load
            # pending from an earlier step is void. A load allocated in this very
            # step is newer than the preemption (schedule() preempts running
            # requests before it admits waiting ones: a request preempted and
            # readmitted with an async load in one step is scheduled, resumed,
            # in a later one). vLLM 0.33 never preempts a request waiting for its
            # load, so the drop is a guard.
            for req_id in set(scheduler_output.preempted_req_ids or ()) - scheduled - self._allocated_now:
                self._drop_pending(req_id)
            self._allocated_now.clear()
            loads = {req_id: load for req_id, load in self._pending.items() if req_id in scheduled}
            # Drained before the unpins: an entry they let go is released next step,
            # after the worker restored this step's loads from it.
            release, bind = self.index.take_step()
            for h in release:
                self._external.pop(maybe_convert_block_hash(h), None)
            for req_id in loads:
                del self._pending[req_id]
                self.index.unpin(req_id)
            return OmniTierConnectorMetadata(inner=inner, omni_tier=TierStepMetadata(release, bind, loads))

        def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
            """Forward (the inner gets its own worker metadata); forget the
            hashes the worker's tier reported (``OmniTierWorkerMetadata.forget``:
            not offered again, released once no load of them is pending); then
            cut each load not yet reported to the worker to the blocks before
            its first failed one (vLLM recomputes from there), and drop those of
            requests whose receive failed.

            A load already reported (every sync load: it is reported in the step it
            is allocated) stays as sent: the rows the worker restored are the tier's
            rows for those hashes, right whatever happened to the KV, and vLLM's
            recompute from the first failed block rewrites the same rows."""
            meta = connector_output.kv_connector_worker_meta
            if isinstance(meta, OmniTierWorkerMetadata):
                connector_output.kv_connector_worker_meta = meta.inner
                try:
                    self.inner.update_connector_output(connector_output)
                finally:
                    connector_output.kv_connector_worker_meta = meta
                if meta.forget:
                    held = sum(1 for h in meta.forget if h in self.index)
                    self.index.forget(meta.forget)
                    self.forgotten += held
            else:
                self.inner.update_connector_output(connector_output)
            for req_id in connector_output.failed_recving or ():
                self._drop_pending(req_id)
            invalid = connector_output.invalid_block_ids
            if not invalid or not self._pending or self._kv_cache_manager is None:
                return
            bs = self.block_size
            for req_id, load in list(self._pending.items()):
                block_ids = self._kv_cache_manager.get_block_ids(req_id)[self.group_index]
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
            """``request_finished`` for every KV cache group (the tier keeps the keyed group's)."""
            result = super().request_finished_all_groups(request, block_ids)
            g = self.group_index
            self._finished(request, block_ids[g] if len(block_ids) > g else [])
            return result

        def take_events(self) -> Iterable[KVCacheEvent]:
            """The inner's events; a ``BlockRemoved`` off the GPU (the connector
            evicted offloaded KV) makes the tier forget those hashes."""
            events = list(self.inner.take_events())
            for event in events:
                if isinstance(event, BlockRemoved) and event.medium != MEDIUM_GPU:
                    self.index.forget(self._external.pop(h, h) for h in event.block_hashes)
            return events

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
                if pool.get_cached_block(h, [self.group_index]) is None:
                    break  # not in vLLM's prefix cache: no later block is reachable by a hit
                pairs.append((h, block_id))
                external = maybe_convert_block_hash(h)
                if external != h:
                    self._external[external] = h
            self.index.retain(pairs)

    scope = locals()
    defined = {name: scope[name] for name in _PUBLIC}
    for obj in defined.values():
        if isinstance(obj, type):  # pickled by name (a step's metadata crosses processes)
            obj.__qualname__, obj.__module__ = obj.__name__, __name__
    return defined
