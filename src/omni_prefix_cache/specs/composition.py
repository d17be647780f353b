"""Load, validate and compile the composition spec (``spec/protocol.yaml``).

The composition names the component machines by role (``task`` ->
``write_task``, ...) and declares every facade and committer operation as
segments of steps over them. A segment runs atomically under one lock;
other threads interleave only between segments. Steps:

- ``"role.trigger"``: fire a component move; it must be enabled;
- ``"role.trigger?"``: fire it where enabled, else nothing;
- ``{do: EFFECT}``: a protocol effect declared in ``effects``;
- ``{when: GUARD, then: [...], else: [...]}`` (``GUARD`` may be ``not NAME``);
- ``{first_of: [[...], ...]}``: the first alternative whose leading step is
  an enabled move (or which starts with no move) runs;
- ``{couple: role.COUPLING}``: a coupling the role's machine declares.

``compile_operation`` turns an operation into plain closures over a
``Binding`` (the runtime's, the model checker's or a test's handlers), so
no YAML is interpreted per call. ``ProtocolSpec.mutated`` returns a patched
copy: the model checker's broken variants and spec mutants are patches of
this spec, not switches in code.

The names live in three modules, all importable from here:
``composition_grammar`` (the step, segment and operation forms),
``composition_loader`` (``ProtocolSpec``, parsing, validation, loading) and
``composition_compile`` (``Binding``, ``compile_operation``).
"""

from __future__ import annotations

from omni_prefix_cache.specs.composition_compile import (
    Binding,
    CompiledOperation,
    ProtocolViolation,
    Run,
    compile_operation,
    compile_protocol,
)
from omni_prefix_cache.specs.composition_grammar import (
    Couple,
    Do,
    Fire,
    FirstOf,
    OperationSpec,
    Segment,
    Step,
    When,
    walk_steps,
)
from omni_prefix_cache.specs.composition_loader import (
    InvariantSpec,
    Link,
    Named,
    Ordering,
    ProtocolSpec,
    load_protocol,
    parse_protocol,
)

# Files in spec/ that are compositions, not machines (spec_names skips them).
COMPOSITION_NAMES = ("protocol",)

__all__ = [
    "COMPOSITION_NAMES",
    "Binding",
    "CompiledOperation",
    "Couple",
    "Do",
    "Fire",
    "FirstOf",
    "InvariantSpec",
    "Link",
    "Named",
    "OperationSpec",
    "Ordering",
    "ProtocolSpec",
    "ProtocolViolation",
    "Run",
    "Segment",
    "Step",
    "When",
    "compile_operation",
    "compile_protocol",
    "load_protocol",
    "parse_protocol",
    "walk_steps",
]
