"""A real vLLM 0.33 ``Scheduler`` behind ``OmniTierConnector`` wrapping
``OffloadingConnector`` (CPU offload), and a fake worker that completes the
connector's transfer jobs, for tests of the tier's scheduler side and, through
each step's ``SchedulerOutput``, of its worker side.

No weights, no KV tensors: the scheduler and the connector's scheduler side
are real; the worker only reports what a real one would (completed jobs,
finished async receives, failed blocks, one sampled token per request that
computed its last known token) and, behind the wrapper, what the worker side
of ``OmniTierConnector`` adds: the hashes this process's host tiers reported
(``tier.channel``). vLLM is imported lazily (:func:`build`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_prefix_cache.tier.metadata import TierStepMetadata, tier_metadata_of
from omni_prefix_cache.tools.simulate import vllm_setup as setup
from omni_prefix_cache.tools.simulate.engine import SimConfig

# Loads to fail: req ids (every block fails), or req id -> how many leading blocks of
# the load landed before the first failed one.
FailLoads = Collection[str] | Mapping[str, int]

CONNECTOR_NAME = setup.TIER_CONNECTOR_NAME
CONNECTOR_MODULE = setup.TIER_CONNECTOR_MODULE


@dataclass(frozen=True)
class OffloadOptions:
    """How the scheduler and its connector are set up."""

    num_blocks: int = 16  # GPU KV blocks (block 0 is vLLM's null block): small, so blocks get reused
    block_size: int = 16
    token_budget: int = 512
    max_num_seqs: int = 8
    cpu_bytes: int = 1 << 22  # the OffloadingConnector's CPU budget
    sync_load_budget_bytes: int = 0  # > 0: loads that fit are sync (done before the step's forward)
    tier_max_bytes: int = 1 << 20  # omni_tier_max_bytes
    tier_bytes_per_token: int = 256  # omni_tier_bytes_per_token
    wrap: bool = True  # False: plain OffloadingConnector (no tier)
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "recompute"
    kv_events: bool = True  # KV events on, so the offload's BlockRemoved reaches the wrapper
    kv_layout: str = "full"  # the KV cache groups (vllm_setup.KV_LAYOUTS)


def kv_transfer_dict(opts: OffloadOptions) -> dict[str, Any]:
    """The ``KVTransferConfig`` fields for ``opts`` (the documented wrapper config)."""
    return setup.offload_kv_transfer(
        cpu_bytes=opts.cpu_bytes,
        sync_load_budget_bytes=opts.sync_load_budget_bytes,
        tier_max_bytes=opts.tier_max_bytes,
        tier_bytes_per_token=opts.tier_bytes_per_token,
        wrap=opts.wrap,
        kv_role=opts.kv_role,
        kv_load_failure_policy=opts.kv_load_failure_policy,
    )


@dataclass
class StepRecord:
    """One step: what the scheduler built and what the fake worker reported."""

    output: Any  # vLLM's SchedulerOutput, kv_connector_metadata included
    load_jobs: dict[int, Any]  # the inner metadata's load jobs (TransferJob), by job id
    store_jobs: dict[int, Any]
    sampled: dict[str, int]  # req_id -> the fake token sampled for it
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    @property
    def tier(self) -> TierStepMetadata | None:
        """The wrapper's tier metadata (None without the wrapper)."""
        return tier_metadata_of(self.output.kv_connector_metadata)

    @property
    def inner_metadata(self) -> Any:
        meta = self.output.kv_connector_metadata
        return getattr(meta, "inner", meta)

    def loaded_req_ids(self) -> set[str]:
        return {job.req_id for job in self.load_jobs.values()}


class OffloadHarness:
    """vLLM's scheduler with the (wrapped) OffloadingConnector, and a fake worker."""

    def __init__(self, opts: OffloadOptions | None = None, v: Any = None) -> None:
        self.opts = opts or OffloadOptions()
        self.v = v if v is not None else setup.load_vllm()
        from vllm.config import KVEventsConfig, KVTransferConfig  # type: ignore[import-not-found]

        o = self.opts
        self.cfg = SimConfig(
            num_blocks=o.num_blocks, block_size=o.block_size, token_budget=o.token_budget, max_num_seqs=o.max_num_seqs
        )
        self._model_dir = tempfile.TemporaryDirectory(prefix="omni-vllm-offload-")
        base = setup.vllm_config(self.v, self.cfg, setup.VllmOptions(kv_layout=o.kv_layout), self._model_dir.name)
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if o.kv_events else None
        self.vllm_config = self.v.VllmConfig(
            model_config=base.model_config,
            cache_config=base.cache_config,
            scheduler_config=base.scheduler_config,
            kv_transfer_config=KVTransferConfig(**kv_transfer_dict(o)),
            kv_events_config=events,
        )
        self.kv_cache_config = setup.kv_cache_config(self.v, self.cfg, o.kv_layout, self.vllm_config)
        self.sched = setup.scheduler(self.v, self.cfg, setup.VllmOptions(), self.vllm_config, self.kv_cache_config)
        self._hasher = setup.block_hasher(self.v, self.cfg, self.vllm_config, self.kv_cache_config)
        self.steps: list[StepRecord] = []
        # Async loads the worker holds in flight (completed by release_loads).
        self._held_loads: dict[int, Any] = {}
        self.hold_async_loads = False  # True: async loads stay in flight until release_loads

    def close(self) -> None:
        self._model_dir.cleanup()

    @property
    def connector(self) -> Any:
        """The scheduler's KV connector (the wrapper, or the plain OffloadingConnector)."""
        return self.sched.connector

    def request(self, req_id: str) -> Any:
        """vLLM's live Request ``req_id``."""
        return self.sched.requests[req_id]

    def add_request(self, req_id: str, prompt: Sequence[int], max_tokens: int = 1) -> Any:
        """Queue a request (greedy, ``max_tokens`` outputs, EOS ignored); returns vLLM's Request."""
        params = self.v.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        req = self.v.Request(req_id, list(prompt), params, None, block_hasher=self._hasher)
        self.sched.add_request(req)
        return req

    def step(self, fail_loads: FailLoads = ()) -> StepRecord:
        """One ``schedule()``, the fake worker, then ``update_from_output()``.

        The worker completes every store job and every load job; a sync load
        before the forward, an async one after it (``finished_recving`` in this
        step's output), unless ``hold_async_loads`` keeps it in flight. Loads of
        requests in ``fail_loads`` fail: their destination blocks (from the
        mapped index on, for a mapping) are reported in ``invalid_block_ids``;
        an async one is still reported received, as vLLM requires."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # type: ignore[import-not-found]
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput  # type: ignore[import-not-found]

        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        inner = getattr(meta, "inner", meta)
        load_jobs = dict(getattr(inner, "load_jobs", {}) or {})
        store_jobs = dict(getattr(inner, "store_jobs", {}) or {})
        completed: dict[int, int] = {job_id: 1 for job_id in store_jobs}
        recving: set[str] = set()
        invalid: set[int] = set()
        if not self.hold_async_loads:
            held, self._held_loads = self._held_loads, {}
            for job_id, job in held.items():
                self._complete_load(job_id, job, fail_loads, completed, recving, invalid)
        for job_id, job in load_jobs.items():
            if not job.sync and self.hold_async_loads:
                self._held_loads[job_id] = job
                continue
            self._complete_load(job_id, job, fail_loads, completed, recving, invalid)
        sampled = self._sample(out)
        worker_meta: Any = OffloadingWorkerMetadata(completed_jobs=completed)
        if self.opts.wrap:  # the wrapper's worker side: the tiers' reported hashes ride along
            from omni_prefix_cache.tier import channel
            from omni_prefix_cache.tier.connector import OmniTierWorkerMetadata

            worker_meta = OmniTierWorkerMetadata.of(worker_meta, channel.drain())
        ids = list(out.num_scheduled_tokens)
        runner_output = self.v.ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=recving or None,
                kv_connector_worker_meta=worker_meta,
                invalid_block_ids=invalid,
            ),
        )
        self.sched.update_from_output(out, runner_output)
        record = StepRecord(out, load_jobs, store_jobs, sampled, recving, invalid)
        self.steps.append(record)
        return record

    def release_loads(self, fail_loads: FailLoads = ()) -> StepRecord:
        """Stop holding async loads and step: the held ones complete in this step's output."""
        self.hold_async_loads = False
        return self.step(fail_loads)

    def run(self, max_steps: int = 200, fail_loads: FailLoads = ()) -> list[StepRecord]:
        """Step until no request is left (at most ``max_steps``)."""
        records: list[StepRecord] = []
        while self.sched.requests and len(records) < max_steps:
            records.append(self.step(fail_loads))
        return records

    def _complete_load(
        self,
        job_id: int,
        job: Any,
        fail_loads: FailLoads,
        completed: dict[int, int],
        recving: set[str],
        invalid: set[int],
    ) -> None:
        completed[job_id] = 1
        if job.req_id in fail_loads:
            first_failed = fail_loads[job.req_id] if isinstance(fail_loads, Mapping) else 0
            invalid.update(int(b) for b in job.dst_spec.block_ids[first_failed:])
        if not job.sync:
            recving.add(job.req_id)

    def _sample(self, out: Any) -> dict[str, int]:
        """A token for each scheduled request whose known tokens are all computed
        after this step (vLLM advanced num_computed_tokens in schedule())."""
        sampled = {}
        for req_id in out.num_scheduled_tokens:
            req = self.sched.requests[req_id]
            if req.num_computed_tokens >= req.num_tokens:
                sampled[req_id] = 1000 + (req.num_tokens * 7919 + len(req_id)) % 20000
        return sampled


def build(opts: OffloadOptions | None = None, v: Any = None) -> OffloadHarness:
    """An :class:`OffloadHarness` (imports vLLM; set ``VLLM_TARGET_DEVICE=cpu`` first on a CPU machine)."""
    for k, val in setup.VLLM_ENV.items():
        os.environ.setdefault(k, val)
    return OffloadHarness(opts, v)
