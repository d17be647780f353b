"""Bounded exhaustive check of the composition spec (TLC-style).

The model interprets ``spec/protocol.yaml``: its actions are the protocol's
operations, compiled with ``specs.composition.compile_protocol`` against the
model's ``Binding`` (``binding.ModelBinding.move`` / ``coupling``), whose
component moves come from the compiled machines (``write_task``,
``copy_queue``, ``staging_holder``, ``step_context``, ``slot_occupancy``,
``planned_read``) and whose effect and guard handlers act on the model's
world. Each segment of an operation is one atomic action; an operation in
progress is part of the world (which segment each thread is at), so other
threads interleave only between segments. A segment the model cannot
observe (a wait on a monotone event, or only effects that are no-ops here)
runs on into the next one in the same action. No action moves a component
except through a compiled operation.

What the model chooses itself is the environment: which operation a thread
starts, for which request, task, step, slot or key, which save kind
(immediate, deferred, deferred submitted queued; which mm keys it writes),
where something fails (the committer's copy or pool write, a failure on
another thread, a save after its claim: ``abandon_save``), and the bounds.
The threads: the engine (new_step, save, escalate of any unfinished task,
drain, discard), a reader (lagged materialize), the committer (claim ->
copy -> write, high queue first) and a failing thread. Left out: eager
dispatch and budget flushes (``eager`` and ``over_budget`` are false; the
flush's escalate is covered by escalate), shutdown, joins by readers, a
read of an in-transit slot (reads plan committed cells) and hits on the
step's own writes (``replan_same_step_hits`` is a no-op).

A second world, the request lifecycle (``LifecycleModel``: ``life_world``,
``life_binding``, ``life_invariants``, ``life_model``), interprets the
lifecycle operations (new_step's events, request_event, retire_owner,
retire_delivery, save's record_saved, materialize, discard, delivery_view,
ack_delivery, commit_output) over one request id, its tenures and two
consumers, the write path abstracted as saved positions; the write-path
world above treats the lifecycle's roles and effects as no-ops. ``scope``
proves the two together read every step of every operation they run, so
neither silently ignores what a mutation could change. ``check`` searches
both (``Bounds.life`` sizes the second).

The system invariants are the protocol's ``invariants_for("model")``, each
bound to one checker by name in one of the two worlds (``SystemInvariants``,
``LifeInvariants``); a name without a checker, or a checker without a name,
refuses to build the model. The machines' own invariants
are checked too. ``can_settle`` is liveness: every reachable state can
still reach a settled one. Broken variants (``BROKEN``) are spec mutations:
patches of the loaded protocol and/or component machines, or a whole
protocol file. A violation is reported with a shortest trace from the
initial state in operation-level steps (``escalate(task 0)``,
``committer_write[2](task 1)``).

Modules: ``world`` (the explored state, its scratch context, the bounds),
``facts`` (what the model reads off the compiled machines), ``binding``
(component moves and the protocol's handlers), ``environment`` (the
threads' next actions, symmetry and canonical states), ``invariants`` (one
checker object per group), ``render`` (text for actions, worlds, traces),
``model`` (``ComposedModel`` assembles them) and ``check`` (the search).
"""

from omni_prefix_cache.testing.model_mutations import BROKEN as BROKEN  # re-exported: the catalogue
from omni_prefix_cache.testing.model_mutations import Mutation as Mutation
from omni_prefix_cache.testing.modelcheck.check import CheckResult as CheckResult
from omni_prefix_cache.testing.modelcheck.check import check as check
from omni_prefix_cache.testing.modelcheck.life_model import LifecycleModel as LifecycleModel
from omni_prefix_cache.testing.modelcheck.life_world import LifeBounds as LifeBounds
from omni_prefix_cache.testing.modelcheck.model import ComposedModel as ComposedModel
from omni_prefix_cache.testing.modelcheck.world import BIG_BOUNDS as BIG_BOUNDS
from omni_prefix_cache.testing.modelcheck.world import CI_BOUNDS as CI_BOUNDS
from omni_prefix_cache.testing.modelcheck.world import DEF as DEF
from omni_prefix_cache.testing.modelcheck.world import DEFQ as DEFQ
from omni_prefix_cache.testing.modelcheck.world import IMM as IMM
from omni_prefix_cache.testing.modelcheck.world import NO_ARGS as NO_ARGS
from omni_prefix_cache.testing.modelcheck.world import Bounds as Bounds
from omni_prefix_cache.testing.modelcheck.world import Label as Label
from omni_prefix_cache.testing.modelcheck.world import Read as Read
from omni_prefix_cache.testing.modelcheck.world import Slot as Slot
from omni_prefix_cache.testing.modelcheck.world import Step as Step
from omni_prefix_cache.testing.modelcheck.world import Task as Task
from omni_prefix_cache.testing.modelcheck.world import Violation as Violation
from omni_prefix_cache.testing.modelcheck.world import World as World
