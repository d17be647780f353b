"""A threaded engine loop: the committer thread writes the pool, an output thread
builds each step's outputs while the engine already runs the next one.

Four requests share a two-block system prompt; the later ones are prefix hits.
Each prefills, decodes a few tokens and finishes. The engine helper orders the
output builders; each delivers to the next stage only the positions it has not
received, and the output thread checks that every request's delivered rows are
exactly the stand-in model's, each position once and in order.

Run: python examples/threaded_lagged.py   (exits 1 if a row is wrong)
"""

import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from omni_prefix_cache import ModelCachePolicy, OmniPrefixCacheUnmatchError, PrefixCacheConfig, StageCacheOutputs
from omni_prefix_cache.engine_helper import PrefixCacheEngineHelper
from omni_prefix_cache.group_view import FullAttentionGroupView
from omni_prefix_cache.manager import OmniPrefixCacheManager

BLOCK_SIZE, HIDDEN, DECODE_STEPS = 4, 8, 3
SYSTEM = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks, shared by every request


@dataclass
class NewRequest:
    req_id: str
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewRequest] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)


class InputBatch:
    def __init__(self) -> None:
        self.block_table = [SimpleNamespace(block_size=BLOCK_SIZE, block_table=SimpleNamespace(cpu=None))]
        self.set_rows({})

    def set_rows(self, rows: dict[str, tuple[int, list[int]]]) -> None:
        self.req_ids = list(rows)
        self.req_id_to_index = {r: i for i, r in enumerate(rows)}
        self.num_computed_tokens_cpu = torch.tensor([c for c, _ in rows.values()], dtype=torch.int32)
        width = max([1, *(len(b) for _, b in rows.values())])
        table = torch.zeros((max(1, len(rows)), width), dtype=torch.int32)
        for i, (_, blocks) in enumerate(rows.values()):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.block_table[0].block_table.cpu = table


def forward(tokens: list[int], start: int) -> torch.Tensor:
    return torch.tensor([[tok + pos / 100 + j for j in range(HIDDEN)] for pos, tok in enumerate(tokens, start)])


@dataclass
class Request:
    req_id: str
    tokens: list[int]  # prompt, then generated tokens appended
    blocks: list[int]
    computed: int = 0
    decoded: int = 0


class OutputThread(threading.Thread):
    """Runs the helper's output builders in the order the engine handed them out
    (vLLM's async output thread) and checks what each request received."""

    def __init__(self) -> None:
        super().__init__(name="output-thread")
        self.jobs: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self.received: dict[str, list[torch.Tensor]] = {}  # the next stage's rows, per request
        self.errors: list[str] = []

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                job()
            except OmniPrefixCacheUnmatchError as exc:
                self.errors.append(str(exc))

    def publish(self, payload: dict[str, torch.Tensor], live: frozenset[str]) -> None:
        for rid in live:  # under the manager's lock: only keep references
            self.received.setdefault(rid, []).append(payload[rid])


def copy_rows(view: StageCacheOutputs) -> dict[str, torch.Tensor]:
    """The output thread's payload: a copy of each request's undelivered rows (no lock held)."""
    return {rid: rows.clone() for rid, rows in (view.hidden_states or {}).items()}


def main() -> int:
    config = PrefixCacheConfig(num_blocks=32, block_size=BLOCK_SIZE, staging_capacity_tokens=64)
    batch = InputBatch()
    mgr = OmniPrefixCacheManager(config, eager=False)
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True))
    cache = PrefixCacheEngineHelper(mgr, FullAttentionGroupView(batch, block_size=BLOCK_SIZE), consumer="talker")
    worker = OutputThread()
    worker.start()
    prompts: dict[str, list[int]] = {}
    free_blocks = list(range(2, config.num_blocks))  # 0 and 1 hold the system prompt
    arrivals = {0: ["r0"], 1: ["r1", "r2"], 3: ["r3"]}
    running: dict[str, Request] = {}
    finished: set[str] = set()
    step = 0
    try:
        while step == 0 or running or finished:
            new_reqs = []
            for i, rid in enumerate(arrivals.get(step, [])):
                prompt = [*SYSTEM, 20 + step, 30 + i, 40, 50]  # system prompt + a block of its own
                req = Request(rid, prompt, [0, 1, free_blocks.pop(0)])
                if rid != "r0":  # the system prompt's blocks are cached by now: a prefix hit
                    req.computed = len(SYSTEM)
                new_reqs.append(NewRequest(rid, req.computed, (list(req.blocks),)))
                running[rid] = prompts[rid] = req
            sched: dict[str, int] = {}
            for req in running.values():
                sched[req.req_id] = len(req.tokens) - req.computed  # prefill the rest, or decode one
                if len(req.tokens) + 1 > len(req.blocks) * BLOCK_SIZE:
                    req.blocks.append(free_blocks.pop(0))
            cache.begin_step(SchedulerOutput(sched, new_reqs, finished))
            finished = set()
            if not sched:
                break
            batch.set_rows({r.req_id: (r.computed, r.blocks) for r in running.values()})
            hidden = torch.cat([forward(r.tokens[r.computed :], r.computed) for r in running.values()])
            saved = cache.save(hidden, None, num_tokens_unpadded=hidden.shape[0], num_tokens_padded=hidden.shape[0])
            assert saved is not None
            # Built on the output thread, in step order, while the next step runs.
            worker.jobs.put(cache.output_builder(saved, copy_rows, worker.publish))
            for req in list(running.values()):
                req.computed = len(req.tokens)
                if req.decoded == DECODE_STEPS:
                    finished.add(req.req_id)
                    del running[req.req_id]
                else:
                    req.tokens.append(60 + req.decoded)  # the sampled token
                    req.decoded += 1
            step += 1
    finally:
        worker.jobs.put(None)
        worker.join()
        stats = mgr.stats()
        mgr.shutdown()

    checked = 0
    for rid, req in prompts.items():
        got = torch.cat(worker.received.get(rid, [torch.empty(0, HIDDEN)]))
        want = forward(req.tokens[: req.computed], 0)  # every computed position, once, in order
        checked += got.shape[0]
        if not torch.equal(got, want):
            worker.errors.append(f"request {rid}: received {got.shape[0]} rows, not its {want.shape[0]} positions")
    for line in worker.errors:
        print(line)
    ok = not worker.errors and checked > 0 and stats["hit_requests"] == 3
    print(f"{step} steps, {checked} rows delivered and checked, {stats['hit_tokens']} prefix tokens from the cache")
    print("threaded_lagged: OK" if ok else "threaded_lagged: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
