"""A small engine that a Hypothesis state machine can steer, step by step.

It owns what vLLM would: requests and their tokens, KV blocks with prefix
hashes (the simulation's allocator: hashes registered at schedule time, an
LRU free list whose reuse is the eviction), the batch view, and the rows a
forward produces (a pure function of each position's token prefix). From
that it knows, with no cache at all, exactly which rows every materialize
must return: the reference model of the racing system tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from omni_prefix_cache.interface import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from omni_prefix_cache.manager import OmniPrefixCacheManager
from omni_prefix_cache.tools.simulate.batch import SimGroupView
from omni_prefix_cache.tools.simulate.blocks import BlockAllocator
from omni_prefix_cache.tools.simulate.rows import PrefixHashes, block_hash, mix64, rows_from_hashes

VOCAB = 50


@dataclass(eq=False)
class ModelRequest:
    rid: str
    tokens: list[int]
    hashes: PrefixHashes
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    cached_blocks: int = 0  # leading full blocks whose hash is registered
    live: bool = False  # the manager saw it as new and was not told it finished
    running: bool = False
    emit_new: bool = True  # appears in scheduled_new_reqs at its next schedule

    def full_block_hashes(self, block_size: int, upto: int) -> list[int]:
        out: list[int] = []
        parent = None
        for i in range(upto // block_size):
            parent = block_hash(parent, self.tokens[i * block_size : (i + 1) * block_size])
            out.append(parent)
        return out


@dataclass(frozen=True)
class NewReq:
    req_id: str
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]


@dataclass
class SchedOut:
    scheduled_new_reqs: list[NewReq]
    finished_req_ids: set[str]
    num_scheduled_tokens: dict[str, int]
    # Speculative decoding: each drafted request's draft token ids (vLLM's field).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Expect:
    """Rows ``[start, end)`` of ``rid`` that materialize must return."""

    rid: str
    start: int
    end: int
    hashes: torch.Tensor  # prefix hashes of positions [start, end)
    hit: bool = False  # a manager prefix hit: the rows before this step come from the cache
    # (mm key, per position of [start, end)): True where the slot's tenant
    # never wrote the key, so the rows are the baseline (zeros).
    absent: tuple[tuple[str, tuple[bool, ...]], ...] = ()


@dataclass
class PlannedStep:
    out: SchedOut
    order: list[str]
    hidden: torch.Tensor
    mm: dict[str, torch.Tensor]
    n: int
    expects: list[Expect]
    # Speculative decoding: per drafted request, len(sampled_token_ids[i]) (its accepted drafts plus one).
    accepted: dict[str, int] = field(default_factory=dict)
    # Per drafted request: (verified end, draft end, its block ids) as scheduled, for a test's hostile hit.
    drafted: dict[str, tuple[int, int, list[int]]] = field(default_factory=dict)


class RecentFirstAllocator(BlockAllocator):
    """Reuses the most recently freed block first. Which block an engine
    recycles is not the cache's business; this order makes a block freed by
    a preemption come straight back to an interim tenant, then to the
    resumed request: the reuse races the cache must survive."""

    def _pop_free(self) -> int:
        return self._free.popitem(last=True)[0]


class ServingModel:
    """Requests, KV blocks and expected rows. Single-threaded."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        widths: dict[str, int],
        prefixes: Sequence[Sequence[int]],
        *,
        recent_first: bool = False,
    ):
        self.block_size = block_size
        self.widths = widths
        self.alloc = (RecentFirstAllocator if recent_first else BlockAllocator)(num_blocks, block_size)
        self.view = SimGroupView(block_size)
        self.prefixes = [list(p) for p in prefixes]
        self.requests: dict[str, ModelRequest] = {}
        self.finished_pending: set[str] = set()  # announced at the next step
        # block -> prefix hashes of the tokens it holds, while it carries a hash
        self.block_content: dict[int, torch.Tensor] = {}
        # mm key -> slots whose current tenant wrote it (a tenant that did
        # not leaves the key absent there, whatever an older tenant wrote).
        self.present: dict[str, set[int]] = {k: set() for k in widths if k != HIDDEN_KEY}
        self.step_no = 0
        self._next = 0

    # ------------------------------------------------------------ lifecycle

    def arrive(self, prefix: int, tail: Sequence[int], *, rid: str | None = None) -> str:
        """A request arrives (``rid``: reuse an id whose request ended)."""
        if rid is None:
            rid = f"q{self._next}"
            self._next += 1
        assert rid not in self.requests, f"request id {rid} is in use"
        tokens = self.prefixes[prefix % len(self.prefixes)] + list(tail)
        hashes = PrefixHashes(len(tokens) + 8)
        hashes.extend(tokens)
        self.requests[rid] = ModelRequest(rid, tokens, hashes)
        return rid

    def waiting(self) -> list[ModelRequest]:
        return [r for r in self.requests.values() if not r.running]

    def running(self) -> list[ModelRequest]:
        return [r for r in self.requests.values() if r.running]

    def end(self, rid: str) -> None:
        """Finish or abort: free the blocks now, announce at the next step."""
        req = self.requests.pop(rid)
        if req.blocks:
            self.alloc.free(req.blocks)
        if req.live:
            self.finished_pending.add(rid)

    def preempt(self, rid: str) -> None:
        """Free a running request's blocks; it resumes later from a hit or 0
        (still live for the manager: not a hit, rows from where it resumes)."""
        req = self.requests[rid]
        self.alloc.free(req.blocks)
        req.blocks, req.computed, req.cached_blocks = [], 0, 0
        req.running, req.emit_new = False, True

    # ------------------------------------------------------------ one step

    def schedule(
        self,
        admit: Callable[[ModelRequest], int],
        run: Callable[[ModelRequest], int],
        capacity: int,
        absent_keys: frozenset[str] = frozenset(),
        drafts: Callable[[ModelRequest], tuple[int, int]] | None = None,
    ) -> PlannedStep | None:
        """Build one step. ``run(req)`` / ``admit(req)`` say how many tokens
        to schedule for a running / waiting request (0 = skip). mm keys in
        ``absent_keys`` are not token rows this step (the caller passes
        them as leftovers). ``drafts(req)``, for a running request in
        decode: ``(d, k)``, speculative decoding with ``d`` drafts of which
        the first ``k`` are right (the forward accepts them; the next one is
        wrong, so the rows from there on are rejected drafts'). Returns None
        when nothing got scheduled (the finished ids stay pending)."""
        budget = capacity
        entries: list[tuple[ModelRequest, int, int, bool]] = []  # req, start, n, manager hit
        new_reqs: list[NewReq] = []
        spec: dict[str, tuple[list[int], int]] = {}  # drafted request -> (draft tokens, accepted)
        for req in self.running():
            d, k = drafts(req) if drafts is not None and req.computed == len(req.tokens) - 1 else (0, 0)
            d = max(0, min(d, budget - 1))
            if d:
                n = 1 + d
                if not self._grow(req, req.computed + n):
                    continue
                spec[req.rid] = (self._drafts(req, d, min(k, d)), min(k, d))
            else:
                n = min(run(req), len(req.tokens) - req.computed, budget)
                if n <= 0 or not self._grow(req, req.computed + n):
                    continue
            if req.emit_new:  # streaming continuation: re-enters the new list
                new_reqs.append(NewReq(req.rid, req.computed, (list(req.blocks),)))
                req.emit_new = False
            entries.append((req, req.computed, n, False))
            budget -= n
        for req in self.waiting():
            want = admit(req)
            if want <= 0 or budget <= 0:
                continue
            known = len(req.tokens)
            hit_blocks = self.alloc.lookup_prefix(req.full_block_hashes(self.block_size, known), known)
            hit = len(hit_blocks) * self.block_size
            n = min(want, len(req.tokens) - hit, budget)
            need = -(-(hit + n) // self.block_size) - len(hit_blocks)
            # Reviving a free-listed hit block takes it off the free list too.
            revived = sum(1 for b in hit_blocks if self.alloc.is_free(b))
            if n <= 0 or not self.alloc.can_allocate(need + revived):
                continue
            self.alloc.touch(hit_blocks)
            fresh = self.alloc.allocate(need)
            assert fresh is not None, "allocator refused blocks it said it had"
            req.blocks = hit_blocks + fresh
            req.computed, req.cached_blocks, req.running = hit, len(hit_blocks), True
            manager_hit = hit > 0 and not req.live
            new_reqs.append(NewReq(req.rid, hit, (list(req.blocks),)))
            req.emit_new = False
            req.live = True
            entries.append((req, hit, n, manager_hit))
            self._register_full_blocks(req, hit + n)
            budget -= n
        if not entries:
            return None
        for req, start, n, _ in entries:
            # vLLM hashes a block once its tokens are computed: never over a draft.
            self._register_full_blocks(req, start + n - len(spec.get(req.rid, ((), 0))[0]))
            for slot in self._slots(req, start, start + n):
                for key, present in self.present.items():
                    (present.discard if key in absent_keys else present.add)(slot)
        order = [e[0].rid for e in entries]
        self.view.set_step(order, {r.rid: r.blocks for r, *_ in entries}, {r.rid: s for r, s, *_ in entries})
        finished, self.finished_pending = self.finished_pending, set()
        out = SchedOut(new_reqs, finished, {r.rid: n for r, _, n, _ in entries})
        out.scheduled_spec_decode_tokens = {rid: list(tokens) for rid, (tokens, _) in spec.items()}
        spans = [
            req.hashes.span(start, start + n)
            if req.rid not in spec
            else torch.cat([req.hashes.span(start, start + 1), req.hashes.chained(spec[req.rid][0])])
            for req, start, n, _ in entries
        ]
        hashes = torch.cat(spans)
        hidden = rows_from_hashes(hashes, HIDDEN_KEY, self.widths[HIDDEN_KEY], torch.float32)
        mm = {
            k: rows_from_hashes(hashes, k, w, torch.float32)
            for k, w in self.widths.items()
            if k != HIDDEN_KEY and k not in absent_keys
        }
        accepted: dict[str, int] = {}
        drafted: dict[str, tuple[int, int, list[int]]] = {}
        for req, start, n, _ in entries:
            if req.rid in spec:  # the accepted drafts join the request's tokens; the rest were wrong
                tokens, k = spec[req.rid]
                req.tokens.extend(tokens[:k])
                req.hashes.extend(tokens[:k])
                accepted[req.rid] = k + 1  # len(sampled_token_ids[i]): the accepted drafts and the bonus token
                drafted[req.rid] = (start + 1, start + n, list(req.blocks))
        expects = []
        for req, start, n, hit in entries:
            first = 0 if hit else start
            end = start + n if req.rid not in spec else start + 1 + spec[req.rid][1]  # the accepted end
            slots = self._slots(req, first, end)
            absent = tuple((k, tuple(s not in p for s in slots)) for k, p in self.present.items())
            expects.append(Expect(req.rid, first, end, req.hashes.span(first, end).clone(), hit, absent))
        for req, start, n, _ in entries:
            req.computed = start + n if req.rid not in spec else start + 1 + spec[req.rid][1]
            if req.computed == len(req.tokens):  # sampled the next token
                nxt = self._next_token(req, req.computed - 1)
                req.tokens.append(nxt)
                req.hashes.extend([nxt])
        self.step_no += 1
        return PlannedStep(out, order, hidden, mm, int(hashes.numel()), expects, accepted, drafted)

    @staticmethod
    def _next_token(req: ModelRequest, position: int) -> int:
        """The token the model samples after ``position`` (a function of its prefix)."""
        return mix64(int(req.hashes.span(position, position + 1)[0]) & 0xFFFFFFFF) % VOCAB

    def _drafts(self, req: ModelRequest, d: int, k: int) -> list[int]:
        """``d`` draft tokens after the request's last token: the first ``k``
        are the tokens the model will sample, the next one is not (the
        forward rejects it and every draft after it)."""
        out: list[int] = []
        probe = PrefixHashes(len(req.tokens) + d + 8)
        probe.extend(req.tokens)
        for j in range(d):
            right = mix64(int(probe.span(len(probe) - 1, len(probe))[0]) & 0xFFFFFFFF) % VOCAB
            token = right if j < k else (right + 1 + j) % VOCAB
            out.append(token)
            probe.extend([token])
        return out

    def recovered(self, exp: Expect, first: int) -> Expect:
        """``exp`` served from ``first`` on (a resumed request's hit that
        recovers positions a consumer has not received), right after the
        step was scheduled: the positions before the step are cache rows."""
        req = self.requests[exp.rid]
        slots = self._slots(req, first, exp.end)
        absent = tuple((k, tuple(s not in p for s in slots)) for k, p in self.present.items())
        return Expect(exp.rid, first, exp.end, req.hashes.span(first, exp.end).clone(), True, absent)

    def _slots(self, req: ModelRequest, lo: int, hi: int) -> list[int]:
        bs = self.block_size
        return [req.blocks[p // bs] * bs + p % bs for p in range(lo, hi)]

    def _grow(self, req: ModelRequest, upto: int) -> bool:
        need = -(-upto // self.block_size) - len(req.blocks)
        if need > 0:
            got = self.alloc.allocate(need)
            if got is None:
                return False
            req.blocks += got
        return True

    def _register_full_blocks(self, req: ModelRequest, upto: int) -> None:
        hashes = req.full_block_hashes(self.block_size, upto)
        bs = self.block_size
        for i in range(req.cached_blocks, len(hashes)):
            self.alloc.cache(req.blocks[i], hashes[i], self.step_no)
            self.block_content[req.blocks[i]] = req.hashes.span(i * bs, (i + 1) * bs).clone()
        req.cached_blocks = max(req.cached_blocks, len(hashes))

    def cached_blocks(self) -> dict[int, torch.Tensor]:
        """Blocks that still carry a prefix hash, with their content's hashes:
        a later hit may be served from them, so the pool must hold exactly
        these rows once every write has landed."""
        return {b: h for b, h in self.block_content.items() if self.alloc.block_hash(b) is not None}

    def expected_rows(self, exp: Expect, key: str) -> torch.Tensor:
        rows = rows_from_hashes(exp.hashes, key, self.widths[key], torch.float32)
        mask = dict(exp.absent).get(key)
        if mask is not None and any(mask):
            rows[torch.tensor(mask)] = 0.0
        return rows

    def absent_slots(self, key: str, slots: torch.Tensor) -> torch.Tensor:
        """Mask over ``slots``: where the tenant never wrote mm ``key``."""
        present = self.present[key]
        return torch.tensor([int(s) not in present for s in slots.tolist()], dtype=torch.bool)


class LazyExecutor:
    """A stand-in for the manager's prefetch pool: jobs wait until a test
    runs them (``run_next``) or someone asks for their result, so the
    interleaving of prefetches with everything else is the test's choice."""

    def __init__(self) -> None:
        self.pending: list[LazyFuture] = []

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        fut = LazyFuture(self, fn, args, kwargs)
        self.pending.append(fut)
        return fut

    def run_next(self) -> bool:
        while self.pending:
            fut = self.pending.pop(0)
            if fut.run_now():
                return True
        return False

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for fut in self.pending:
            fut.cancel()
        self.pending.clear()


class LazyFuture(Future[Any]):
    """A job of a ``LazyExecutor``: it runs when a test runs it or asks for its result."""

    def __init__(
        self, owner: LazyExecutor, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        super().__init__()
        self._owner, self._job = owner, (fn, args, kwargs)

    @property
    def args(self) -> tuple[Any, ...]:
        """The job's positional arguments (a prefetch's first is its PlannedRead)."""
        return self._job[1]

    def run_now(self) -> bool:
        if not self.set_running_or_notify_cancel():
            return False
        fn, args, kwargs = self._job
        try:
            self.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            self.set_exception(exc)
        return True

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            if self in self._owner.pending:
                self._owner.pending.remove(self)
            self.run_now()
        return super().result(timeout)


def racing_manager(
    model: ServingModel,
    num_blocks: int,
    *,
    eager: bool,
    committer: Literal["thread", "manual", "on_demand"],
    capacity: int,
    depth: int,
    deferred_key: str,
    deferred_rows: int,
) -> tuple[OmniPrefixCacheManager, LazyExecutor]:
    """A manager over ``model``'s view as the racing machines drive it: no
    staging wait, ``deferred_key`` deferred with a GPU budget of
    ``deferred_rows`` of its rows (so saves force flushes), hidden states
    cached, and the prefetch pool replaced by a ``LazyExecutor`` the test
    runs. Returns the manager and that executor."""
    config = PrefixCacheConfig(
        num_blocks=num_blocks,
        block_size=model.block_size,
        staging_depth=depth,
        staging_capacity_tokens=capacity,
        staging_claim_timeout_s=0.0,
        gpu_staging_bytes=deferred_rows * model.widths[deferred_key] * 4,
    )
    mgr = OmniPrefixCacheManager(config, model.view, eager=eager, committer=committer)
    mgr.register_policy(ModelCachePolicy(needs_full_hidden_states=True, deferred_keys=frozenset({deferred_key})))
    hits = mgr.components.hits
    hits.prefetch.shutdown(wait=False)
    prefetch = LazyExecutor()
    hits.prefetch = prefetch  # type: ignore[assignment]
    return mgr, prefetch
