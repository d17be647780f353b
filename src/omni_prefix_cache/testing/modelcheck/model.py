"""``ComposedModel``: the protocol's operations over the model world.

Assembles the parts: the variant's spec (``model_mutations.load_variant``),
the binding that compiles its component machines (``binding``), the
protocol compiled against that binding, the environment that picks the
threads' next actions (``environment``), and the invariants
(``invariants``), each protocol invariant declared for the model matched to
its checker by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

from omni_prefix_cache.specs.composition import CompiledOperation, ProtocolSpec, compile_protocol
from omni_prefix_cache.specs.loader import MachineSpec, SpecError
from omni_prefix_cache.testing.model_mutations import load_variant
from omni_prefix_cache.testing.modelcheck import render
from omni_prefix_cache.testing.modelcheck.binding import ModelBinding
from omni_prefix_cache.testing.modelcheck.environment import ModelEnvironment
from omni_prefix_cache.testing.modelcheck.facts import ModelFacts
from omni_prefix_cache.testing.modelcheck.invariants import MachineInvariants, SystemInvariants
from omni_prefix_cache.testing.modelcheck.life_invariants import LifeInvariants
from omni_prefix_cache.testing.modelcheck.scope import SCOPES, check_coverage
from omni_prefix_cache.testing.modelcheck.world import ENGINE, Bounds, Label, World

REQUIRED_OPERATIONS = ("new_step", "save", "escalate", "committer_claim", "committer_copy", "committer_write")
# What only the engine thread starts (the idle rule's engine makes none of them).
ENGINE_OPERATIONS = frozenset({"new_step", "save", "abandon_save", "escalate", "discard"})


class ComposedModel:
    """The protocol's operations over the model world: initial state,
    actions (operation segments), invariants. ``facts`` and ``ops`` are
    what ``render`` needs to name its worlds and actions."""

    def __init__(
        self,
        bounds: Bounds,
        broken: str | None = None,
        specs: Mapping[str, MachineSpec] | None = None,
        protocol: ProtocolSpec | None = None,
    ):
        """``broken``: a catalogued mutation or a protocol file; ``specs``
        replaces component machines by name; ``protocol`` a whole spec.
        Raises SpecError for a spec the model cannot run (a missing role or
        operation, a declared invariant without a checker or the reverse),
        ValueError for an unknown broken variant."""
        self.bounds = bounds
        self.broken = broken
        spec, self.expected = load_variant(broken) if protocol is None else (protocol, None)
        if specs:
            spec = dataclasses.replace(
                spec, components={role: specs.get(m.name, m) for role, m in spec.components.items()}
            )
        self.spec = spec
        self.binding = ModelBinding(bounds, spec)
        self.facts: ModelFacts = self.binding.f
        self.ops: dict[str, CompiledOperation] = compile_protocol(
            spec, self.binding, self.binding.effects(), self.binding.guards
        )
        check_coverage(spec, SCOPES)
        self.environment = ModelEnvironment(
            bounds, self.facts, self.ops, self.binding.guards, self.binding.no_op_effects
        )
        self.system = SystemInvariants(self.facts)
        self.machines = MachineInvariants(self.facts)
        self.checkers: dict[str, Callable[[World], None]] = self.system.checkers()
        declared = set(spec.invariants_for("model"))
        # The lifecycle model checks the rest (LifecycleModel); together they check every one.
        both = set(self.checkers) | set(LifeInvariants.NAMES)
        missing, extra = sorted(declared - both), sorted(both - declared)
        if missing or extra:
            raise SpecError(
                f"{spec.origin}: the model checks invariants {sorted(both)}; "
                f"declared for the model without a checker: {missing}; checkers with no declared name: {extra}"
            )
        for name in REQUIRED_OPERATIONS:
            if name not in self.ops:
                raise SpecError(f"{spec.origin}: the model needs operation {name!r}")

    def initial(self) -> World:
        """The empty world: no task, no step, every slot fresh."""
        return self.environment.initial()

    def successors(self, w: World) -> Iterator[tuple[Label, World]]:
        """``(label, next world)`` for every enabled action (``ModelEnvironment.successors``)."""
        return self.environment.successors(w)

    def canonical(self, w: World) -> World:
        """``w`` with what no later move or check reads forgotten."""
        return self.environment.canonical(w)

    def settled(self, w: World) -> bool:
        """Nothing left to run in ``w`` (``ModelEnvironment.settled``)."""
        return self.environment.settled(w)

    # ------------------------------------------------ idle_writes_land
    # The idle rule: from a world whose engine thread makes no further call, the
    # other threads alone reach one with nothing queued and no page held.
    idle_invariant = "idle_writes_land"

    def idle(self, w: World) -> bool:
        """The engine thread is between calls in ``w`` (the idle rule judges ``w``)."""
        return not w.threads[ENGINE]

    def idle_settled(self, w: World) -> bool:
        """Both queues empty, no thread but the engine's in an operation, no staging page held."""
        return not w.hi and not w.lo and not any(w.threads[1:]) and not any(w.pages)

    @staticmethod
    def background(label: Label) -> bool:
        """An action of a thread other than the engine's (a drain may be the committer's: it counts)."""
        return label[0] not in ENGINE_OPERATIONS

    def check_state(self, w: World) -> None:
        """Raise Violation for the first invariant ``w`` breaks: the
        protocol's, then the component machines' own."""
        for check in self.checkers.values():
            check(w)
        self.machines.check_state(w)

    def check_move(self, before: World, after: World, label: Label | None = None) -> None:
        """Raise Violation for a move that breaks a per-move invariant."""
        self.machines.check_move(before, after)

    # ------------------------------------------------------------ text
    name = "write path"

    def describe(self) -> str:
        return self.bounds.describe()

    def label_text(self, label: Label) -> str:
        return render.describe_label(self.facts, self.ops, label)

    def change_text(self, a: World, b: World) -> str:
        return render.describe_change(self.facts, a, b)

    def world_text(self, w: World) -> list[str]:
        return render.describe_world(self.facts, self.ops, w)

    def unsettled(self, w: World) -> list[str]:
        return render.unsettled(self.facts, w)
