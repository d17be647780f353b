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

import importlib
import json
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import torch

from omni_prefix_cache.tools.simulate.batch import SimGroupView
from omni_prefix_cache.tools.simulate.engine import ProgressFn, SimConfig, SimResult, Simulation
from omni_prefix_cache.tools.simulate.rows import PrefixHashes, chain_hash, mix64
from omni_prefix_cache.tools.simulate.scheduler import Scheduled, SchedulerStats, StepPlan
from omni_prefix_cache.tools.simulate.workload import RequestSpec, generate_trace

# Without VLLM_TARGET_DEVICE=cpu, VllmConfig cannot infer a device on a machine with no GPU.
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}

# A tiny model config: the scheduler and the input batch only need its sizes.
_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}


# Where each vLLM name the driver (and tests_vllm) uses lives in vLLM 0.33.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "vllm.config": ("CacheConfig", "ModelConfig", "SchedulerConfig", "VllmConfig"),
    "vllm.sampling_params": ("SamplingParams",),
    "vllm.utils.hashing": ("get_hash_fn_by_name",),
    "vllm.v1.attention.backends.utils": ("reorder_batch_to_split_decodes_and_prefills",),
    "vllm.v1.core.kv_cache_utils": ("get_request_block_hasher", "init_none_hash"),
    "vllm.v1.core.sched.output": ("CachedRequestData", "NewRequestData", "SchedulerOutput"),
    "vllm.v1.core.sched.scheduler": ("Scheduler",),
    "vllm.v1.kv_cache_interface": ("FullAttentionSpec", "KVCacheConfig", "KVCacheGroupSpec"),
    "vllm.v1.outputs": ("ModelRunnerOutput",),
    "vllm.v1.request": ("Request", "RequestStatus"),
    "vllm.v1.structured_output": ("StructuredOutputManager",),
    "vllm.v1.worker.block_table": ("BlockTable", "MultiGroupBlockTable"),
    "vllm.v1.worker.gpu_input_batch": ("CachedRequestState", "InputBatch"),
}


def load_vllm() -> SimpleNamespace:
    """Import the vLLM names the driver uses (8-30 s the first time); ImportError without vLLM."""
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    try:
        ns = SimpleNamespace(vllm=importlib.import_module("vllm"))
    except ImportError as exc:
        raise ImportError(
            f"vLLM is not importable ({exc}); build its environment with `bash .ci/setup-vllm.sh` "
            "and run .venv-vllm/bin/omni-prefix-cache"
        ) from exc
    for module, names in VLLM_NAMES.items():
        mod = importlib.import_module(module)
        for name in names:
            setattr(ns, name, getattr(mod, name))
    return ns


@dataclass(frozen=True)
class VllmOptions:
    """How the real vLLM pieces are set up (the workload and manager come from :class:`SimConfig`)."""

    # Model Runner V2 reporting: a resumed (preempted) request comes back among the new
    # requests instead of the cached ones with ``resumed_req_ids`` (the 0.33 default).
    resumed_as_new: bool = False
    # The decode-first batch reorder some attention backends ask for (``_may_reorder_batch``).
    reorder_threshold: int | None = 1
    vocab: int = 32000


@dataclass
class VllmSchedulerStats(SchedulerStats):
    """The simulation's counters plus what only the real vLLM reports."""

    resumed_in_cached: int = 0  # resumed requests reported via scheduled_cached_reqs.resumed_req_ids
    resumed_in_new: int = 0  # ... reported among scheduled_new_reqs (Model Runner V2)
    same_step_id_reuse: int = 0  # an id both in finished_req_ids and scheduled_new_reqs of one step
    abort_resubmits: int = 0  # aborted requests resubmitted under the same id
    reordered_steps: int = 0  # steps whose batch the decode-first reorder changed
    chunked_prefill_steps: int = 0  # request-steps that returned no token (prefill not done)


@dataclass
class KvBlockStats:
    """vLLM block pool activity seen by the driver."""

    fresh_blocks: int = 0  # blocks newly given to a request (not prefix hits)
    recycled: int = 0  # fresh blocks that another request held before
    evicted_hashes: int = 0  # cached blocks whose hash vLLM dropped to reuse them
    null_block_in_table: int = 0  # block 0 (vLLM's null block) seen among a request's blocks


class DriverRequest:
    """One incarnation of a request id: its spec, its vLLM request and its prefix hashes."""

    def __init__(self, spec: RequestSpec, vreq: Any, seed: int, incarnation: int) -> None:
        self.spec = spec
        self.req_id = spec.req_id
        self.vreq = vreq
        self.incarnation = incarnation
        self.salt = chain_hash(seed + 1 + incarnation, spec.req_id.encode())
        self.hashes = PrefixHashes(len(spec.prompt) + spec.max_output + 8)
        self.abort_step = None if spec.abort_after is None else spec.arrival_step + spec.abort_after
        self.preempted = False

    def hash_upto(self, end: int) -> None:
        """Extend the prefix hashes to position ``end`` from vLLM's own token ids."""
        have = len(self.hashes)
        if end > have:
            self.hashes.extend(self.vreq.all_token_ids[have:end])


class VllmScheduler:
    """The simulation's scheduler interface over vLLM's real v1 Scheduler.

    Admits the trace's requests (a streamed prompt arrives whole), aborts
    them (resubmitting the prompt under the same id in the same step),
    queues two-turn follow-ups (some under the finished turn's id), and
    feeds a fake ``ModelRunnerOutput`` back each step.
    """

    def __init__(
        self, cfg: SimConfig, opts: VllmOptions, v: SimpleNamespace, trace: list[RequestSpec] | None = None
    ) -> None:
        """``trace`` replaces the workload generated from ``cfg`` (directed tests)."""
        self.cfg, self.opts, self.v = cfg, opts, v
        self.stats = VllmSchedulerStats()
        self.alloc = SimpleNamespace(stats=KvBlockStats())
        self.block_size = cfg.block_size
        self._model_dir = tempfile.TemporaryDirectory(prefix="omni-vllm-model-")
        self.vllm_config = self._vllm_config()
        self.kv_cache_config = v.KVCacheConfig(
            num_blocks=cfg.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[v.KVCacheGroupSpec(["model.layers.0.self_attn.attn"], self._attn_spec())],
        )
        self.sched = v.Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=v.StructuredOutputManager(self.vllm_config),
            block_size=cfg.block_size,
        )
        if opts.resumed_as_new:
            self.sched.use_v2_model_runner = True
        # The block hasher as EngineCore sets it up (sha256 by default).
        hash_fn = v.get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        v.init_none_hash(hash_fn)
        self._hasher = v.get_request_block_hasher(cfg.block_size, hash_fn)
        self._count_evictions()
        if trace is None:
            trace = generate_trace(cfg.workload, cfg.seed)
        self._arrivals: deque[RequestSpec] = deque(sorted(trace, key=_arrival))
        self._later: list[RequestSpec] = []  # follow-ups
        self._retries: list[RequestSpec] = []  # aborted requests resubmitted in the abort's step
        self.reqs: dict[str, DriverRequest] = {}
        self._incarnations = 0
        self._manager_live: set[str] = set()  # mirrors the manager's rule: new and not yet finished
        self._owner: dict[int, int] = {}  # block id -> incarnation that last got it fresh
        self._capacity = (cfg.num_blocks - 1) * cfg.block_size  # block 0 is vLLM's null block
        self.on_sampled: Callable[[dict[str, int]], None] | None = None  # the runner's bookkeeping

    # ------------------------------------------------------------ setup

    def _vllm_config(self) -> Any:
        v, cfg = self.v, self.cfg
        path = os.path.join(self._model_dir.name, "config.json")
        with open(path, "w") as f:
            json.dump(_MODEL_CONFIG | {"vocab_size": self.opts.vocab}, f)
        max_len = cfg.num_blocks * cfg.block_size
        model = v.ModelConfig(model=self._model_dir.name, skip_tokenizer_init=True, max_model_len=max_len)
        cache = v.CacheConfig(block_size=cfg.block_size, enable_prefix_caching=True)
        cache.num_gpu_blocks = cfg.num_blocks
        sched = v.SchedulerConfig(
            max_num_batched_tokens=cfg.token_budget,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            # Priority only to let a client's retry jump the queue (see _abort); all else is 0, FCFS.
            policy="priority",
        )
        return v.VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched)

    def _attn_spec(self) -> Any:
        return self.v.FullAttentionSpec(
            block_size=self.cfg.block_size, num_kv_heads=4, head_size=16, dtype=torch.float32
        )

    def _count_evictions(self) -> None:
        # NOTE: wraps a private BlockPool method on this instance only, to count block recycling
        # that dropped a cached hash; absent in another vLLM version, the counter stays 0.
        pool = self.sched.kv_cache_manager.block_pool
        inner = getattr(pool, "_maybe_evict_cached_block", None)
        if inner is None:
            return
        stats = self.alloc.stats

        def counting(block: Any) -> bool:
            evicted = bool(inner(block))
            stats.evicted_hashes += evicted
            return evicted

        pool._maybe_evict_cached_block = counting

    def close(self) -> None:
        self._model_dir.cleanup()

    # ------------------------------------------------------------ lifecycle

    @property
    def idle(self) -> bool:
        return not (self._arrivals or self._later or self.sched.requests)

    @property
    def running(self) -> list[Any]:
        return list(self.sched.running)

    @property
    def waiting(self) -> list[Any]:
        return [r for r in self.sched.requests.values() if r not in self.sched.running]

    def progress(self) -> float:
        st = self.stats
        known = st.arrived + st.rejected + len(self._arrivals) + len(self._later)
        return (st.finished + st.aborted + st.rejected) / known if known else 1.0

    def live_requests(self) -> list[DriverRequest]:
        return [self.reqs[r] for r in self.sched.requests]

    def _arrive(self, spec: RequestSpec, priority: int = 0) -> None:
        if len(spec.prompt) + spec.max_output > self._capacity:
            self.stats.rejected += 1  # longer than the whole KV cache
            return
        v = self.v
        params = v.SamplingParams(max_tokens=spec.max_output, ignore_eos=True, temperature=0.0)
        vreq = v.Request(spec.req_id, list(spec.prompt), params, None, priority=priority, block_hasher=self._hasher)
        self._incarnations += 1
        self.stats.reused_ids += spec.req_id in self.reqs
        self.reqs[spec.req_id] = DriverRequest(spec, vreq, self.cfg.seed, self._incarnations)
        self.sched.add_request(vreq)
        self.stats.arrived += 1
        self.stats.duplicates += spec.duplicate_of is not None

    def _next_turn(self, req: DriverRequest, step: int) -> None:
        f = req.spec.followup
        if f is None:
            return
        self._later.append(
            RequestSpec(
                req_id=req.req_id if f.reuse_id else f"{req.req_id}.2",
                arrival_step=step + 1 + f.delay,
                segments=(tuple(req.vreq.all_token_ids) + f.extra,),
                max_output=f.max_output,
            )
        )
        self.stats.followups += 1

    def _abort(self, req: DriverRequest, step: int, *, resubmit: bool) -> None:
        self.sched.finish_requests(req.req_id, self.v.RequestStatus.FINISHED_ABORTED)
        self.stats.aborted += 1
        if resubmit:
            # The client retries at once under the same id: in this step's output the id is both
            # finished and (once admitted) new, and the retry hits the blocks the abort just freed.
            self._retries.append(RequestSpec(req.req_id, step, (req.spec.prompt,), req.spec.max_output))
            self.stats.abort_resubmits += 1

    def abort_all(self, step: int) -> None:
        for req in self.live_requests():
            self._abort(req, step, resubmit=False)
        self._arrivals.clear()
        self._later.clear()

    def _start_step(self, step: int) -> None:
        for req in self.live_requests():
            if req.abort_step is not None and req.abort_step <= step:
                self._abort(req, step, resubmit=True)
        while self._arrivals and self._arrivals[0].arrival_step <= step:
            self._arrive(self._arrivals.popleft())
        for spec in self._retries:
            self._arrive(spec, priority=-1)  # ahead of the queue, so it is admitted in this step
        self._retries.clear()
        due = [s for s in self._later if s.arrival_step <= step]
        for s in due:
            self._later.remove(s)
            self._arrive(s)

    # ------------------------------------------------------------ one step

    def schedule(self, step: int) -> StepPlan[DriverRequest]:
        """Run vLLM's ``schedule()``; return the entries in scheduling order with what the oracle needs."""
        self._start_step(step)
        so = self.sched.schedule()
        st = self.stats
        finished = set(so.finished_req_ids)
        new_ids = {n.req_id for n in so.scheduled_new_reqs}
        st.same_step_id_reuse += len(finished & new_ids)
        st.preemptions += len(so.preempted_req_ids or ())
        for rid in so.preempted_req_ids or ():
            self.reqs[rid].preempted = True
        cached = so.scheduled_cached_reqs
        starts: dict[str, int] = {n.req_id: int(n.num_computed_tokens) for n in so.scheduled_new_reqs}
        starts.update({r: int(c) for r, c in zip(cached.req_ids, cached.num_computed_tokens)})
        fresh: dict[str, list[int]] = {}
        hit_blocks: dict[str, list[int]] = {}
        for n in so.scheduled_new_reqs:
            blocks, k = list(n.block_ids[0]), starts[n.req_id] // self.block_size
            hit_blocks[n.req_id], fresh[n.req_id] = blocks[:k], blocks[k:]
        for rid, nb in zip(cached.req_ids, cached.new_block_ids):
            blocks = [] if nb is None else list(nb[0])
            if rid in cached.resumed_req_ids:  # the resumed row is replaced: its prefix came from the cache
                k = starts[rid] // self.block_size
                hit_blocks[rid], blocks = blocks[:k], blocks[k:]
            fresh[rid] = blocks
        self._count_fresh(fresh, hit_blocks)
        entries: list[Scheduled[DriverRequest]] = []
        by_new = {n.req_id: n for n in so.scheduled_new_reqs}
        for rid, n in so.num_scheduled_tokens.items():
            req, start = self.reqs[rid], starts[rid]
            req.hash_upto(start + n)
            new_entry = by_new.get(rid)
            manager_hit = 0
            resumed = rid in cached.resumed_req_ids
            if new_entry is not None:
                if rid in self._manager_live and rid not in finished:
                    resumed = resumed or req.preempted  # Model Runner V2: resumed among the new
                    st.resumed_in_new += req.preempted
                    st.stream_reentries += not req.preempted
                elif start > 0:
                    manager_hit = start
                    st.hits += 1
                    st.hit_tokens += start
                    others = {b for r, bs in fresh.items() if r != rid for b in bs}
                    st.same_step_hits += any(b in others for b in hit_blocks.get(rid, ()))
            else:
                st.resumed_in_cached += resumed
            if resumed:
                st.resumes += 1
                st.resumes_with_hit += start > 0
                st.live_prefix_tokens += start
                req.preempted = False
            entries.append(Scheduled(req, n, start, new_entry, manager_hit))
        self._manager_live -= finished
        self._manager_live |= new_ids
        if not entries:
            st.empty_steps += 1
        st.max_running = max(st.max_running, len(self.sched.running))
        return StepPlan(step, entries, so)

    def _count_fresh(self, fresh: dict[str, list[int]], hits: dict[str, list[int]]) -> None:
        bs = self.alloc.stats
        for rid, blocks in fresh.items():
            inc = self.reqs[rid].incarnation
            for b in blocks:
                bs.fresh_blocks += 1
                bs.recycled += self._owner.get(b, inc) != inc
                self._owner[b] = inc
            bs.null_block_in_table += sum(1 for b in [*blocks, *hits.get(rid, ())] if b == 0)

    def sampled_tokens(self, plan: StepPlan[DriverRequest]) -> dict[str, int]:
        """The fake forward's sampled token per request that computed all its known tokens."""
        out: dict[str, int] = {}
        for e in plan.entries:
            vreq = e.req.vreq
            if e.start + e.n < vreq.num_tokens:
                self.stats.chunked_prefill_steps += 1
                continue  # still in chunked prefill: vLLM expects no token
            out[e.req.req_id] = mix64(e.req.salt ^ (vreq.num_tokens * 0x9E3779B1)) % self.opts.vocab
        return out

    def update(self, plan: StepPlan[DriverRequest]) -> None:
        """Feed the fake ``ModelRunnerOutput`` to ``update_from_output``; queue follow-ups of finished turns."""
        sampled = self.sampled_tokens(plan)
        if self.on_sampled is not None:
            self.on_sampled(sampled)
        ids = [e.req.req_id for e in plan.entries]
        out = self.v.ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in ids],
        )
        for e in plan.entries:
            if e.start >= e.req.vreq.num_prompt_tokens:
                self.stats.decode_tokens += e.n
            else:
                self.stats.prefill_tokens += e.n
        self.sched.update_from_output(plan.output, out)
        for e in plan.entries:
            if self.sched.requests.get(e.req.req_id) is not e.req.vreq:
                self.stats.finished += 1
                self._next_turn(e.req, plan.step)


def _arrival(spec: RequestSpec) -> int:
    return spec.arrival_step


class RunnerBatch:
    """A real ``InputBatch`` kept current as vLLM's GPU model runner does in ``_update_states``.

    Only the parts that decide row order, block table rows and computed
    token counts are mirrored; sampling metadata is left as ``add_request``
    sets it.
    """

    def __init__(self, cfg: SimConfig, opts: VllmOptions, v: SimpleNamespace, max_model_len: int) -> None:
        self.v, self.opts = v, opts
        self.requests: dict[str, Any] = {}  # req id -> CachedRequestState
        self.input_batch = v.InputBatch(
            max_num_reqs=cfg.max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=cfg.token_budget,
            device=torch.device("cpu"),
            vocab_size=opts.vocab,
            block_sizes=[cfg.block_size],
            max_num_blocks_per_req=[cfg.num_blocks],
        )
        self.reordered = 0

    def _state(self, new: Any) -> Any:
        return self.v.CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            mm_features=new.mm_features,
            sampling_params=new.sampling_params,
            generator=None,
            block_ids=tuple(list(g) for g in new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=[],
            lora_request=new.lora_request,
        )

    def update_states(self, so: Any) -> list[str]:
        """Apply one scheduler output; return the batch's request ids in row order."""
        batch = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        # An id both finished and new is an aborted request resubmitted under the same id:
        # two distinct requests (vLLM's NOTE in _update_states).
        for rid in so.finished_req_ids:
            batch.remove_request(rid)
        cached = so.scheduled_cached_reqs
        unscheduled = set(batch.req_id_to_index) - (set(so.num_scheduled_tokens) - set(cached.resumed_req_ids))
        for rid in unscheduled:
            batch.remove_request(rid)
        to_add: list[Any] = []
        for new in so.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None:
                # Streaming continuation, or (Model Runner V2) a resumed request: same id, new row.
                batch.remove_request(new.req_id)
                state.block_ids = tuple(list(g) for g in new.block_ids)
                state.num_computed_tokens = new.num_computed_tokens
            else:
                state = self.requests[new.req_id] = self._state(new)
            to_add.append(state)
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            index = batch.req_id_to_index.get(rid)
            if rid in cached.resumed_req_ids:
                if index is not None or new_blocks is None:
                    raise AssertionError(f"resumed request {rid!r}: row {index}, new blocks {new_blocks}")
                state.block_ids = tuple(list(g) for g in new_blocks)
            elif new_blocks is not None:
                for ids, more in zip(state.block_ids, new_blocks):
                    ids.extend(more)
            if index is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = state.num_computed_tokens
            if new_blocks is not None:
                batch.block_table.append_row(new_blocks, index)
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        if self.opts.reorder_threshold is not None and batch.req_ids:
            self.reordered += bool(
                self.v.reorder_batch_to_split_decodes_and_prefills(
                    batch, so, decode_threshold=self.opts.reorder_threshold
                )
            )
        batch.refresh_metadata()
        return [r for r in batch.req_ids if r is not None]

    def record_sampled(self, sampled: dict[str, int]) -> None:
        """The runner's bookkeeping after sampling: append each token to its request and row."""
        batch = self.input_batch
        for rid, tok in sampled.items():
            state = self.requests.get(rid)
            if state is None:
                continue
            state.output_token_ids.append(tok)
            index = batch.req_id_to_index.get(rid)
            if index is not None:
                end = int(batch.num_tokens_no_spec[index])
                batch.token_ids_cpu[index, end] = tok
                batch.is_token_ids[index, end] = True
                batch.num_tokens_no_spec[index] = end + 1


class VllmGroupView(SimGroupView):
    """The project's group view over the real InputBatch, counting calls off the engine thread."""

    def __init__(self, input_batch: Any, block_size: int) -> None:
        import threading

        from omni_prefix_cache.group_view import FullAttentionGroupView

        self.block_size = block_size
        self.input_batch = input_batch
        self._inner = FullAttentionGroupView(input_batch, block_size)
        self._engine_thread = threading.get_ident()
        self.off_thread_calls = 0

    def set_step(self, order: Any, blocks: Any, computed: Any) -> None:
        import threading

        self._engine_thread = threading.get_ident()  # the InputBatch itself is already current


@dataclass
class VllmSimResult(SimResult):
    """A simulation result, plus the vLLM setup and timings."""

    engine: str = "vllm"
    vllm_version: str = ""
    runner: str = ""
    vllm_import_s: float = 0.0

    def extra_rows(self) -> list[tuple[str, str]]:
        st, blocks = self.scheduler, self.allocator
        return [
            ("engine", f"vLLM {self.vllm_version} scheduler + InputBatch, runner {self.runner}"),
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
        ]

    def extra_summary(self) -> dict[str, Any]:
        return {"engine": self.engine, "vllm_version": self.vllm_version, "runner": self.runner}


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
        self.runner = RunnerBatch(cfg, self.opts, self.v, self.sched.vllm_config.model_config.max_model_len)
        self.sched.on_sampled = self.runner.record_sampled
        self.view = VllmGroupView(self.runner.input_batch, cfg.block_size)
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
        tokens and block ids as the KV cache manager holds them (a wrong mirror would pass wrong slots)."""
        starts = {e.req.req_id: e.start for e in plan.entries}
        if sorted(order) != sorted(starts):
            raise AssertionError(f"step {plan.step}: input batch rows {order} are not the scheduled {sorted(starts)}")
        batch, kv = self.runner.input_batch, self.sched.sched.kv_cache_manager
        table = batch.block_table[0]
        for rid in order:
            row = batch.req_id_to_index[rid]
            computed = int(batch.num_computed_tokens_cpu[row])
            got = table.block_table.np[row, : table.num_blocks_per_row[row]].tolist()
            want = list(kv.get_block_ids(rid)[0])
            if computed != starts[rid] or got != want:
                raise AssertionError(
                    f"step {plan.step}: row {row} ({rid!r}) has computed={computed} blocks={got}; "
                    f"vLLM has computed={starts[rid]} blocks={want}"
                )

    def run(self) -> SimResult:
        try:
            res = super().run()
        finally:
            self.sched.close()
        self.sched.stats.reordered_steps = self.runner.reordered
        res.scheduler = asdict(self.sched.stats)
        return res


def run_vllm_simulation(
    cfg: SimConfig,
    opts: VllmOptions | None = None,
    *,
    manager_factory: Callable[..., Any] | None = None,
    progress: ProgressFn | None = None,
    trace: list[RequestSpec] | None = None,
) -> VllmSimResult:
    """Run one simulation on vLLM's scheduler and InputBatch (never raises for manager errors; see ``error``)."""
    res = VllmSimulation(cfg, opts, manager_factory=manager_factory, progress=progress, trace=trace).run()
    assert isinstance(res, VllmSimResult)
    return res
