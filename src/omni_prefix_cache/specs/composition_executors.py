"""The composition's ``executors`` (spec/protocol.yaml): who runs which
part of the protocol. Every effect is exactly one executor's and every role
at least one's; ``except`` names, per operation, roles whose moves another
executor fires there. ``ProtocolSpec.share`` projects an operation on one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_prefix_cache.specs.composition_grammar import Executor, OperationSpec
from omni_prefix_cache.specs.loader import MachineSpec, SpecError

_REQUIRED = frozenset({"name", "meaning", "roles", "effects"})


def _fail(origin: str, where: str, what: str) -> SpecError:
    return SpecError(f"{origin}: {where}: {what}")


def parse_executors(
    raw: Any,
    components: Mapping[str, MachineSpec],
    effects: set[str],
    operations: tuple[OperationSpec, ...],
    origin: str,
) -> dict[str, Executor]:
    """Parse ``executors``: every effect is exactly one executor's, every
    role at least one's, and ``except`` names operations and roles that exist."""
    if not isinstance(raw, list) or not raw:
        raise _fail(origin, "executors", "must be a list of {name, meaning, roles, effects, except?}")
    op_names = {op.name for op in operations}
    out: dict[str, Executor] = {}
    owner: dict[str, str] = {}
    for i, item in enumerate(raw):
        where = f"executor #{i}"
        if not isinstance(item, Mapping) or not _REQUIRED <= set(item) <= _REQUIRED | {"except"}:
            raise _fail(origin, where, "needs 'name', 'meaning', 'roles', 'effects' and an optional 'except'")
        name = str(item["name"])
        if name in out:
            raise _fail(origin, f"executor {name}", "declared twice")
        roles = frozenset(str(r) for r in item["roles"] or ())
        unknown = sorted(roles - set(components))
        if unknown:
            raise _fail(origin, f"executor {name}", f"unknown roles {unknown}")
        mine = frozenset(str(e) for e in item["effects"] or ())
        undeclared = sorted(mine - effects)
        if undeclared:
            raise _fail(origin, f"executor {name}", f"undeclared effects {undeclared}")
        for eff in sorted(mine):
            if eff in owner:
                raise _fail(origin, f"executor {name}", f"effect {eff!r} is already executor {owner[eff]}'s")
            owner[eff] = name
        leaves: dict[str, frozenset[str]] = {}
        for op_name, left in (item.get("except") or {}).items():
            if op_name not in op_names or not set(left) <= roles:
                raise _fail(origin, f"executor {name}", f"except {op_name}: {left} names no operation or role of it")
            leaves[str(op_name)] = frozenset(str(r) for r in left)
        out[name] = Executor(name, str(item["meaning"]).strip(), roles, mine, leaves)
    orphans = sorted(effects - set(owner))
    if orphans:
        raise _fail(origin, "executors", f"effects no executor runs: {orphans}")
    homeless = sorted(set(components) - {r for ex in out.values() for r in ex.roles})
    if homeless:
        raise _fail(origin, "executors", f"roles no executor moves: {homeless}")
    return out
