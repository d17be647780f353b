"""The lifecycle model's world: one request id, its tenures, steps and consumers.

The write path is abstracted as *saved positions*: a save records that its
tenure's positions ``[start, end)`` are computed and in the cache (where a
later hit may read them); a materialize turns a saved step into an output
``[start, end)`` of its tenure (from the hit's start when the step had a
hit), which each consumer views and acknowledges on its own schedule. The
scheduler is the environment (``Sched``): it admits, preempts, resumes,
replaces and finishes the request and sends the events; an older owner's
event may arrive late (``stale``). A consumer may be hostile (``hostile``
times in all): view an output it edited to reach one position further,
acknowledge or commit a view it edited so, or keep a view it acknowledged
and acknowledge or commit it again.

``LWorld`` is immutable; ``LCtx`` the mutable scratch copy one action works
on (what the compiled operations and ``life_binding`` receive). Nothing here
knows a spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

# Event kinds (the adapter's PrefixCacheEventKind, as the model sends them).
STARTED, REPLACED, RESUMED, EXTENDED, FINISHED = range(5)
KIND_NAMES = ("STARTED", "REPLACED", "RESUMED", "EXTENDED", "FINISHED")
# The scheduler's view of the request.
NONE, ANNOUNCED, RUNNING, PREEMPTED, DONE = range(5)
SCHED_NAMES = ("no request", "announced", "running", "preempted", "done")

Owner = tuple[int, int]  # (admission, generation): compared as the adapter's owners are


class Event(NamedTuple):
    kind: int
    owner: Owner
    hit_end: int
    lookup_complete: bool


class Sched(NamedTuple):
    """What the scheduler knows: its current owner, how far it computed,
    its view of the request, and what is left of the bounds."""

    owner: Owner  # (0, 0): never admitted
    computed: int
    status: int
    preempts: int  # preemptions left
    stale: int  # late events of an older owner left
    hostile: int = 0  # hostile delivery calls left (an edited output or view, a view used twice)


class Ten(NamedTuple):
    """One tenure: its request_lifecycle state and progress, and per
    consumer its delivery state, watermark and (ghost) what it received."""

    owner: Owner
    state: int
    computed: int
    saved: int
    lookup: int  # the installed hit end, -1 before any
    marks: tuple[int, ...]  # delivered_upto per consumer
    dstates: tuple[int, ...]  # delivery state per consumer
    got: tuple[int, ...]  # ghost: positions each consumer received, in order from 0
    served: int  # ghost: the furthest position a served hit of it covered
    verified: int = 0  # ghost: the furthest position whose row is the target's (never a draft not yet accepted)


class LStep(NamedTuple):
    state: int  # step_context
    event: Event | None
    sched: tuple[int, int]  # the positions the scheduler scheduled for the request ((0, 0): none)
    tenure: int  # the tenure its save recorded (-1: none)
    start: int  # the saved range
    end: int
    hit: tuple[int, int, int] | tuple[()]  # (tenure, start, end) its planned hit, if any
    resume_low: int  # ghost: the lowest watermark when its RESUMED applied (-1: no resume)
    drafts: int = 0  # speculative drafts: the last positions of ``sched``
    accepted: int = 0  # how many of them the forward accepted (its materialize is given this)

    @property
    def accepted_end(self) -> int:
        """Where the step's valid rows end: its saved end less the drafts it rejected."""
        return self.end - self.drafts + self.accepted


class Out(NamedTuple):
    """A materialized output of one tenure: positions [start, end)."""

    tenure: int
    start: int
    end: int


# What a consumer does with a view it holds: as issued, edited (its end one further), or spent (kept after
# its acknowledgement, to be used again).
ISSUED, EDITED, SPENT = range(3)


class View(NamedTuple):
    """A consumer's delivery view of an output: its clipped range (as the
    consumer presents it: an edited view's end is one past the rows it
    holds) and what became of it."""

    output: int
    start: int
    end: int
    state: int = ISSUED

    @property
    def rows_end(self) -> int:
        """Where the rows the consumer holds end (the range as issued)."""
        return self.end - 1 if self.state == EDITED else self.end


DEAD_OUT = Out(-1, 0, 0)  # an output no consumer can still take anything new from
# One thread's operation in progress: (operation, next segment, arguments).
LRunning = tuple[str, int, tuple[int, ...]] | tuple[()]
# An action: (operation, first segment, last segment, arguments, what it raised).
LLabel = tuple[str, int, int, tuple[int, ...], str]


class LWorld(NamedTuple):
    sched: Sched
    tenures: tuple[Ten, ...]
    current: int  # the id's current tenure (ADMITTED or RUNNING), -1: none
    finished: int  # its most recent finished tenure, -1: none
    steps: tuple[LStep, ...]
    outputs: tuple[Out, ...]
    views: tuple[View | None, ...]  # per consumer
    engine: LRunning
    reader: LRunning  # a lagged materialize in progress
    lookups: tuple[tuple[int, int, int], ...]  # installed, not yet planned: (tenure, start, hit end)


@dataclass(frozen=True)
class LifeBounds:
    """Sizes of the lifecycle world (defaults: the CI bound)."""

    positions: int = 3  # the request's positions 0..positions-1
    steps: int = 3  # engine steps in all
    consumers: int = 2
    admissions: int = 2  # admissions of the id (a second one reuses it)
    generations: int = 2  # content generations per admission (REPLACED)
    preemptions: int = 1
    stale: int = 1  # late events of an older owner
    hostile: int = 1  # hostile delivery calls (an edited output or view, a view used twice)
    drafts: int = 1  # speculative drafts a decode step may schedule (each accepted or rejected)

    def describe(self) -> str:
        return (
            f"lifecycle: {self.positions} positions, {self.steps} steps, {self.consumers} consumers, "
            f"{self.admissions} admissions x {self.generations} generations, {self.preemptions} preemptions, "
            f"{self.stale} stale events, {self.hostile} hostile delivery calls, "
            f"up to {self.drafts} speculative drafts per step"
        )


# Arguments: (step, consumer, output); -1 = none.
L_NO_ARGS = (-1, -1, -1)


class LCtx:
    """Scratch world for one action, plus what the operation in hand acts
    on: ``sid`` (its step), ``event``, ``tenure`` (the request role's
    instance), ``items`` (the delivery role's: ``[tenure, consumer, start,
    end]``), ``consumer``/``output`` (a delivery operation's), and what its
    effects pass on (``lookups``, ``live``, ``acks``, ``clipped``)."""

    __slots__ = (
        *("sched", "tenures", "current", "finished", "steps", "outputs", "views"),
        *("sid", "consumer", "output", "event", "tenure", "items", "lookups", "live", "acks", "clipped"),
        *("received", "handed", "fired", "cur", "pending", "spent"),
    )

    def __init__(self, w: LWorld, args: tuple[int, ...]):
        self.sched = w.sched
        self.tenures = list(w.tenures)
        self.current, self.finished = w.current, w.finished
        self.steps = list(w.steps)
        self.outputs = list(w.outputs)
        self.views = list(w.views)
        self.sid, self.consumer, self.output = args
        step = self.steps[self.sid] if self.sid >= 0 else None
        self.event: Event | None = step.event if step is not None else None
        self.tenure = -1
        self.items: list[list[int]] | None = None
        self.live: list[int] = []
        self.acks: list[list[int]] = []
        self.clipped: tuple[int, int] | None = None
        self.received: list[tuple[int, int, int, int]] = []  # (tenure, consumer, start, end) handed to a consumer
        self.handed: list[int] = []  # tenures commit_output handed off
        self.fired: set[tuple[str, str]] = set()
        self.cur: list[int] = []  # the delivery item a move is firing on
        self.pending = w.lookups  # installed lookups new_step's plan_hits has not taken yet
        self.spent = False  # an acknowledgement spent the consumer's view (spend_view, ack_live)

    @property
    def args(self) -> tuple[int, ...]:
        return (self.sid, self.consumer, self.output)

    def freeze(self, engine: LRunning, reader: LRunning) -> LWorld:
        return LWorld(
            self.sched,
            tuple(self.tenures),
            self.current,
            self.finished,
            tuple(self.steps),
            tuple(self.outputs),
            tuple(self.views),
            engine,
            reader,
            self.pending,
        )

    def __repr__(self) -> str:
        return f"<step {self.sid} consumer {self.consumer} output {self.output} tenure {self.tenure}>"


def older(a: Owner, b: Owner) -> bool:
    """``a`` is an older owner than ``b``."""
    return a < b


def replace_at(t: tuple[int, ...], i: int, value: int) -> tuple[int, ...]:
    return (*t[:i], value, *t[i + 1 :])


def rep(t: Any, **kw: Any) -> Any:
    return t._replace(**kw)
