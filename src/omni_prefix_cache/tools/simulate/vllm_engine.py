"""``simulate --engine vllm``: the simulation's workload through vLLM's real v1 scheduler and InputBatch.

The real ``vllm.v1.core.sched.scheduler.Scheduler`` (KV cache manager,
automatic prefix caching, chunked prefill, preemption) decides every step;
a real ``vllm.v1.worker.gpu_input_batch.InputBatch`` is kept current the way
the GPU model runner's ``_update_states`` keeps it (finished and unscheduled
rows removed, new and resumed rows added, condense, decode-first reorder),
and the project's :class:`FullAttentionGroupView` reads it. The forward,
the oracle, the lagged materialize and the leak checks are the simulation's.
No weights and no GPU: the model directory holds only a tiny ``config.json``
and a fake ``ModelRunnerOutput`` returns the next token of each request that
finished its known tokens (none for a request still in chunked prefill).

vLLM is imported lazily (:func:`load_vllm`); it is never a dependency of
the library. Tested against vLLM 0.33.0 (``.ci/setup-vllm.sh``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from omni_prefix_cache.interface import PrefixCacheConfig
from omni_prefix_cache.tools.simulate.engine import ProgressFn, SimConfig, SimResult, Simulation
from omni_prefix_cache.tools.simulate.scheduler import StepPlan
from omni_prefix_cache.tools.simulate.vllm_batch import RunnerBatch, VllmGroupView
from omni_prefix_cache.tools.simulate.vllm_scheduler import DriverRequest, VllmScheduler, VllmSchedulerStats
from omni_prefix_cache.tools.simulate.vllm_setup import VLLM_ENV, VLLM_NAMES, KvBlockStats, VllmOptions, load_vllm
from omni_prefix_cache.tools.simulate.workload import RequestSpec

__all__ = [
    "VLLM_ENV",
    "VLLM_NAMES",
    "DriverRequest",
    "KvBlockStats",
    "RunnerBatch",
    "VllmGroupView",
    "VllmOptions",
    "VllmScheduler",
    "VllmSchedulerStats",
    "VllmSimResult",
    "VllmSimulation",
    "load_vllm",
    "run_vllm_seed_simulation",
]


@dataclass
class VllmSimResult(SimResult):
    """A simulation result, plus the vLLM setup and timings."""

    engine: str = "vllm"
    vllm_version: str = ""
    runner: str = ""
    vllm_import_s: float = 0.0
    api: str = "seed"  # "events": the adapter, the engine helper and two consumers (vllm_events)
    events: dict[str, Any] = field(default_factory=dict)  # vllm_delivery.DeliveryCounts of an events run

    def extra_rows(self) -> list[tuple[str, str]]:
        st, blocks = self.scheduler, self.allocator
        return [
            ("engine", f"vLLM {self.vllm_version} scheduler + InputBatch, runner {self.runner}, {self.api} API"),
            (
                "resumed via cached reqs / via new reqs",
                f"{st.get('resumed_in_cached', 0)} / {st.get('resumed_in_new', 0)}",
            ),
            (
                "same-step id reuse / abort retries",
                f"{st.get('same_step_id_reuse', 0)} / {st.get('abort_resubmits', 0)}",
            ),
            ("steps the batch reorder changed", str(st.get("reordered_steps", 0))),
            ("KV blocks fresh / recycled", f"{blocks.get('fresh_blocks', 0)} / {blocks.get('recycled', 0)}"),
            *self._event_rows(),
        ]

    def _event_rows(self) -> list[tuple[str, str]]:
        ev = self.events
        if not ev:
            return []
        delivered = " / ".join(f"{c} {n}" for c, n in ev["delivered"].items())
        return [
            (
                "RESUMED events (with hit / not block aligned)",
                f"{ev['resumed']} ({ev['resumed_with_hit']} / {ev['resumed_unaligned']})",
            ),
            (
                "resumes recovering (positions) / shrinking (replayed)",
                f"{ev['recovered']} ({ev['recovered_positions']}) / {ev['shrinking']} ({ev['replayed_positions']})",
            ),
            (
                "discard preemptions / recovered after a discard",
                f"{ev['discard_preemptions']} / {ev['recovered_after_discard']}",
            ),
            ("outputs fenced (owner changed) / same-step reuse", f"{ev['fenced']} / {ev['same_step_reuse_events']}"),
            ("positions delivered per consumer", f"{delivered} (talker lag up to {ev['max_consumer_lag']} steps)"),
        ]

    def extra_summary(self) -> dict[str, Any]:
        out = {"engine": self.engine, "vllm_version": self.vllm_version, "runner": self.runner, "api": self.api}
        return out | ({"events": self.events} if self.events else {})


class VllmSimulation(Simulation):
    """The simulation's engine loop with vLLM's scheduler and InputBatch in place of the look-alikes."""

    sched: VllmScheduler

    def __init__(
        self,
        cfg: SimConfig,
        opts: VllmOptions | None = None,
        *,
        manager_factory: Callable[..., Any] | None = None,
        progress: ProgressFn | None = None,
        trace: list[RequestSpec] | None = None,
    ) -> None:
        super().__init__(cfg, manager_factory=manager_factory, progress=progress)
        self.opts = opts or VllmOptions()
        t0 = time.perf_counter()
        self.v = load_vllm()
        import_s = time.perf_counter() - t0
        self.sched = VllmScheduler(cfg, self.opts, self.v, trace)
        vc = self.sched.vllm_config
        max_len = vc.model_config.max_model_len
        self.runner = RunnerBatch(cfg, self.opts, self.v, max_len, self.sched.kv_cache_config, vc)
        self.sched.on_sampled = self.runner.record_sampled
        self.view = VllmGroupView(self.runner.input_batch, cfg.block_size, self.sched.group)
        base = self.result
        self.result = VllmSimResult(
            config=base.config | {"vllm": asdict(self.opts)},
            mode=base.mode,
            vllm_version=str(self.v.vllm.__version__),
            runner="v2 (resumed among new)" if self.opts.resumed_as_new else "v1 (resumed_req_ids)",
            vllm_import_s=import_s,
        )

    def _batch_order(self, plan: StepPlan[DriverRequest]) -> list[str]:
        order = self.runner.update_states(plan.output)
        self.view.set_step(order, {}, {})
        self._check_rows(plan, order)
        return order

    def _check_rows(self, plan: StepPlan[DriverRequest], order: list[str]) -> None:
        """The mirrored batch against vLLM's own state: the scheduled requests, each row's computed
        tokens and, per KV cache group, block ids as the KV cache manager holds them (a wrong mirror
        would pass wrong slots). Where vLLM freed a block of another group (a sliding window's,
        its null block 0 in its place) the runner's row keeps the old id, as vLLM's runner does;
        the keyed group's row must match exactly."""
        starts = {e.req.req_id: e.start for e in plan.entries}
        if sorted(order) != sorted(starts):
            raise AssertionError(f"step {plan.step}: input batch rows {order} are not the scheduled {sorted(starts)}")
        batch, kv, keyed = self.runner.input_batch, self.sched.sched.kv_cache_manager, self.sched.group
        tables = batch.block_table.block_tables
        for rid in order:
            row = batch.req_id_to_index[rid]
            computed = int(batch.num_computed_tokens_cpu[row])
            per_group = kv.get_block_ids(rid)
            for g, table in enumerate(tables):
                got = table.block_table.np[row, : table.num_blocks_per_row[row]].tolist()
                want = list(per_group[g])
                same = got == want or (
                    g != keyed and len(got) == len(want) and all(w in (0, b) for b, w in zip(got, want))
                )
                if computed != starts[rid] or not same:
                    raise AssertionError(
                        f"step {plan.step}: row {row} ({rid!r}) has computed={computed} group {g} blocks={got}; "
                        f"vLLM has computed={starts[rid]} blocks={want}"
                    )

    def _prefix_cache_config(self) -> PrefixCacheConfig:
        """The simulation's config, keyed by the group the stage gate picked on vLLM's configs."""
        gated = self.sched.prefix_cache_config
        config = replace(self.cfg.prefix_cache_config(), kv_cache_group_index=gated.kv_cache_group_index)
        if (gated.num_blocks, gated.block_size) != (config.num_blocks, config.block_size):
            raise AssertionError(f"the stage gate sized the cache {gated}, the simulation {config}")
        return config

    def run(self) -> SimResult:
        try:
            res = super().run()
        finally:
            self.sched.close()
        self.sched.stats.reordered_steps = self.runner.reordered
        res.scheduler = asdict(self.sched.stats)
        return res


def run_vllm_seed_simulation(
    cfg: SimConfig,
    opts: VllmOptions | None = None,
    *,
    manager_factory: Callable[..., Any] | None = None,
    progress: ProgressFn | None = None,
    trace: list[RequestSpec] | None = None,
) -> VllmSimResult:
    """Run the seed-era loop on vLLM's scheduler and InputBatch (never raises for manager errors;
    see ``error``). ``vllm_events.run_vllm_simulation`` chooses between it and the event API."""
    res = VllmSimulation(cfg, opts, manager_factory=manager_factory, progress=progress, trace=trace).run()
    assert isinstance(res, VllmSimResult)
    return res
