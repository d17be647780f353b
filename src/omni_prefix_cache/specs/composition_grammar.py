"""The forms of the composition spec (``spec/protocol.yaml``): the steps an
operation's segments are made of, its segments and the operation itself.

- ``Fire``: ``"role.trigger"`` fires a component move (it must be enabled);
  ``"role.trigger?"`` fires it where enabled, else nothing;
- ``Do``: ``{do: EFFECT}``, a protocol effect declared in ``effects``;
- ``When``: ``{when: GUARD, then: [...], else: [...]}`` (``GUARD`` may be
  ``not NAME``);
- ``FirstOf``: ``{first_of: [[...], ...]}``, the first alternative whose
  leading step is an enabled move (or which starts with no move) runs;
- ``Couple``: ``{couple: role.COUPLING}``, a coupling the role's machine declares.

A ``Segment`` runs atomically under one lock (or is a blocking wait);
other threads interleave only between segments.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from omni_prefix_cache.specs.loader import TriggerName


@dataclass(frozen=True, eq=False)
class Fire:
    """Fire ``trigger`` on ``role``'s instance; ``optional`` = only where enabled."""

    role: str
    trigger: TriggerName
    optional: bool

    @property
    def label(self) -> str:
        return f"{self.role}.{self.trigger}" + ("?" if self.optional else "")


@dataclass(frozen=True, eq=False)
class Do:
    effect: str

    @property
    def label(self) -> str:
        return self.effect


@dataclass(frozen=True, eq=False)
class When:
    guard: str
    negate: bool
    then: tuple[Step, ...]
    orelse: tuple[Step, ...]

    @property
    def label(self) -> str:
        return f"when {'not ' if self.negate else ''}{self.guard}"


@dataclass(frozen=True, eq=False)
class FirstOf:
    alternatives: tuple[tuple[Step, ...], ...]

    @property
    def label(self) -> str:
        return "first of"


@dataclass(frozen=True, eq=False)
class Couple:
    role: str
    coupling: str

    @property
    def label(self) -> str:
        return f"{self.role}.{self.coupling}"


Step = Fire | Do | When | FirstOf | Couple


@dataclass(frozen=True, eq=False)
class Segment:
    """Atomic under ``lock`` (``steps``), or a blocking wait (``wait``).
    ``name`` is unique in its operation: executors run a segment by name."""

    name: str
    lock: str
    steps: tuple[Step, ...] = ()
    wait: str | None = None
    of: str | None = None
    raises: str | None = None

    @property
    def label(self) -> str:
        return f"wait {self.wait}" if self.wait else f"[{self.lock}]"


@dataclass(frozen=True, eq=False)
class Executor:
    """Who runs a share of the protocol: the moves of ``roles`` (except,
    per operation, the roles ``leaves`` names) and the effects it lists."""

    name: str
    meaning: str
    roles: frozenset[str]
    effects: frozenset[str]
    leaves: Mapping[str, frozenset[str]]

    def roles_in(self, operation: str) -> frozenset[str]:
        """The roles whose moves this executor fires in ``operation``."""
        left = self.leaves.get(operation)
        return self.roles - left if left else self.roles


@dataclass(frozen=True, eq=False)
class OperationSpec:
    name: str
    caller: str
    meaning: str
    for_each: str | None
    segments: tuple[Segment, ...]
    # The move that admits an instance: the operation runs for it only while
    # this move is enabled, and is a no-op otherwise (e.g. fail of a task
    # already terminal). None: always runs.
    entry: Fire | None = None

    def walk(self) -> Iterator[Step]:
        """Every step, depth first, in declaration order."""
        for seg in self.segments:
            yield from walk_steps(seg.steps)

    @functools.cached_property
    def moves(self) -> frozenset[tuple[str, str]]:
        """(role, trigger) of every move this operation may fire."""
        return frozenset((s.role, s.trigger) for s in self.walk() if isinstance(s, Fire))

    @functools.cached_property
    def segment_names(self) -> tuple[str, ...]:
        return tuple(seg.name for seg in self.segments)

    def index_of(self, segment: str) -> int:
        """The position of the segment named ``segment`` (KeyError naming the
        operation's segments when it has none)."""
        try:
            return self.segment_names.index(segment)
        except ValueError:
            raise KeyError(
                f"operation {self.name} has no segment {segment!r} (segments: {self.segment_names})"
            ) from None

    def only(self, *segments: str) -> OperationSpec:
        """These segments alone, in the operation's order, as an operation of
        the same name (an executor runs the segments of an operation it
        shares with another executor)."""
        keep = {self.index_of(name) for name in segments}
        kept = tuple(seg for i, seg in enumerate(self.segments) if i in keep)
        return OperationSpec(
            self.name, self.caller, self.meaning, self.for_each, kept, self.entry if 0 in keep else None
        )

    def projected(self, roles: frozenset[str], effects: frozenset[str], name: str | None = None) -> OperationSpec:
        """The steps of ``roles`` and ``effects`` only, in the same order and
        under the same guards (a ``when`` whose branches project to nothing
        is dropped; an empty segment stays, as a no-op): what one executor
        runs of an operation whose other steps another executor runs."""

        def keep(steps: tuple[Step, ...]) -> tuple[Step, ...]:
            out: list[Step] = []
            for s in steps:
                if isinstance(s, Fire | Couple):
                    if s.role in roles:
                        out.append(s)
                elif isinstance(s, Do):
                    if s.effect in effects:
                        out.append(s)
                elif isinstance(s, When):
                    then, orelse = keep(s.then), keep(s.orelse)
                    if then or orelse:
                        out.append(When(s.guard, s.negate, then, orelse))
                else:
                    alts = tuple(keep(a) for a in s.alternatives)
                    if any(alts):
                        out.append(FirstOf(alts))
            return tuple(out)

        segments = tuple(seg if seg.wait else Segment(seg.name, seg.lock, keep(seg.steps)) for seg in self.segments)
        entry = self.entry if self.entry is not None and self.entry.role in roles else None
        return OperationSpec(name or self.name, self.caller, self.meaning, self.for_each, segments, entry)

    def order_labels(self) -> list[str]:
        """Step labels in order (waits as ``wait EVENT``), for ordering rules."""
        out: list[str] = []
        for seg in self.segments:
            if seg.wait:
                out.append(f"wait {seg.wait}")
            out.extend(s.label for s in walk_steps(seg.steps) if isinstance(s, Fire | Do | Couple))
        return out


def walk_steps(steps: Sequence[Step]) -> Iterator[Step]:
    """Every step of ``steps``, depth first (a ``when``'s branches and a
    ``first_of``'s alternatives after the step itself), in declaration order."""
    for s in steps:
        yield s
        if isinstance(s, When):
            yield from walk_steps(s.then)
            yield from walk_steps(s.orelse)
        elif isinstance(s, FirstOf):
            for alt in s.alternatives:
                yield from walk_steps(alt)
