"""The scheduler adapter: vLLM scheduler output in, immutable request events out.

This is the one place that reads scheduler objects for the request
lifecycle. Everything it returns is a frozen value, so the manager never
keeps or inspects vLLM state. Names and fields match upstream vLLM-Omni's
``prefix_cache.adapter``.

Scheduler objects are read by attribute name with defaults, so vLLM's own
``SchedulerOutput`` / ``NewRequestData`` / ``CachedRequestData`` and any
duck-typed stand-in work alike. The optional fields an engine may add:

- ``prefix_cache_owners``: ``{req_id: PrefixCacheRequestOwner}`` declared
  for this step's scheduled requests;
- ``prefix_cache_terminal_owners``: the owner a finished or aborted id ends;
- ``prefix_cache_replacements``: REPLACED control events, applied first;
- ``aborted_req_ids``: which terminal ids were aborted (vLLM has no such
  field yet, so a finished id is never guessed to be aborted);
- ``prefix_cache_step_sequence``: a step number that makes a replayed step a
  no-op;
- ``prefix_cache_resumed_req_ids``: ids among ``scheduled_new_reqs`` that
  are resumed after a preemption (Model Runner V2 lists them there, with
  nothing marking them; the runner knows, since it still holds the id).

vLLM's ``scheduled_spec_decode_tokens`` (speculative decoding) gives each
step's draft counts (``PrefixCacheStep.draft_tokens``): a request's last
``drafts`` scheduled positions are unverified until its output says how
many were accepted (``accepted_rows_of``, passed to materialize).

Imports nothing heavy (no torch): the engine thread pays for every line here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from itertools import repeat
from typing import Any

from omni_prefix_cache.errors import OmniPrefixCacheInvalidArgumentError
from omni_prefix_cache.spec_decode import accepted_rows_of as accepted_rows_of  # re-exported for runners
from omni_prefix_cache.spec_decode import draft_counts
from omni_prefix_cache.tier.metadata import TierStepMetadata, tier_metadata_of


# (str, Enum) as upstream, not StrEnum: str() and format() of a member stay upstream's.
class PrefixCacheEventKind(str, Enum):  # noqa: UP042
    """What happened to a request in one scheduler step."""

    STARTED = "started"  # a new admission (first sight of the id, or a new owner)
    EXTENDED = "extended"  # a known owner scheduled again (more prompt or decode)
    RESUMED = "resumed"  # back after preemption: its hit is read again
    FINISHED = "finished"
    ABORTED = "aborted"
    REPLACED = "replaced"  # a control: the owner's content was replaced (new generation)


@dataclass(frozen=True, slots=True, order=True)
class PrefixCacheRequestOwner:
    """Who a request id belongs to right now: an admission and a generation.

    Not a cache key. Each admission gets a fresh, increasing ``admission_id``
    even when the client reuses the request id; only an accepted replacement
    bumps ``generation``. Appending input or resuming keeps the owner. Owners
    order by ``(admission_id, generation)``: an older owner never moves a
    newer one.
    """

    admission_id: int
    generation: int = 0


@dataclass(frozen=True, slots=True)
class PrefixCacheRequestEvent:
    """One request's event of one step.

    ``hit_end``: where the prefix-cache hit ends (vLLM's
    ``num_computed_tokens``). ``hit_start``: kept for upstream's event shape;
    the adapter always sets 0, and the manager does not read it: a hit is
    served from the tenure's recovery start (0 for a fresh tenure, the
    slowest consumer's watermark after a resume; ``steps.step_record.Hit``).
    A value other than a non-negative int not past ``hit_end`` is refused.
    ``block_ids``: one tuple
    per KV cache group; ``owner``: None when the engine declares no owners;
    ``lookup_complete``: False on a control that fixes the owner before the
    cache lookup ran.
    """

    req_id: str
    kind: PrefixCacheEventKind
    hit_start: int = 0
    hit_end: int = 0
    block_ids: tuple[tuple[int, ...], ...] = ()
    scheduled_tokens: int = 0
    num_output_tokens: int = 0
    owner: PrefixCacheRequestOwner | None = None
    lookup_complete: bool = True


@dataclass(frozen=True, slots=True)
class PrefixCacheStep:
    """One scheduler step: its events and ``(req_id, tokens)`` scheduled.

    Iterating a step yields its events. ``sequence`` is the step number the
    engine gave (None without one). ``draft_tokens``: ``(req_id, drafts)``
    for each request whose last ``drafts`` scheduled tokens are speculative
    drafts (vLLM's ``scheduled_spec_decode_tokens``); empty without
    speculative decoding.
    """

    events: tuple[PrefixCacheRequestEvent, ...]
    scheduled_tokens: tuple[tuple[str, int], ...]
    sequence: int | None = None
    # The host tier's part of the step's kv_connector_metadata (tier.metadata), None without the wrapper.
    tier: TierStepMetadata | None = None
    draft_tokens: tuple[tuple[str, int], ...] = ()

    def __iter__(self) -> Iterator[PrefixCacheRequestEvent]:
        return iter(self.events)


@dataclass(frozen=True, slots=True)
class PrefixCacheWrite:
    """Rows ``[row_start, row_end)`` of a step's outputs are ``req_id``'s
    token positions ``[token_start, token_end)``."""

    req_id: str
    row_start: int
    row_end: int
    token_start: int
    token_end: int


@dataclass(frozen=True, slots=True)
class PrefixCacheWriteLayout:
    """Where each request's rows of one step go: one write per batch request,
    in batch order, packed; ``slots_cpu`` is the group view's slot ids."""

    writes: tuple[PrefixCacheWrite, ...]
    total_rows: int
    slots_cpu: Any = None


_STARTED = PrefixCacheEventKind.STARTED
_EXTENDED = PrefixCacheEventKind.EXTENDED
_RESUMED = PrefixCacheEventKind.RESUMED
_FINISHED = PrefixCacheEventKind.FINISHED
_ABORTED = PrefixCacheEventKind.ABORTED
_REPLACED = PrefixCacheEventKind.REPLACED
_EMPTY: dict[str, Any] = {}


# The engine thread builds one event per scheduled request per step, and a
# frozen dataclass's __init__ costs a guarded object.__setattr__ per field
# (about 0.85 us for nine). Setting the slots through their descriptors builds
# the same object in about half that; the field list is pinned so a new field
# cannot be left unset.
_EVENT_FIELDS = (
    "req_id",
    "kind",
    "hit_start",
    "hit_end",
    "block_ids",
    "scheduled_tokens",
    "num_output_tokens",
    "owner",
    "lookup_complete",
)
if PrefixCacheRequestEvent.__slots__ != _EVENT_FIELDS:  # pragma: no cover - a guard on edits of the class
    raise ImportError("adapter: PrefixCacheRequestEvent's fields changed; update _new_event")
_set_req, _set_kind, _set_hit_start, _set_hit_end, _set_blocks, _set_sched, _set_out, _set_owner, _set_lookup = (
    PrefixCacheRequestEvent.__dict__[name].__set__ for name in _EVENT_FIELDS
)
_object_new = object.__new__


def _new_event(
    req_id: str,
    kind: PrefixCacheEventKind,
    hit_end: int,
    block_ids: tuple[tuple[int, ...], ...],
    scheduled_tokens: int,
    num_output_tokens: int,
    owner: PrefixCacheRequestOwner | None,
) -> PrefixCacheRequestEvent:
    """``PrefixCacheRequestEvent(req_id, kind, 0, hit_end, ...)`` with a complete lookup, built fast."""
    event: PrefixCacheRequestEvent = _object_new(PrefixCacheRequestEvent)
    _set_req(event, req_id)
    _set_kind(event, kind)
    _set_hit_start(event, 0)
    _set_hit_end(event, hit_end)
    _set_blocks(event, block_ids)
    _set_sched(event, scheduled_tokens)
    _set_out(event, num_output_tokens)
    _set_owner(event, owner)
    _set_lookup(event, True)
    return event


_WRITE_FIELDS = ("req_id", "row_start", "row_end", "token_start", "token_end")
if PrefixCacheWrite.__slots__ != _WRITE_FIELDS:  # pragma: no cover - a guard on edits of the class
    raise ImportError("adapter: PrefixCacheWrite's fields changed; update _new_write")
_set_w_req, _set_w_row_start, _set_w_row_end, _set_w_token_start, _set_w_token_end = (
    PrefixCacheWrite.__dict__[name].__set__ for name in _WRITE_FIELDS
)


def _new_write(req_id: str, row_start: int, row_end: int, token_start: int, token_end: int) -> PrefixCacheWrite:
    """``PrefixCacheWrite(...)``, built fast as ``_new_event`` (one per batch request per step)."""
    write: PrefixCacheWrite = _object_new(PrefixCacheWrite)
    _set_w_req(write, req_id)
    _set_w_row_start(write, row_start)
    _set_w_row_end(write, row_end)
    _set_w_token_start(write, token_start)
    _set_w_token_end(write, token_end)
    return write


def _req_id_of(data: Any) -> str:
    value = getattr(data, "req_id", None)
    if value is None:
        value = getattr(data, "request_id", None)
    if value is None:
        raise OmniPrefixCacheInvalidArgumentError(
            f"scheduler adapter: scheduled request data {type(data).__name__} has neither req_id nor request_id"
        )
    return str(value)


def _block_groups(blocks: Any) -> tuple[tuple[int, ...], ...]:
    """``blocks`` as one tuple per KV cache group; a flat list of ints is one group."""
    if blocks is None or len(blocks) == 0:
        return ()
    # __index__: ints and numpy integers alike are block ids, a list is a group.
    if hasattr(blocks[0], "__index__"):
        return (tuple(map(int, blocks)),)
    if len(blocks) == 1:  # the usual single KV cache group, without a generator
        return (tuple(map(int, blocks[0])),)
    return tuple(tuple(map(int, group)) for group in blocks)


def _check_controls(controls: tuple[Any, ...]) -> None:
    for control in controls:
        if getattr(control, "kind", None) is not _REPLACED or getattr(control, "owner", None) is None:
            raise OmniPrefixCacheInvalidArgumentError(
                f"scheduler adapter: replacement control for request {getattr(control, 'req_id', '?')!r} "
                f"must be a REPLACED event with an owner, got kind={getattr(control, 'kind', None)!r} "
                f"owner={getattr(control, 'owner', None)!r}"
            )


class PrefixCacheSchedulerAdapter:
    """Turns each step's scheduler output into request events.

    Remembers, per request id, the owner it last saw (None when the engine
    declares none), so it can tell a new admission from an extension and drop
    a stale owner's events, and the last step sequence it translated. Not
    thread-safe: one adapter per engine, called on the engine thread, once
    per step, in step order.
    """

    __slots__ = ("_observed_owners", "_last_step_sequence")

    def __init__(self) -> None:
        self._observed_owners: dict[str, PrefixCacheRequestOwner | None] = {}
        self._last_step_sequence = -1

    def translate_scheduler_output(self, scheduler_output: Any) -> tuple[PrefixCacheRequestEvent, ...]:
        """The events of one step, in this order: replacement controls, new
        requests (STARTED, EXTENDED, or RESUMED when named in
        ``prefix_cache_resumed_req_ids``), cached requests (resumed ids sorted,
        as RESUMED, then the rest as EXTENDED in their order), then terminal
        ids sorted (ABORTED if in ``aborted_req_ids``, else FINISHED).

        An event whose declared owner is older than the one observed is
        dropped. A terminal id's owner (declared, else the observed one) is
        forgotten unless it is older than the observed one. Called on the
        engine thread, once per step. Raises
        ``OmniPrefixCacheInvalidArgumentError`` naming the request for a
        replacement control that is not REPLACED or has no owner (before
        anything is observed), and for new request data without an id (the
        step's terminal ids and controls are then already applied).
        """
        so = scheduler_output
        observed = self._observed_owners
        scheduled: Mapping[str, int] = getattr(so, "num_scheduled_tokens", None) or _EMPTY
        owners: Mapping[str, PrefixCacheRequestOwner] = getattr(so, "prefix_cache_owners", None) or _EMPTY
        finished = getattr(so, "finished_req_ids", None) or ()
        aborted = getattr(so, "aborted_req_ids", None) or ()
        events: list[PrefixCacheRequestEvent] = []
        controls = tuple(getattr(so, "prefix_cache_replacements", None) or ())
        if controls:
            _check_controls(controls)  # before anything is observed: a refused step changes nothing

        # Terminal ids first: a finished id re-admitted in this same step must
        # start afresh, so its old owner is forgotten before admissions are read.
        terminal: list[tuple[str, PrefixCacheEventKind, PrefixCacheRequestOwner | None]] = []
        if finished or aborted:
            aborted_ids = {str(r) for r in aborted}
            declared_terminal = getattr(so, "prefix_cache_terminal_owners", None) or _EMPTY
            for req_id in sorted({str(r) for r in finished} | aborted_ids):
                current = observed.get(req_id)
                owner = declared_terminal.get(req_id, current)
                # An older owner's end leaves the newer admission in place.
                if current is None or owner is None or not owner < current:
                    observed.pop(req_id, None)
                terminal.append((req_id, _ABORTED if req_id in aborted_ids else _FINISHED, owner))

        for control in controls:
            current = observed.get(control.req_id)
            if current is not None and control.owner < current:
                continue  # a stale control: the id has a newer owner
            observed[control.req_id] = control.owner
            events.append(control)

        resumed_new = getattr(so, "prefix_cache_resumed_req_ids", None) or ()
        for data in getattr(so, "scheduled_new_reqs", None) or ():
            req_id = _req_id_of(data)
            owner = owners.get(req_id)
            if req_id in observed:
                current = observed[req_id]
                if owner is None:
                    kind, owner_now = _EXTENDED, current
                elif current is None:
                    kind, owner_now = _STARTED, owner
                elif owner < current:
                    continue  # an older admission's leftover
                else:
                    kind, owner_now = (_EXTENDED if owner == current else _STARTED), owner
                if kind is _EXTENDED and req_id in resumed_new:
                    kind = _RESUMED  # the same owner back after a preemption: its hit is read again
            else:
                kind, owner_now = _STARTED, owner
            observed[req_id] = owner_now
            events.append(
                _new_event(
                    req_id,
                    kind,
                    int(getattr(data, "num_computed_tokens", 0) or 0),
                    _block_groups(getattr(data, "block_ids", None)),
                    int(scheduled.get(req_id, 0)),
                    0,
                    owner,
                )
            )

        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is not None:
            self._cached_events(cached, scheduled, owners, events)

        for req_id, kind, owner in terminal:
            events.append(PrefixCacheRequestEvent(req_id, kind, owner=owner))
        return tuple(events)

    def _cached_events(
        self,
        cached: Any,
        scheduled: Mapping[str, int],
        owners: Mapping[str, PrefixCacheRequestOwner],
        events: list[PrefixCacheRequestEvent],
    ) -> None:
        """Append the cached requests' events: resumed ids first (sorted), then the rest in order."""
        observed = self._observed_owners
        req_ids = list(map(str, getattr(cached, "req_ids", None) or ()))
        computed = getattr(cached, "num_computed_tokens", None) or ()
        new_blocks = getattr(cached, "new_block_ids", None) or ()
        outputs = getattr(cached, "num_output_tokens", None) or ()
        resumed = set(map(str, getattr(cached, "resumed_req_ids", None) or ()))
        order: Iterable[tuple[str, int | None, PrefixCacheEventKind]]
        if resumed:
            index = {r: i for i, r in enumerate(req_ids)}
            order = [(r, index.get(r), _RESUMED) for r in sorted(resumed)]
            order += [(r, i, _EXTENDED) for i, r in enumerate(req_ids) if r not in resumed]
        else:  # the common step: no list built, just the ids in order
            order = zip(req_ids, range(len(req_ids)), repeat(_EXTENDED))
        n_computed, n_blocks, n_outputs = len(computed), len(new_blocks), len(outputs)
        for req_id, i, kind in order:
            owner = owners.get(req_id)
            current = observed.get(req_id)
            if owner is not None and current is not None and owner < current:
                continue  # an older admission's leftover
            observed[req_id] = owner if owner is not None else current
            blocks: tuple[tuple[int, ...], ...] = ()
            if i is None:  # resumed but not listed: nothing known of it
                hit_end, n_out = 0, 0
            else:
                hit_end = int(computed[i]) if i < n_computed else 0
                blocks = _block_groups(new_blocks[i]) if i < n_blocks else ()
                n_out = int(outputs[i]) if i < n_outputs else 0
            events.append(_new_event(req_id, kind, hit_end, blocks, int(scheduled.get(req_id, 0)), n_out, owner))

    def translate_step(self, scheduler_output: Any) -> PrefixCacheStep:
        """The step's events and scheduled token counts as a ``PrefixCacheStep``.

        A ``prefix_cache_step_sequence`` at or below the last one translated
        is a replay: the result is an empty step carrying that sequence, and
        nothing is observed. Engine thread, once per step; raises as
        ``translate_scheduler_output``.
        """
        sequence = getattr(scheduler_output, "prefix_cache_step_sequence", None)
        if sequence is not None:
            sequence = int(sequence)
            if sequence <= self._last_step_sequence:
                return PrefixCacheStep((), (), sequence)
        events = self.translate_scheduler_output(scheduler_output)
        # Recorded only once the step translated: a step that raised may be retried.
        if sequence is not None:
            self._last_step_sequence = sequence
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or _EMPTY
        counts = tuple(zip(map(str, scheduled.keys()), map(int, scheduled.values()), strict=True))
        tier = tier_metadata_of(getattr(scheduler_output, "kv_connector_metadata", None))
        drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
        if not drafts:
            return PrefixCacheStep(events, counts, sequence, tier)
        return PrefixCacheStep(events, counts, sequence, tier, draft_counts(drafts))

    def build_write_layout(
        self,
        group_view: Any,
        *,
        num_scheduled_tokens: Mapping[str, int],
    ) -> PrefixCacheWriteLayout:
        """Where this step's output rows go: one write per request of
        ``group_view.batch_req_ids()``, rows packed in that order, token span
        from ``group_view.token_range``; slots from
        ``group_view.step_slots_cpu``. Engine thread, after the input batch was
        updated for the step; raises what the group view raises (a request not
        in the input batch).
        """
        order = list(group_view.batch_req_ids())
        counts = dict(num_scheduled_tokens)
        slots = group_view.step_slots_cpu(order, counts)
        token_range = group_view.token_range
        writes: list[PrefixCacheWrite] = []
        cursor = 0
        for req_id in order:
            count = int(counts.get(req_id, 0))
            start, end = token_range(req_id, count)
            writes.append(_new_write(req_id, cursor, cursor + count, int(start), int(end)))
            cursor += count
        return PrefixCacheWriteLayout(tuple(writes), cursor, slots)
