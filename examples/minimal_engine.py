"""A minimal engine loop: two requests share a prompt, the second is a prefix hit.

The engine helper drives the whole flow: begin the step, save its rows,
build (materialize + deliver + commit) its outputs in step order.
Run: python examples/minimal_engine.py   (exits 1 if a row is wrong)
"""

import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from omni_prefix_cache import ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.engine_helper import PrefixCacheEngineHelper
from omni_prefix_cache.group_view import FullAttentionGroupView
from omni_prefix_cache.manager import OmniPrefixCacheManager

BLOCK_SIZE, HIDDEN = 4, 8


# --- What the adapter reads from the scheduler output (vLLM's objects have these fields).
@dataclass
class NewRequest:  # an entry of scheduler_output.scheduled_new_reqs
    req_id: str
    num_computed_tokens: int  # > 0: a prefix hit, block aligned
    block_ids: tuple[list[int], ...]  # per KV cache group; group 0 is read


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewRequest] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)


class InputBatch:
    """The slice of vLLM's InputBatch the group view reads: row order, computed tokens, block table."""

    def __init__(self) -> None:
        self.block_table = [SimpleNamespace(block_size=BLOCK_SIZE, block_table=SimpleNamespace(cpu=None))]
        self.set_rows({})

    def set_rows(self, rows: dict[str, tuple[int, list[int]]]) -> None:
        """rows: req_id -> (num_computed_tokens, block ids), in batch order."""
        self.req_ids = list(rows)
        self.req_id_to_index = {r: i for i, r in enumerate(rows)}
        self.num_computed_tokens_cpu = torch.tensor([c for c, _ in rows.values()], dtype=torch.int32)
        width = max([1, *(len(b) for _, b in rows.values())])
        table = torch.zeros((max(1, len(rows)), width), dtype=torch.int32)
        for i, (_, blocks) in enumerate(rows.values()):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.block_table[0].block_table.cpu = table


def forward(tokens: list[int], start: int) -> torch.Tensor:
    """Stand-in for the model: one hidden row per token, a function of the prefix position and token."""
    return torch.tensor([[tok + pos / 100 + j for j in range(HIDDEN)] for pos, tok in enumerate(tokens, start)])


def main() -> int:
    batch = InputBatch()
    delivered: dict[str, torch.Tensor] = {}  # what the next stage received, per request

    def build(view):  # output thread, no lock held: copy out what the next stage gets
        return {rid: rows.clone() for rid, rows in (view.hidden_states or {}).items()}

    def publish(payload, live):  # under the manager's lock: only publish references
        for rid in live:
            delivered[rid] = torch.cat([delivered[rid], payload[rid]]) if rid in delivered else payload[rid]

    prompt = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks
    # --- README: the engine loop (the README quotes these lines; tests/test_docs.py checks it) ---
    config = PrefixCacheConfig(num_blocks=16, block_size=BLOCK_SIZE, staging_capacity_tokens=64)
    mgr = OmniPrefixCacheManager(config)  # the event API: no view
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True))
    cache = PrefixCacheEngineHelper(mgr, FullAttentionGroupView(batch, block_size=BLOCK_SIZE), consumer="talker")
    try:
        # Step 1: request "a" prefills its 8 prompt tokens into blocks 0 and 1.
        cache.begin_step(SchedulerOutput({"a": 8}, [NewRequest("a", 0, ([0, 1],))]))
        batch.set_rows({"a": (0, [0, 1])})
        saved = cache.save(forward(prompt, 0), None, num_tokens_unpadded=8, num_tokens_padded=8)
        cache.output_builder(saved, build, publish)()  # run on the output thread in a real engine

        # Step 2: "a" finished; "b" has the same prompt plus two tokens. vLLM found
        # blocks 0 and 1 cached, so only tokens 8 and 9 run through the forward.
        cache.begin_step(SchedulerOutput({"b": 2}, [NewRequest("b", 8, ([0, 1, 2],))], {"a"}))
        batch.set_rows({"b": (8, [0, 1, 2])})
        saved = cache.save(forward([19, 20], 8), None, num_tokens_unpadded=2, num_tokens_padded=2)
        cache.output_builder(saved, build, publish)()  # b gets 8 cached rows + 2 new

        # Step 3: "b" finishes; nothing is scheduled, so there is nothing to save.
        cache.begin_step(SchedulerOutput({}, [], {"b"}))
        batch.set_rows({})
        stats = mgr.stats()
    finally:
        mgr.shutdown()
    # --- README: end ---

    expected_b = forward([*prompt, 19, 20], 0)
    ok = torch.equal(delivered["a"], forward(prompt, 0)) and torch.equal(delivered["b"], expected_b)
    ok = ok and stats["hit_requests"] == 1 and stats["hit_tokens"] == 8
    print(f"request b: {delivered['b'].shape[0]} rows, 8 from the prefix cache; hits: {stats['hit_requests']}")
    print("minimal_engine: OK" if ok else "minimal_engine: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
