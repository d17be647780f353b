"""State-machine specs: load, validate, compile, and render.

The YAML files in the repository's top-level ``spec/`` are the single source
of truth for the runtime's lifecycles. This package turns them into:

- ``MachineSpec``: the validated, immutable declaration (``loader``);
- ``CompiledMachine``: a generated ``IntEnum`` plus constant-time move tables
  bound to the runtime's guard and effect handlers (``compiled``);
- a ``transitions.Machine`` oracle built from the same spec (``oracle``);
- graphviz diagrams (``diagrams``).
"""

from omni_prefix_cache.specs.compiled import CompiledMachine, CompiledMove, SpecState, compile_machine
from omni_prefix_cache.specs.loader import (
    MachineSpec,
    MoveSpec,
    SpecError,
    StateSpec,
    load_all_specs,
    load_spec,
    parse_spec,
    spec_names,
)

__all__ = [
    "CompiledMachine",
    "CompiledMove",
    "MachineSpec",
    "MoveSpec",
    "SpecError",
    "SpecState",
    "StateSpec",
    "compile_machine",
    "load_all_specs",
    "load_spec",
    "parse_spec",
    "spec_names",
]
