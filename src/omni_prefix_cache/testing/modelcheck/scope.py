"""What each of the model checker's two worlds interprets, and the proof
that together they leave no step of an operation they run unread.

The write-path model (``ComposedModel``) and the lifecycle model
(``LifecycleModel``) each run some operations of spec/protocol.yaml and
interpret some of their roles, effects and guards; the rest of an operation
they run is *abstracted* there (a move on a role it does not hold is a
no-op, a guard it does not read decides nothing). A ``Scope`` says which.
``uncovered`` walks every operation some model runs and returns each move
or effect that no model running it reaches through guards it reads: such
a step would be silently ignored, so a mutation of it could pass, and the
models refuse to build (``check_coverage``). A guard a model *assumes*
(a constant, with the reason in ``assumed``) reads only the branch it takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from omni_prefix_cache.specs.composition import Couple, Do, Fire, FirstOf, ProtocolSpec, Step, When
from omni_prefix_cache.specs.loader import SpecError


@dataclass(frozen=True)
class Scope:
    """One model's reading of the protocol.

    ``runs``: the operations it runs (started by its environment or from
    an effect it interprets); ``roles``, ``effects``, ``guards``: what it
    interprets; ``assumed``: guards it takes as a constant (name -> value);
    ``left_out``: effects it leaves out on purpose, with the reason (they
    count as read: what they would do is outside both worlds).
    """

    name: str
    runs: frozenset[str]
    roles: frozenset[str]
    effects: frozenset[str]
    guards: frozenset[str]
    assumed: Mapping[str, bool] = field(default_factory=dict)
    left_out: Mapping[str, str] = field(default_factory=dict)

    def reads(self, step: Step) -> bool:
        """Whether a move, coupling or effect is interpreted here."""
        if isinstance(step, Fire | Couple):
            return step.role in self.roles
        if isinstance(step, Do):
            return step.effect in self.effects or step.effect in self.left_out
        return True


def _reached(scope: Scope, steps: Sequence[Step], path: str, out: set[str]) -> None:
    """Add the path of every leaf step ``scope`` reaches through guards it reads."""
    for i, s in enumerate(steps):
        here = f"{path}.{i}"
        if isinstance(s, When):
            if s.guard in scope.guards:
                _reached(scope, s.then, here + "t", out)
                _reached(scope, s.orelse, here + "e", out)
            elif s.guard in scope.assumed:
                taken = scope.assumed[s.guard] != s.negate
                _reached(scope, s.then if taken else s.orelse, here + ("t" if taken else "e"), out)
                # The branch never taken: only an effect left out on purpose is read there.
                skipped = s.orelse if taken else s.then
                for where, leaf in _leaves(skipped, here + ("e" if taken else "t")):
                    if (isinstance(leaf, Do) and leaf.effect in scope.left_out) or (
                        isinstance(leaf, Couple) and leaf.label in scope.left_out
                    ):
                        out.add(where)
        elif isinstance(s, FirstOf):
            for j, alt in enumerate(s.alternatives):
                head = alt[0] if alt else None
                if head is None or not isinstance(head, Fire) or scope.reads(head):
                    _reached(scope, alt, f"{here}a{j}", out)
        elif scope.reads(s):
            out.add(here)


def _leaves(steps: Sequence[Step], path: str) -> list[tuple[str, Step]]:
    out: list[tuple[str, Step]] = []
    for i, s in enumerate(steps):
        here = f"{path}.{i}"
        if isinstance(s, When):
            out += _leaves(s.then, here + "t") + _leaves(s.orelse, here + "e")
        elif isinstance(s, FirstOf):
            for j, alt in enumerate(s.alternatives):
                out += _leaves(alt, f"{here}a{j}")
        else:
            out.append((here, s))
    return out


def uncovered(spec: ProtocolSpec, scopes: Sequence[Scope]) -> list[str]:
    """Every move or effect of an operation some scope runs that no scope
    running it reads (``operation: step``); empty when the models together
    read every step of every operation they run."""
    missing: list[str] = []
    for op in spec.operations:
        runners = [sc for sc in scopes if op.name in sc.runs]
        if not runners:
            continue
        for k, seg in enumerate(op.segments):
            reached: set[str] = set()
            for sc in runners:
                _reached(sc, seg.steps, str(k), reached)
            for path, leaf in _leaves(seg.steps, str(k)):
                if path not in reached:
                    label = getattr(leaf, "label", repr(leaf))
                    missing.append(f"{op.name}: {label} (read by no model that runs {op.name})")
    return missing


def check_coverage(spec: ProtocolSpec, scopes: Sequence[Scope]) -> None:
    """Raise SpecError naming the steps no model reads (see ``uncovered``)."""
    missing = uncovered(spec, scopes)
    if missing:
        raise SpecError(
            f"{spec.origin}: the model checker would silently ignore these steps (a mutation of them could "
            "pass): " + "; ".join(missing)
        )


# The write path: tasks, queues, staging, slots, reads; no lifecycle events.
WRITE_SCOPE = Scope(
    name="write path",
    runs=frozenset(
        {
            *("new_step", "save", "abandon_save", "escalate", "committer_claim", "committer_copy"),
            *("committer_write", "fail", "drain", "materialize", "discard", "prefetch", "linger"),
        }
    ),
    roles=frozenset({"task", "position", "task_holder", "step_holder", "step", "slot", "read"}),
    effects=frozenset(
        {
            *("register_task", "append_chunk", "charge_budget", "refund_unpinned", "unpin_budget"),
            *("wake_committer", "copy_to_host", "pool_write", "publish_completed", "publish_failed"),
            *("wake_failed", "take_records", "sticky_failure", "plan_hits", "fetch_rows", "merge_outputs"),
        }
    ),
    guards=frozenset(
        {
            *("immediate", "queued_at_submit", "open_write_accepts", "task_failed", "failures_drained"),
            *("rows_planned", "rows_fetched"),
        }
    ),
    assumed={
        "over_budget": False,
        "eager": False,
        "replayed_step": False,
        "tier_loads": False,
        "tier_joins": False,
        "accepted_rows_refused": False,
    },
    left_out={
        "refuse_accepted_rows": (
            "the engine passes accepted rows that fit its step (a misfit raises before anything moves: "
            "tests/test_spec_decode.py)"
        ),
        "apply_tier": "the host tier is checked by its own spec's generated machine and the tier model check",
        "fill_reused_blocks": "the host tier is checked by its own spec's generated machine and the tier model check",
        "join_for_tier": "tier_joins is false here: the tier holds nothing",
        "slot.restore_tenancy": "tier_loads is false here: a step restores no block",
        "replan_same_step_hits": "hits on the step's own writes are not modelled",
        "flush_oldest": "budget flushes are left out (over_budget is false; escalate covers the flush's escalate)",
        "dispatch_inline": "eager dispatch is left out (eager is false)",
        "restore_step_input": "a save abandons before its step is issued and holds no hit (hits are new_step's reads)",
        "take_step_input": "the engine's step order is the environment's: each save follows its new_step",
        "start_prefetch": "a save plans no read here (hits on the step's own writes are not modelled)",
        "fail_stranded": "a save abandons before it registers a write: nothing is stranded",
        "escalate_detached": (
            "the write path's steps carry no events, so nothing is detached; the engine escalates any "
            "unfinished task at any time (operation escalate)"
        ),
    },
)

# The lifecycle: tenures, their delivery watermarks and the steps that carry
# events and positions; the write path is abstracted as saved positions.
LIFE_SCOPE = Scope(
    name="lifecycle",
    runs=frozenset(
        {
            *("new_step", "request_event", "retire_owner", "retire_delivery", "save", "materialize"),
            *("discard", "delivery_view", "ack_delivery", "commit_output"),
        }
    ),
    roles=frozenset({"request", "delivery", "step"}),
    effects=frozenset(
        {
            *("apply_events", "ignore_event", "retire_current", "open_tenure", "retire_deliveries"),
            *("record_saved", "plan_hits", "merge_outputs", "raise_gap", "raise_refused", "clip_outputs"),
            *("filter_retired", "check_handoff", "handoff", "ack_live", "cut_rejected"),
        }
    ),
    guards=frozenset(
        {
            *("ignored_event", "terminal_event", "newer_owner", "opens_tenure", "lookup_complete", "gap"),
            *("outside_saved", "not_issued", "spent_view"),
        }
    ),
    # A refused plan or a failed fetch is the write model's; here every planned hit is served.
    assumed={
        "replayed_step": False,
        "rows_planned": True,
        "rows_fetched": True,
        "tier_loads": False,
        "tier_joins": False,
        "accepted_rows_refused": False,
    },
    left_out={
        "refuse_accepted_rows": (
            "the engine passes accepted rows that fit its step (a misfit raises before anything moves: "
            "tests/test_spec_decode.py)"
        ),
        "apply_tier": "the host tier is checked by its own spec's generated machine and the tier model check",
        "fill_reused_blocks": "the host tier is checked by its own spec's generated machine and the tier model check",
        "join_for_tier": "tier_joins is false here: the tier holds nothing",
        "slot.restore_tenancy": "tier_loads is false here: a step restores no block",
        "validate_events": "the environment sends only events the adapter's rules allow",
        "escalate_detached": "writes are saved positions here: a detached write has landed",
        "take_step_input": "the engine's step order is the environment's: each save follows its new_step",
        "start_prefetch": "a save plans no read here (hits on the step's own writes are not modelled)",
        "wake_committer": "the write path is abstracted as saved positions: there is no committer to wake",
    },
)

SCOPES = (WRITE_SCOPE, LIFE_SCOPE)
