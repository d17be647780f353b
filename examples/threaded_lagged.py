"""A threaded engine loop: the committer thread writes the pool, a second thread
materializes each step while the engine already runs the next one.

Four requests share a two-block system prompt; the later ones are prefix hits.
Each prefills, decodes a few tokens and finishes. The materializer thread checks
every request's rows (cached prefix + new rows) against the stand-in model.

Run: python examples/threaded_lagged.py   (exits 1 if a row is wrong)
"""

import queue
import sys
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from omni_prefix_cache import ModelCachePolicy, OmniPrefixCacheUnmatchError, PrefixCacheConfig
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
    hit: int = 0  # prefix tokens served from the cache on its first step


class Materializer(threading.Thread):
    """Consumes step ids one step behind the engine and checks the rows."""

    def __init__(self, mgr: OmniPrefixCacheManager) -> None:
        super().__init__(name="materializer")
        self.mgr = mgr
        self.jobs: queue.Queue[tuple[int, dict[str, torch.Tensor]] | None] = queue.Queue()
        self.checked_rows = 0
        self.errors: list[str] = []

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            sid, expected = job
            try:
                got = self.mgr.materialize(sid, list(expected)).hidden_states or {}
            except OmniPrefixCacheUnmatchError as exc:
                self.errors.append(f"step {sid}: {exc}")
                continue
            for rid, rows in expected.items():
                if rid not in got or not torch.equal(got[rid], rows):
                    self.errors.append(f"step {sid}: wrong rows for {rid}")
                self.checked_rows += rows.shape[0]


def main() -> int:
    config = PrefixCacheConfig(num_blocks=32, block_size=BLOCK_SIZE, staging_capacity_tokens=64)
    batch = InputBatch()
    mgr = OmniPrefixCacheManager(config, FullAttentionGroupView(batch, block_size=BLOCK_SIZE), eager=False)
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True))
    worker = Materializer(mgr)
    worker.start()
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
                    req.computed = req.hit = len(SYSTEM)
                new_reqs.append(NewRequest(rid, req.computed, (list(req.blocks),)))
                running[rid] = req
            sched: dict[str, int] = {}
            for req in running.values():
                sched[req.req_id] = len(req.tokens) - req.computed  # prefill the rest, or decode one
                if len(req.tokens) + 1 > len(req.blocks) * BLOCK_SIZE:
                    req.blocks.append(free_blocks.pop(0))
            mgr.new_step_starts(SchedulerOutput(sched, new_reqs, finished))
            finished = set()
            if not sched:
                break
            batch.set_rows({r.req_id: (r.computed, r.blocks) for r in running.values()})
            pieces, expected = [], {}
            for req in running.values():
                new = forward(req.tokens[req.computed :], req.computed)
                pieces.append(new)
                expected[req.req_id] = forward(req.tokens, 0)[-new.shape[0] - req.hit :]
                req.hit = 0
            hidden = torch.cat(pieces)
            sid = mgr.save_outputs(hidden, None, num_tokens_unpadded=hidden.shape[0], num_tokens_padded=hidden.shape[0])
            worker.jobs.put((sid, expected))  # materialized on the other thread, while the next step runs
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

    for line in worker.errors:
        print(line)
    ok = not worker.errors and worker.checked_rows > 0 and stats["hit_requests"] == 3
    print(f"{step} steps, {worker.checked_rows} rows checked, {stats['hit_tokens']} prefix tokens from the cache")
    print("threaded_lagged: OK" if ok else "threaded_lagged: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
