"""Hypothesis state machines generated from the composition spec
(``spec/protocol.yaml``), run against the real manager and controller.

``build_machine(spec, eager=...)`` makes one rule per driver of the spec's
operations (``DRIVERS`` is the one table mapping each operation to the rule
that starts it) and one ``@invariant()`` per name in
``spec.invariants_for("tests")`` (``CHECKERS`` binds each to a method of
that name). An operation without a driver, or an invariant without a
checker, is a build-time error, so the spec and the tests cannot drift.

The manager runs with ``committer="manual"``: the committer moves only when
a committer rule runs (``committer_claim``, ``committer_copy``,
``committer_write``) or when someone joins a task (the join operation: the
save barrier, a budget flush, a prefetch waiting for a pool write, or the
``join`` rule), in which case the joining thread steps the committer itself
until the task's event fires. Prefetches wait in a lazy executor until a
rule runs them (in order, or one paused at its version check on its own
thread while later saves reuse its slots: the copy-on-write race).

The row oracle is ``ServingModel``: a sequential engine that knows every
request's tokens and block table, so every materialized row and every
committed pool row is predicted with no cache at all (an mm key the slot's
tenant never wrote is the baseline, zeros). Its failures start with
"row oracle:".

Modules: ``workload`` (sizes, keys, the DRIVERS / CHECKERS tables),
``machine`` (``ProtocolMachine``: the runtime, its seams, the drivers),
``checks`` (``ProtocolChecks``: one checker per invariant, the row oracle)
and ``building`` (``build_machine`` and the tables' checks).
"""

from __future__ import annotations

from omni_prefix_cache.testing.protocol_tests.building import build_machine as build_machine
from omni_prefix_cache.testing.protocol_tests.building import invariant_names as invariant_names
from omni_prefix_cache.testing.protocol_tests.building import invariant_table as invariant_table
from omni_prefix_cache.testing.protocol_tests.building import rule_table as rule_table
from omni_prefix_cache.testing.protocol_tests.checks import ProtocolChecks as ProtocolChecks
from omni_prefix_cache.testing.protocol_tests.machine import ProtocolMachine as ProtocolMachine
from omni_prefix_cache.testing.protocol_tests.workload import CHECKERS as CHECKERS
from omni_prefix_cache.testing.protocol_tests.workload import DRIVERS as DRIVERS
