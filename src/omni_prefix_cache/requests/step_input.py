"""What new_step_starts was given, as one step of lifecycle events.

The facade takes three forms, all run by the same core (``StepInput``):

- a ``PrefixCacheStep`` from ``PrefixCacheSchedulerAdapter.translate_step``
  (the newest upstream runner's form), with its sequence number;
- an iterable of ``PrefixCacheRequestEvent`` (``num_scheduled_tokens`` given
  beside it, or each event's ``scheduled_tokens``);
- a seed-era scheduler output (``scheduled_new_reqs``, ``finished_req_ids``,
  ``num_scheduled_tokens``). ``seed_step`` translates it as the seed-era
  protocol meant it: a new request that is not live gets STARTED with its
  hit, a live one re-entering the new list is ordinary progress (a streamed
  continuation), finished ids get FINISHED. A resumed request stays in its
  tenure without a lookup, so a seed-era engine gets the rows its step
  computed, as it always did; but its event names its hit and its new
  blocks (an EXTENDED carrying them: the host tier restores a KV
  connector's load of those blocks from it, as the event API's RESUMED
  does), and its rows start at its hit (``StepInput.starts``). A resume is
  vLLM 0.33's ``scheduled_cached_reqs.resumed_req_ids``, Model Runner V2's
  ``prefix_cache_resumed_req_ids``, or, in the seed-era form, a live
  request re-entering the new list with a hit below the position it reached
  (or one the step's host-tier metadata loads); a re-entry with no hit
  cannot be told from a continuation there, and stays one. vLLM 0.33's
  ``scheduled_cached_reqs.num_computed_tokens`` gives where every cached
  request's rows start, so a recompute after a failed load is labelled with
  its own positions too.

Threading: engine thread; reads ``live`` (the facade's live ids) under the
state lock's protection of the caller (the engine thread is its only writer).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_prefix_cache.adapter import PrefixCacheEventKind, PrefixCacheRequestEvent, PrefixCacheStep
from omni_prefix_cache.interface import OmniPrefixCacheInvalidArgumentError, OmniPrefixCacheInvalidTypeError, ReqId
from omni_prefix_cache.requests import event_check
from omni_prefix_cache.steps import validation as check
from omni_prefix_cache.tier.metadata import TierStepMetadata, tier_metadata_of

__all__ = ["StepInput", "events_step", "is_event_form", "seed_step"]


@dataclass(frozen=True, slots=True)
class StepInput:
    """One step's events (terminal ones first: they report the previous
    step), its sequence (None: not sequenced), the scheduled token counts,
    and the prefix queries it carries (for the operator counters)."""

    events: tuple[PrefixCacheRequestEvent, ...]
    sequence: int | None
    num_scheduled: dict[ReqId, int]
    queried: int = 0
    query_tokens: int = 0
    tier: TierStepMetadata | None = None  # the host tier's metadata (a KV connector's loads)
    # Seed-era only: where each request's rows start, as the scheduler output says (vLLM 0.33's
    # scheduled_cached_reqs); a request it does not name continues its tenure's computed_upto.
    starts: dict[ReqId, int] | None = None
    # Speculative decoding: request -> its last scheduled tokens that are drafts (only requests with some).
    drafts: dict[ReqId, int] = field(default_factory=dict)


_TERMINAL = (PrefixCacheEventKind.FINISHED, PrefixCacheEventKind.ABORTED)
_QUERIES = (PrefixCacheEventKind.STARTED, PrefixCacheEventKind.REPLACED, PrefixCacheEventKind.RESUMED)
# What a seed-era scheduler output carries (``SchedulerOutputLike``); a value with none of them is no step.
_SEED_FIELDS = ("scheduled_new_reqs", "finished_req_ids", "num_scheduled_tokens")


def is_event_form(value: object) -> bool:
    """A ``PrefixCacheStep`` or any iterable (list, tuple, generator...) meant
    as events, as opposed to a seed-era scheduler output: one that carries
    none of the scheduler output's fields. Its items are checked by
    ``events_step``, so an iterable holding a non-event is refused, never
    read as an empty seed-era step."""
    if isinstance(value, PrefixCacheStep):
        return True
    if isinstance(value, (str, bytes, Mapping)) or any(hasattr(value, f) for f in _SEED_FIELDS):
        return False
    return isinstance(value, Iterable)


def _terminal_first(events: Iterable[PrefixCacheRequestEvent]) -> tuple[PrefixCacheRequestEvent, ...]:
    every = tuple(events)
    terminal = [e for e in every if e.kind in _TERMINAL]
    if not terminal:
        return every
    return (*terminal, *(e for e in every if e.kind not in _TERMINAL))


def events_step(
    given: PrefixCacheStep | Iterable[PrefixCacheRequestEvent],
    num_scheduled_tokens: Mapping[ReqId, int] | None,
    kv_tier: TierStepMetadata | None = None,
    num_draft_tokens: Mapping[ReqId, int] | None = None,
) -> StepInput:
    """The event forms. Raises the invalid-type or invalid-argument error
    (``event_check``) for a step whose fields are not a step's, an item that
    is not an event, an event field of the wrong type or range, or a bad
    count; nothing is read twice (a generator is consumed once). The host
    tier's metadata is ``kv_tier``, else the step's own (``PrefixCacheStep.tier``);
    the draft counts ``num_draft_tokens``, else the step's own
    (``PrefixCacheStep.draft_tokens``), each below its request's scheduled count."""
    tier = _tier(kv_tier)
    raw_drafts: Any = num_draft_tokens
    if isinstance(given, PrefixCacheStep):
        if tier is None:
            tier = _tier(given.tier)
        events, sequence = event_check.step_events(given), given.sequence
        raw: Any = event_check.step_counts(given) if num_scheduled_tokens is None else num_scheduled_tokens
        if raw_drafts is None and given.draft_tokens:
            raw_drafts = event_check.step_counts(given, "draft_tokens")
    else:
        events, sequence = event_check.as_events(given), None
        raw = num_scheduled_tokens
    event_check.check_events(events)
    if sequence is not None:
        check.as_int("new_step_starts: step sequence", sequence)
    if raw is None:
        raw = {e.req_id: e.scheduled_tokens for e in events if e.scheduled_tokens}
    num_sched = check.as_num_scheduled(raw)
    drafts = _drafts(raw_drafts, num_sched) if raw_drafts else {}
    queried = query_tokens = 0
    for e in events:
        if e.kind in _QUERIES and e.lookup_complete:
            queried += 1
            query_tokens += int(e.hit_end) + num_sched.get(e.req_id, 0)
    return StepInput(_terminal_first(events), sequence, num_sched, queried, query_tokens, tier, drafts=drafts)


def _drafts(raw: Any, num_sched: Mapping[ReqId, int]) -> dict[ReqId, int]:
    """The step's draft counts, checked against its scheduled counts: a
    drafted request is scheduled, and at least one of its scheduled tokens
    (the one its drafts follow) is not a draft. Raises the invalid-type or
    invalid-argument error naming the request."""
    counts = check.as_num_scheduled(raw)
    out: dict[ReqId, int] = {}
    for rid, drafts in counts.items():
        if drafts == 0:
            continue
        scheduled = num_sched.get(rid, 0)
        if drafts >= scheduled:
            raise OmniPrefixCacheInvalidArgumentError(
                f"new_step_starts: request {rid!r} has {drafts} speculative draft tokens but {scheduled} scheduled "
                "tokens (the drafts are the last scheduled tokens, after at least one verified one)"
            )
        out[rid] = drafts
    return out


def _tier(value: object) -> TierStepMetadata | None:
    if value is None or isinstance(value, TierStepMetadata):
        return value
    raise OmniPrefixCacheInvalidTypeError(
        f"new_step_starts: kv_tier must be a TierStepMetadata or None, got {type(value).__name__}"
    )


def seed_step(
    scheduler_output: Any, live: Collection[ReqId], reached: Callable[[ReqId], int] = lambda rid: 0
) -> StepInput:
    """A seed-era scheduler output as events (see the module docstring).
    ``reached(rid)``: the position a live request's tenure computed up to.
    Raises the invalid-type or invalid-argument error naming the field, and
    the invalid-type error for a value that is no step at all (None, an int:
    none of the scheduler output's fields), which would read as an empty step."""
    if not any(hasattr(scheduler_output, f) for f in _SEED_FIELDS):
        raise OmniPrefixCacheInvalidTypeError(
            f"new_step_starts needs a PrefixCacheStep, an iterable of PrefixCacheRequestEvent or a scheduler "
            f"output, got {type(scheduler_output).__name__} {scheduler_output!r}"
        )
    if getattr(scheduler_output, "scheduled_spec_decode_tokens", None):
        raise OmniPrefixCacheInvalidArgumentError(
            "new_step_starts: a seed-era scheduler output with scheduled_spec_decode_tokens; speculative decoding "
            "needs the event API (PrefixCacheSchedulerAdapter.translate_step, write layouts, and the accepted rows "
            "at materialize: docs/integration.md)"
        )
    finished = check.as_req_ids("finished_req_ids", getattr(scheduler_output, "finished_req_ids", None))
    new_reqs = check.new_requests(getattr(scheduler_output, "scheduled_new_reqs", None))
    num_sched = check.as_num_scheduled(getattr(scheduler_output, "num_scheduled_tokens", None))
    tier = tier_metadata_of(getattr(scheduler_output, "kv_connector_metadata", None))
    loaded = tier.loads if tier is not None else {}
    marked = set(map(str, getattr(scheduler_output, "prefix_cache_resumed_req_ids", None) or ()))
    gone = set(finished)
    events = [PrefixCacheRequestEvent(rid, PrefixCacheEventKind.FINISHED) for rid in finished]
    starts: dict[ReqId, int] = {}
    queried = query_tokens = 0
    for rid, computed, block_ids, req in new_reqs:
        if rid in live and rid not in gone:
            # A live request re-entering the new list: a streamed continuation, or a resume (no query
            # either way). A resume is marked, loaded by the KV connector, or hits below its position.
            if rid in marked or rid in loaded or 0 < computed < reached(rid):
                events.append(_resumed(rid, computed, block_ids, num_sched))
                starts[rid] = computed
            continue
        queried += 1
        query_tokens += _query_tokens(req, computed, num_sched.get(rid, 0))
        blocks = block_ids if computed > 0 else ()
        events.append(
            PrefixCacheRequestEvent(
                rid,
                PrefixCacheEventKind.STARTED,
                0,
                computed,
                blocks,
                num_sched.get(rid, 0),
            )
        )
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        _cached_requests(cached, live, gone, num_sched, events, starts)
    return StepInput(tuple(events), None, num_sched, queried, query_tokens, tier, starts=starts or None)


def _resumed(rid: ReqId, computed: int, block_ids: Any, num_sched: Mapping[ReqId, int]) -> PrefixCacheRequestEvent:
    """A seed-era resume: EXTENDED (no lookup: the engine gets its step's
    rows, as it always did) naming its hit and its new blocks, for the host
    tier to restore a load of them."""
    return PrefixCacheRequestEvent(
        rid, PrefixCacheEventKind.EXTENDED, 0, computed, block_ids if computed > 0 else (), num_sched.get(rid, 0)
    )


def _cached_requests(
    cached: Any,
    live: Collection[ReqId],
    gone: set[ReqId],
    num_sched: Mapping[ReqId, int],
    events: list[PrefixCacheRequestEvent],
    starts: dict[ReqId, int],
) -> None:
    """vLLM 0.33's ``scheduled_cached_reqs`` (``req_ids`` with, per entry,
    ``num_computed_tokens`` and ``new_block_ids``; ``resumed_req_ids``): a
    live resumed id gets its event (``_resumed``: its hit and its new block
    list), and each entry's rows start at its ``num_computed_tokens`` (into
    ``starts``)."""
    req_ids = check.as_req_ids("scheduled_cached_reqs.req_ids", getattr(cached, "req_ids", None) or ())
    computed = list(getattr(cached, "num_computed_tokens", None) or ())
    new_blocks = list(getattr(cached, "new_block_ids", None) or ())
    resumed = set(check.as_req_ids("scheduled_cached_reqs.resumed_req_ids", getattr(cached, "resumed_req_ids", None)))
    for i, rid in enumerate(req_ids):
        if i >= len(computed):
            continue  # nothing known of where it starts
        start = starts[rid] = check.as_count(
            f"scheduled_cached_reqs.num_computed_tokens of request {rid!r}", computed[i]
        )
        if rid in resumed and rid in live and rid not in gone:
            events.append(_resumed(rid, start, new_blocks[i] if i < len(new_blocks) else None, num_sched))


def _query_tokens(req: Any, computed: int, scheduled: int) -> int:
    """Prompt tokens a new request looked up in the prefix cache (vLLM's
    ``prompt_token_ids`` when present, else computed plus first-step tokens)."""
    prompt = getattr(req, "prompt_token_ids", None)
    try:
        return len(prompt) if prompt is not None else computed + scheduled
    except TypeError:
        return computed + scheduled
