"""The model's world: the immutable state the checker explores.

``World`` holds every component instance as a small tuple (``Task``,
``Step``, ``Slot``, ``Read``), the queue order, the budget counter, the
record lists and each thread's operation in progress. ``Ctx`` is the
mutable scratch copy one action works on (the context the compiled
operations and the binding's handlers receive); ``freeze`` turns it back
into a ``World``. ``Bounds`` sizes the world. Nothing here knows a spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from omni_prefix_cache.testing.modelcheck.life_world import LifeBounds

IMM, DEF, DEFQ = 0, 1, 2  # save kinds: immediate, deferred, deferred submitted queued
REJECTS = 1  # the ``kind`` argument of a materialize or discard whose step's rows are rejected drafts
KIND_NAMES = {IMM: "imm", DEF: "def", DEFQ: "def queued"}
STEP, TASK = 0, 1  # holder kinds
ENGINE, READER, COMMITTER, FAILER = 0, 1, 2, 3  # threads
THREAD_NAMES = ("engine", "reader", "committer", "failing thread")


class Task(NamedTuple):
    state: int  # write_task
    position: int  # copy_queue
    holder: int  # staging_holder of the task (an immediate write's view of its step's page)
    page: int  # page the holder holds, -1 if none
    sched: int  # IMM or DEF (a DEFQ save registers a DEF write)
    req: int
    step: int  # the step whose page an immediate write views; -1 if deferred
    host_ready: bool
    done: bool
    owed: tuple[str, int] | tuple[()]  # (trigger, source) of a move whose deferrable effects are owed
    clone: bool  # still holds its device clones
    pins: tuple[int, ...]  # steps whose budget tickets it pins
    slots: tuple[int, ...]
    reassigned: tuple[int, ...]
    claims: int  # successful copy claims
    drained: bool  # its record was drained by the engine


class Step(NamedTuple):
    state: int  # step_context
    holder: int  # staging_holder of the step
    page: int
    charged: int  # budget ticket: bytes charged (0 or 1 unit)
    tids: tuple[int, ...]  # tasks pinning the ticket
    freed: bool  # the ticket uncharged
    cells: tuple[int, ...] = ()  # the cells its save mapped (a materialize may reject their rows as drafts)


class Slot(NamedTuple):
    """One (slot, key) cell: index ``slot * keys + key`` in ``World.slots``."""

    state: int  # slot_occupancy
    owner: int  # -1 when none
    version: int
    stale: bool  # holds rows of a previous tenant of the slot (tenant_owns_all_keys)
    writer: int = -1  # the step whose save last mapped the cell (the occupancy's tenancy), -1 when none
    rejected: bool = False  # ghost: holds a row its step's materialize rejected (a draft), until a save maps it


class Read(NamedTuple):
    state: int  # planned_read
    slot: int
    version: int
    preserved: bool
    step: int  # the step whose materialize serves it
    rejected: bool = False  # ghost: it would read a rejected draft's row (it must never be served)


# An action: (operation, first segment, last segment, arguments, what it raised).
Label = tuple[str, int, int, tuple[int, ...], str]
# One thread's operation in progress: (operation, next segment, arguments).
Running = tuple[str, int, tuple[int, ...]] | tuple[()]


class World(NamedTuple):
    tasks: tuple[Task, ...]
    steps: tuple[Step, ...]
    slots: tuple[Slot, ...]
    pages: tuple[frozenset[tuple[int, int]], ...]
    hi: tuple[int, ...]
    lo: tuple[int, ...]
    completed: tuple[int, ...]
    failed: tuple[int, ...]
    staged: int
    sticky: bool
    failures_drained: bool
    reads: tuple[Read, ...]
    threads: tuple[Running, ...]
    # The committer thread is awake: a kick (wake_committer) or its linger woke it, and its queues have
    # not run empty since (it sleeps once they have; a save's push wakes nothing).
    awake: bool


@dataclass(frozen=True)
class Bounds:
    """Sizes of the explored world (defaults: the CI bound).

    Untouched slots and requests without a write are interchangeable, so
    only the first of them is tried. ``failures`` bounds failed writes.
    """

    requests: int = 2
    tasks: int = 2
    slots: int = 4
    pages: int = 2
    steps: int = 2
    reads: int = 1
    failures: int = 1
    keys: int = 1  # pool keys per slot: hidden (always written), then mm keys a step may write
    life: LifeBounds = field(default_factory=LifeBounds)  # the lifecycle model's world

    def describe(self) -> str:
        keys = f" ({self.keys} keys each)" if self.keys > 1 else ""
        return (
            f"{self.requests} requests, {self.tasks} tasks, {self.slots} slots{keys}, "
            f"{self.pages} staging pages, {self.steps} steps, {self.reads} planned reads, {self.failures} failures"
        )


CI_BOUNDS = Bounds()
# A bigger bound for a manual run: a third step, so a committed slot can be
# reused while an earlier step is still unconsumed.
# A fourth lifecycle step, so a resume, a replacement and a late event meet in one run.
BIG_BOUNDS = Bounds(requests=2, tasks=2, slots=4, pages=2, steps=3, reads=1, failures=1, life=LifeBounds(steps=4))


class Violation(Exception):
    """An invariant broken by a state or a move."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message
        self.label: Label | None = None  # the action that broke it, for a broken move


class Ctx:
    """Scratch world for one action: what the compiled operation and the
    handlers act on. ``tid``/``sid``/``slot``... are the operation's
    arguments; ``cur_*`` the component instance a move is firing on."""

    __slots__ = (
        *("tasks", "steps", "slots", "pages", "hi", "lo", "completed", "failed", "staged", "sticky"),
        *("failures_drained", "reads", "req", "kind", "slot", "sid", "tid", "target", "rid", "keys", "drop_pairs"),
        "awake",
        *(
            "commit_pairs",
            "found_failures",
            "link_slot",
            "fired",
            "cur_tid",
            "cur_slot",
            "cur_holder",
            "cur_page",
            "cur_read",
        ),
    )

    def __init__(self, w: World, args: tuple[int, ...]):
        self.tasks = list(w.tasks)
        self.steps = list(w.steps)
        self.slots = list(w.slots)
        self.pages = list(w.pages)
        self.hi = list(w.hi)
        self.lo = list(w.lo)
        self.completed = list(w.completed)
        self.failed = list(w.failed)
        self.staged = w.staged
        self.sticky = w.sticky
        self.failures_drained = w.failures_drained
        self.reads = list(w.reads)
        self.awake = w.awake
        # Operation arguments: (req, kind, slot, sid, tid, rid, keys); -1 = none. ``slot``
        # is a slot for a save (``keys``: the bit mask of mm keys it writes), a cell for a read.
        self.req, self.kind, self.slot, self.sid, self.tid, self.rid, self.keys = args
        self.target = -1
        self.commit_pairs: list[tuple[int, int]] = []
        self.drop_pairs: list[tuple[int, int]] = []
        self.found_failures = False
        self.link_slot = -1
        self.fired: set[tuple[str, str]] = set()
        self.cur_tid = self.cur_slot = self.cur_page = self.cur_read = -1
        self.cur_holder: tuple[int, int] = (STEP, -1)

    @property
    def args(self) -> tuple[int, ...]:
        return (self.req, self.kind, self.slot, self.sid, self.tid, self.rid, self.keys)

    def freeze(self, threads: tuple[Running, ...]) -> World:
        return World(
            tuple(self.tasks),
            tuple(self.steps),
            tuple(self.slots),
            tuple(self.pages),
            tuple(self.hi),
            tuple(self.lo),
            tuple(self.completed),
            tuple(self.failed),
            self.staged,
            self.sticky,
            self.failures_drained,
            tuple(self.reads),
            threads,
            self.awake,
        )

    def __repr__(self) -> str:
        return f"<task {self.tid} step {self.sid} slot {self.slot}>"


NO_ARGS = (-1, -1, -1, -1, -1, -1, 0)


def op_args(**kw: int) -> tuple[int, ...]:
    """An operation's argument tuple: ``NO_ARGS`` with the named ones set."""
    a = dict(zip(("req", "kind", "slot", "sid", "tid", "rid", "keys"), NO_ARGS))
    a.update(kw)
    return tuple(a.values())


_FIELDS: dict[type, dict[str, int]] = {}


def rep(t: Any, **kw: Any) -> Any:
    """``t._replace(**kw)`` without its per-call overhead (a hot path here)."""
    cls = type(t)
    index = _FIELDS.get(cls)
    if index is None:
        index = _FIELDS[cls] = {name: i for i, name in enumerate(cls._fields)}
    values = list(t)
    for name, value in kw.items():
        values[index[name]] = value
    return tuple.__new__(cls, values)


def nothing(c: Any) -> None:
    """A handler that changes nothing in the model's world."""
    return None


def with_tid(c: Ctx, tid: int) -> Ctx:
    """``c`` with its task argument set to ``tid`` (for a guard per waited task)."""
    c.tid = tid
    return c


def holders_text(busy: frozenset[tuple[int, int]]) -> str:
    """A page's holders by name."""
    return ", ".join(f"{'step' if kind == STEP else 'task'} {ident}" for kind, ident in sorted(busy))
