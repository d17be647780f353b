"""What the model reads off the compiled component machines.

The state enums of each role, the state sets named by tags, finals and
settling states, the write task's event states, and the protocol's
(position, task state) pairs: derived once from the spec, so the binding,
the environment, the invariants and the renderer share one reading of it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from omni_prefix_cache.specs.compiled import CompiledMachine
from omni_prefix_cache.specs.composition import ProtocolSpec
from omni_prefix_cache.specs.loader import MoveSpec
from omni_prefix_cache.testing.specfacts import states_after


def _has_effect(effect: str, move: MoveSpec) -> bool:
    return effect in move.effects


class ModelFacts:
    """State names and sets of the model's roles (``task``, ``position``,
    ``task_holder``, ``step``, ``slot``, ``read``), for ``keys`` pool keys
    per slot. Read-only once built."""

    def __init__(self, spec: ProtocolSpec, m: Mapping[str, CompiledMachine], keys: int):
        comps = spec.components
        self.m = m
        self.keys = keys
        T, P, H = m["task"].State, m["position"].State, m["task_holder"].State
        Occ, S, R = m["slot"].State, m["step"].State, m["read"].State
        self.T, self.P, self.H, self.Occ, self.S, self.R = T, P, H, Occ, S, R
        self.accepts = frozenset(int(s) for s in m["task"].tagged("accepts_chunks"))
        self.task_final = frozenset(int(s) for s in m["task"].final)
        self.read_final = frozenset(int(s) for s in m["read"].final)
        tspec = comps["task"]
        self.events = {
            name: tuple(
                frozenset(int(T[s]) for s in part) for part in states_after(tspec, functools.partial(_has_effect, eff))
            )
            for name, eff in (("host_ready", "set_host_ready"), ("done", "set_done"))
        }
        self.claimed = frozenset(int(T[s]) for s in states_after(tspec, lambda mv: mv.trigger == "claim_copy")[0])
        self.slot_rest = frozenset(int(Occ[s]) for s in comps["slot"].settling_states())
        self.held, self.unheld = int(H["HELD"]), int(H[comps["task_holder"].initial])
        self.FAILED = int(T["FAILED"])
        self.UNSAVED, self.SAVED = int(S["UNSAVED"]), int(S["SAVED"])
        self.ABSENT, self.IN_TRANSIT, self.COMMITTED = int(Occ["ABSENT"]), int(Occ["IN_TRANSIT"]), int(Occ["COMMITTED"])
        self.HIGH, self.LOW, self.STALE = int(P["HIGH"]), int(P["LOW"]), int(P["STALE"])
        self.on_queue = frozenset((self.HIGH, self.LOW, self.STALE))
        self.pairs = {int(P[p]): frozenset(int(T[t]) for t in ts) for p, ts in spec.pairs.items()}

    def cell(self, index: int) -> str:
        """A (slot, key) cell by name."""
        K = self.keys
        return f"slot {index // K}" + (f" key {index % K}" if K > 1 else "")
