"""The README and docs/ stay in step with the code: every relative link and
anchor resolves, the README's engine loop is the example's and runs, every
`make` target and `omni-prefix-cache` command (and flag) they quote exists,
every error class has its section, and the front pages stay short."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE = ROOT / "examples" / "minimal_engine.py"
BEGIN = re.compile(r"^[ \t]*# --- README: the engine loop.*\n", re.M)
END = re.compile(r"^[ \t]*# --- README: end ---\n", re.M)

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


# ----------------------------------------------------------------- markdown


def prose(text: str) -> str:
    """``text`` without fenced blocks and code spans (their brackets are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def code(text: str) -> list[str]:
    """The lines of every fenced block and every code span of ``text``."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    spans = [" ".join(m.group(2).split()) for m in CODE_SPAN.finditer(FENCE.sub("", text))]  # may wrap
    return [line for chunk in blocks + spans for line in chunk.splitlines()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup dropped,
    lower case, punctuation but ``-`` and ``_`` removed, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of ``path``, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}[ \t]+(.+?)[ \t#]*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or anchor does not exist."""
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        where, _, anchor = target.partition("#")
        dest = (page.parent / where).resolve() if where else page
        if not dest.exists():
            broken.append(f"{page.name}: {target} (no {where})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.name}: {target} (no heading #{anchor} in {dest.name})")
    return broken


def test_slug_is_githubs() -> None:
    assert slug("The report: `simulate --metrics-out FILE`") == "the-report-simulate---metrics-out-file"
    assert slug("KV connectors: the gate's rule") == "kv-connectors-the-gates-rule"
    assert slug("`make gpu-check`") == "make-gpu-check"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## Two words\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#two-words) [gone](missing.md) [bad](a.md#no-such) [self](#here)\n"
        "`[in code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "b.md: missing.md (no missing.md)",
        "b.md: a.md#no-such (no heading #no-such in a.md)",
        "b.md: #here (no heading #here in b.md)",
    ]


# ---------------------------------------------------------- the engine loop


def readme_loop() -> str:
    """The README's python block: the engine loop."""
    blocks = re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.M | re.S)
    assert len(blocks) == 1, f"the README has {len(blocks)} python blocks, one expected (the engine loop)"
    return str(blocks[0])


def example_loop(source: str) -> tuple[int, int, str]:
    """The example's lines between the README markers: (start, end, indent)."""
    begin, end = BEGIN.search(source), END.search(source)
    assert begin is not None and end is not None, "examples/minimal_engine.py lost its README markers"
    indent = re.match(r"[ \t]*", begin.group(0)).group(0)  # type: ignore[union-attr]
    return begin.end(), end.start(), indent


def run_example(source: str, name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``source`` loaded as module ``name`` (registered: its dataclasses look it up)."""
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(source, str(EXAMPLE), "exec"), module.__dict__)
    return module


def with_readme_loop() -> str:
    """examples/minimal_engine.py with the README's block in place of its engine loop."""
    source = EXAMPLE.read_text()
    start, end, indent = example_loop(source)
    return source[:start] + textwrap.indent(readme_loop(), indent) + source[end:]


def test_readme_quotes_the_examples_engine_loop() -> None:
    source = EXAMPLE.read_text()
    start, end, _ = example_loop(source)
    assert readme_loop() == textwrap.dedent(source[start:end])


def test_readme_engine_loop_runs_and_checks_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_example(with_readme_loop(), "readme_loop", monkeypatch).main() == 0

    from omni_prefix_cache.manager import OmniPrefixCacheManager

    real = OmniPrefixCacheManager.materialize

    def served_as_zeros(self: OmniPrefixCacheManager, step_id: int, req_ids: Any, **kw: Any) -> Any:
        out = real(self, step_id, req_ids, **kw)
        hidden = {rid: torch.zeros_like(rows) for rid, rows in (out.hidden_states or {}).items()}
        return dataclasses.replace(out, hidden_states=hidden)

    monkeypatch.setattr(OmniPrefixCacheManager, "materialize", served_as_zeros)
    assert run_example(with_readme_loop(), "readme_loop_zeros", monkeypatch).main() == 1


# ------------------------------------------------------- commands they quote


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for t in re.findall(r"^([A-Za-z0-9_-]+):(?!=)", text, re.M)}


def quoted_make_targets(text: str) -> set[str]:
    return {m for line in code(text) for m in re.findall(r"(?:^|[\s;&(])make[ \t]+([a-z][\w-]*)", line)}


def cli_commands() -> dict[str, set[str]]:
    """Each subcommand of ``omni-prefix-cache``, with its option strings."""
    import argparse

    from omni_prefix_cache.tools.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def quoted_cli(text: str) -> list[tuple[str, list[str]]]:
    """(subcommand, its --flags) of every `omni-prefix-cache SUB ...` and
    `python -m omni_prefix_cache SUB ...` quoted in code."""
    found = []
    for line in code(text):
        for m in re.finditer(r"(?:omni-prefix-cache|python -m omni_prefix_cache)[ \t]+([a-z][\w-]*)(.*)", line):
            rest = re.split(r"#|\||;|&&|`|\)", m.group(2))[0]
            flags = [t.split("=", 1)[0] for t in rest.split() if t.startswith("--")]
            found.append((m.group(1), flags))
    return found


def quoted_modules(text: str) -> set[str]:
    return {m for line in code(text) for m in re.findall(r"python -m (omni_prefix_cache\.[\w.]+)", line)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_quoted_make_targets_exist(page: Path) -> None:
    assert quoted_make_targets(page.read_text()) - make_targets() == set()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_quoted_commands_and_flags_exist(page: Path) -> None:
    commands = cli_commands()
    wrong = []
    for sub, flags in quoted_cli(page.read_text()):
        if sub not in commands:
            wrong.append(sub)
        else:
            wrong += [f"{sub} {f}" for f in flags if f not in commands[sub]]
    missing = [m for m in quoted_modules(page.read_text()) if importlib.util.find_spec(m) is None]
    assert wrong + missing == []


def test_a_stale_command_is_found() -> None:
    text = "`make demo` and `make tset`\n\n```bash\nomni-prefix-cache simulate --seed 3 --no-such-flag\n```\n"
    text += "`omni-prefix-cache smiulate`; `python -m omni_prefix_cache.no_such_tool`\n"
    assert quoted_make_targets(text) - make_targets() == {"tset"}
    assert quoted_cli(text) == [("simulate", ["--seed", "--no-such-flag"]), ("smiulate", [])]
    assert "--no-such-flag" not in cli_commands()["simulate"] and "--seed" in cli_commands()["simulate"]
    missing = [m for m in quoted_modules(text) if importlib.util.find_spec(m) is None]
    assert missing == ["omni_prefix_cache.no_such_tool"]


def test_readme_states_the_setup_and_test_commands() -> None:
    quoted = quoted_make_targets(README.read_text())
    assert {"demo", "test"} <= quoted <= make_targets()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


# ------------------------------------------------------------------ errors


def test_every_error_class_has_its_section() -> None:
    import omni_prefix_cache.errors as errors
    from omni_prefix_cache.engine_helper import OmniPrefixCacheStepDiscardedError
    from omni_prefix_cache.requests.delivery import OmniPrefixCacheDeliveryGapError

    classes = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)}
    classes |= {OmniPrefixCacheStepDiscardedError.__name__, OmniPrefixCacheDeliveryGapError.__name__}
    headings = anchors(ROOT / "docs" / "errors.md")
    sections = {h.removesuffix("-the-base") for h in headings}
    assert sorted(c for c in classes if slug(f"`{c}`") not in sections) == []


# ------------------------------------------------------------------ lengths


@pytest.mark.parametrize(("path", "limit"), [("README.md", 220), ("docs/benchmarks.md", 300)])
def test_front_pages_stay_short(path: str, limit: int) -> None:
    lines = len((ROOT / path).read_text().splitlines())
    assert lines <= limit, f"{path} has {lines} lines (at most {limit})"
