"""Generate typed Python modules from the specs, so type checkers and IDEs see the states.

For each ``spec/<name>.yaml`` this writes ``omni_prefix_cache/specs/types/<name>.py``
with the state enum (a ``SpecState`` subclass whose members, values and final
states are the spec's) and the trigger names (a ``StrEnum`` and a ``Literal``).
The runtime passes the generated enum to ``compile_machine(state_enum=...)``,
which refuses it when it no longer matches the spec; ``--check`` (and the test
suite) fail when a committed module differs from a fresh render.

Run: ``python -m omni_prefix_cache.specs.typegen [--check]`` (``make typed-specs``).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from omni_prefix_cache.specs.loader import MachineSpec, load_all_specs

OUT_DIR = Path(__file__).resolve().parent / "types"
_HEADER = "# Generated from spec/{name}.yaml by `make typed-specs`; do not edit.\n"


def _q(text: str) -> str:
    """A double-quoted string literal (the formatter's style)."""
    return json.dumps(text)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def trigger_enum_name(spec: MachineSpec) -> str:
    return f"{_camel(spec.name)}Trigger"


def _doc(text: str, indent: str) -> str:
    """A docstring literal of ``text`` wrapped to fit the line length."""
    text = " ".join(text.split()).replace("\\", "\\\\").replace('"""', '\\"\\"\\"') or "(no meaning given)"
    lines = textwrap.wrap(text, width=112 - len(indent))
    if len(lines) == 1:
        return f'{indent}"""{lines[0]}"""\n'
    body = "".join(f"{indent}{line}\n" for line in lines)
    return f'{indent}"""\n{body}{indent}"""\n'


def render_module(spec: MachineSpec) -> str:
    """The generated module's text for ``spec``."""
    enum, trig = spec.enum_name, trigger_enum_name(spec)
    out = [_HEADER.format(name=spec.name)]
    doc = f"Typed names of the ``{spec.name}`` spec: the ``{enum}`` states and the ``{trig}`` triggers."
    if len(doc) > 110:  # ruff's line length, with the quotes
        doc = f"Typed names of the ``{spec.name}`` spec:\nthe ``{enum}`` states and the ``{trig}`` triggers.\n"
    out.append(f'"""{doc}"""\n\n')
    out.append("from __future__ import annotations\n\n")
    out.append("from enum import StrEnum\n")
    out.append("from typing import Literal, TypeAlias\n\n")
    out.append("from omni_prefix_cache.specs.compiled import SpecState\n\n")
    out.append(f"SPEC_NAME = {_q(spec.name)}\n\n\n")
    out.append(f"class {enum}(SpecState):\n")
    out.append(_doc(spec.description, "    "))
    out.append("\n")
    for i, state in enumerate(spec.states):
        marks = [m for m, on in (("initial", state.initial), ("final", state.final)) if on]
        marks += [f"tag {t}" for t in state.tags]
        meaning = state.meaning + (f" ({', '.join(marks)})" if marks else "")
        out.append(f"    {state.name} = {i}\n")
        out.append(_doc(meaning, "    "))
    out.append("\n\n")
    finals = ", ".join(f"{enum}.{s}" for s in spec.final_states)
    out.append(f"{enum}.final_states = frozenset({{{finals}}})\n" if finals else f"{enum}.final_states = frozenset()\n")
    out.append(f"INITIAL = {enum}.{spec.initial}\n\n\n")
    out.append(f"class {trig}(StrEnum):\n")
    out.append(_doc(f"Trigger names of the {spec.name} spec.", "    "))
    out.append("\n")
    meaning_of: dict[str, str] = {}
    for move in spec.moves:
        meaning_of.setdefault(move.trigger, move.meaning)
    for trigger in spec.triggers:
        out.append(f"    {trigger.upper()} = {_q(trigger)}\n")
        out.append(_doc(meaning_of.get(trigger, ""), "    "))
    out.append("\n\n")
    names = ", ".join(_q(t) for t in spec.triggers)
    out.append(f"{trig}Name: TypeAlias = Literal[{names}]\n")
    text = "".join(out)
    if any(len(line) > 120 for line in text.splitlines()):
        # Literal lists of many triggers: one per line.
        items = "".join(f"    {_q(t)},\n" for t in spec.triggers)
        text = text.replace(f"Literal[{names}]", f"Literal[\n{items}]")
    return text


def render_init(specs: dict[str, MachineSpec]) -> str:
    lines = ["# Generated from spec/*.yaml by `make typed-specs`; do not edit.\n"]
    lines.append('"""Typed state enums and trigger names generated from the specs (one module per spec)."""\n\n')
    names: list[str] = []
    for name, spec in sorted(specs.items()):
        exported = sorted([spec.enum_name, trigger_enum_name(spec), f"{trigger_enum_name(spec)}Name"])
        line = f"from omni_prefix_cache.specs.types.{name} import {', '.join(exported)}\n"
        if len(line) > 121:  # ruff format's wrapping, one name per line
            inner = "".join(f"    {e},\n" for e in exported)
            line = f"from omni_prefix_cache.specs.types.{name} import (\n{inner})\n"
        lines.append(line)
        names += exported
    lines.append("\n__all__ = [\n" + "".join(f"    {_q(n)},\n" for n in sorted(names)) + "]\n")
    return "".join(lines)


def rendered(specs: dict[str, MachineSpec] | None = None) -> dict[str, str]:
    """File name -> text of every generated module."""
    specs = load_all_specs() if specs is None else specs
    files = {f"{name}.py": render_module(spec) for name, spec in specs.items()}
    files["__init__.py"] = render_init(specs)
    return files


def write_typed(out_dir: Path = OUT_DIR) -> list[Path]:
    """Write every module; remove generated ones whose spec is gone."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = rendered()
    for old in out_dir.glob("*.py"):
        if old.name not in files and old.read_text().startswith("# Generated from spec/"):
            old.unlink()
    written = []
    for fname, text in sorted(files.items()):
        path = out_dir / fname
        path.write_text(text)
        written.append(path)
    return written


def stale_typed(out_dir: Path = OUT_DIR) -> list[str]:
    """File names that are missing, differ from a fresh render, or have no spec any more."""
    files = rendered()
    stale = [f for f, text in sorted(files.items()) if not (out_dir / f).is_file() or (out_dir / f).read_text() != text]
    stale += sorted(p.name for p in out_dir.glob("*.py") if p.name not in files)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_prefix_cache.specs.typegen", description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output package folder")
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed module differs from the specs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_typed(args.out)
        if stale:
            listed = ", ".join(stale)
            print(f"stale typed spec modules in {args.out}: {listed} (run: make typed-specs)", file=sys.stderr)
            return 1
        print(f"typed spec modules in {args.out} match the specs")
        return 0
    for path in write_typed(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
