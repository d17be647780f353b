"""The mutant runner (``make mutants``): judge each catalogued mutant.

Per mutant, a pytest run in a subprocess with ``ENV_VAR=<name>``
(tests/conftest.py applies the mutant there): the tests generated from the
composition spec alone, then (if they did not kill it) the other generated
and racing tests; it prints ``killed K of N; generated tests alone: G of N``.
A mutant is killed only when a run fails an assertion of a named invariant
(a spec invariant, a generated checker or a racing test's ``@invariant``) or
of the row oracle (a message starting "row oracle:"); any other failure (a
crash, a timeout) is reported but not counted (``kill_reason``). Beside
each verdict, ``[trace: ...]`` says whether validating a recorded simulate
run of the mutant (``trace_mutants``) alone catches it; it changes no verdict.

The mutants themselves live in ``mutant_catalogue``, which runs this on
``python -m omni_prefix_cache.testing.mutant_catalogue``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

ENV_VAR = "OMNI_PREFIX_CACHE_MUTANT"
# The tests generated from the composition spec: run alone first per mutant.
GENERATED_TESTS = ("tests/test_protocol_generated.py",)
# Then, for a mutant they did not kill, the other generated and racing tests.
OTHER_KILLER_TESTS = (
    # The host tier's first: the generated machines (-x) would stop a tier mutant at an effect trace.
    *("tests/test_tier_check.py", "tests/test_host_tier.py"),
    "tests/test_hybrid_groups.py",  # the KV layout's: a hybrid model's groups (layout_mutants)
    *("tests/test_race_controller.py", "tests/test_generated_specs.py", "tests/test_race_system.py"),
    "tests/test_committer_idle.py",  # the threaded committer's linger (invariant idle_writes_land)
)
KILLER_TESTS = GENERATED_TESTS + OTHER_KILLER_TESTS


class Described(Protocol):
    """What the runner reads of a mutant: its name, its bug in one line, and
    its patch (applied in ``--trace-child``)."""

    @property
    def name(self) -> str: ...

    @property
    def bug(self) -> str: ...

    @property
    def patch(self) -> Callable[[contextlib.ExitStack], None]: ...


def invariant_names(tests: tuple[str, ...] = KILLER_TESTS) -> frozenset[str]:
    """Every named invariant a kill may come from: the machine specs', the
    composition spec's, the generated protocol machine's checkers and the
    ``@invariant()`` methods of the racing tests."""
    from omni_prefix_cache.specs import load_all_specs
    from omni_prefix_cache.specs.composition import load_protocol
    from omni_prefix_cache.testing.protocol_tests import invariant_names as protocol_checkers

    names = {inv.name for spec in load_all_specs().values() for inv in spec.invariants}
    names.update(load_protocol().invariant_names, protocol_checkers())
    for path in tests:
        if os.path.exists(path):
            with open(path) as f:
                names.update(re.findall(r"@invariant\(\)\s+def (\w+)", f.read()))
    return frozenset(names)


def kill_reason(output: str, invariants: frozenset[str]) -> str | None:
    """Why a failing run failed: ``row oracle``, ``invariant <name>`` (the
    innermost failing frame that is a named invariant), or None. Only an
    assertion counts: an exception escaping a checker is a crash."""
    lines = output.splitlines()
    if any(ln.startswith("E") and "row oracle:" in ln for ln in lines):
        return "row oracle"
    if not any(re.match(r"^E\s+AssertionError", ln) for ln in lines):
        return None
    frames = re.findall(r"^\S+\.py:\d+: in (\w+)$", output, re.M)
    for name in reversed(frames):
        if name in invariants:
            return f"invariant {name}"
    return None


# Seconds `make mutants --explore` gives the interleaving explorer per mutant.
EXPLORE_SECONDS = 300


def explore_kill(name: str, seconds: int = EXPLORE_SECONDS) -> tuple[str | None, str]:
    """Run ``omni-prefix-cache explore --mutant name`` (default bound and budget,
    at most ``seconds``): (kill reason or None, replay token or a note)."""
    import json

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_prefix_cache",
            "explore",
            "--mutant",
            name,
            "--json",
            "--time-budget",
            str(seconds),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode not in (0, 1):
        return None, f"explore error rc={proc.returncode}"
    failures = [f for sc in json.loads(proc.stdout)["scenarios"] for f in sc["failures"]]
    if not failures:
        return None, "survived"
    reason = failures[0]["reason"]
    if reason == "crash":  # a crash is not a kill
        return None, f"crash only: {failures[0]['token']}"
    return reason, failures[0]["token"]


@dataclass(frozen=True)
class Verdict:
    verdict: str  # killed, FAILED (not counted), SURVIVED, error rc=N
    reason: str
    test: str
    seconds: float

    @property
    def killed(self) -> bool:
        return self.verdict == "killed"


def run_tests(name: str, tests: tuple[str, ...], invariants: frozenset[str]) -> Verdict:
    """One pytest run of ``tests`` with mutant ``name`` applied."""
    env = dict(os.environ, **{ENV_VAR: name, "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "mutants")})
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "--tb=short", "-p", "no:cacheprovider", *tests],
        env=env,
        capture_output=True,
        text=True,
    )
    reason = kill_reason(proc.stdout, invariants) if proc.returncode == 1 else None
    if reason is not None:
        verdict = "killed"
    elif proc.returncode == 1:
        verdict, reason = "FAILED", "not by a named invariant or the row oracle: not counted"
    else:
        verdict, reason = ("SURVIVED" if proc.returncode == 0 else f"error rc={proc.returncode}"), ""
    first = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")), "")
    test = first.removeprefix("FAILED ").split(" - ")[0]
    return Verdict(verdict, reason, test, time.monotonic() - start)


def judge(name: str, invariants: frozenset[str]) -> tuple[Verdict, Verdict]:
    """The generated protocol tests alone, then (if they did not kill it)
    the other killer tests: ``(first verdict, final verdict)``."""
    generated = tuple(t for t in GENERATED_TESTS if os.path.exists(t))
    others = tuple(t for t in OTHER_KILLER_TESTS if os.path.exists(t))
    first = run_tests(name, generated, invariants)
    if first.killed or not others:
        return first, first
    return first, run_tests(name, others, invariants)


def run_catalogue(
    mutants: Mapping[str, Described],
    candidates: Mapping[str, Described],
    names: list[str] | None = None,
    jobs: int = 1,
    *,
    with_explore: bool = False,
    with_trace: bool = True,
) -> int:
    """``judge`` every mutant of ``mutants`` (``jobs`` at a time); print each verdict with
    its kill reason, then ``killed K of N; generated tests alone: G of N``.
    ``with_explore``: then run the interleaving explorer per mutant (one at a
    time) and print ``explore killed E of N``. Returns 0 only when K == N
    and G == N, N counting only the mutants inside the composition's scope
    (a mutant's ``outside`` names why one is not)."""
    chosen = names or list(mutants)
    invariants = invariant_names()
    print(
        f"mutant catalogue: {len(chosen)} mutants, {jobs} at a time; generated tests "
        f"{', '.join(GENERATED_TESTS)} alone first, then {', '.join(OTHER_KILLER_TESTS)}"
    )
    from omni_prefix_cache.testing.trace_mutants import trace_verdict

    killed = alone = traced = 0
    alone_killed: set[str] = set()
    total = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        verdicts = pool.map(lambda n: (*judge(n, invariants), trace_verdict(n) if with_trace else "off"), chosen)
        for name, (first, result, trace) in zip(chosen, verdicts):
            killed += result.killed
            alone += first.killed
            if first.killed:
                alone_killed.add(name)
            traced += trace.startswith("caught")
            if result is first:
                where = "[generated]" if first.killed else "[generated; no other tests]"
            else:
                where = f"[generated: {first.verdict}; others: {result.verdict}]"
            seconds = first.seconds + (result.seconds if result is not first else 0.0)
            print(
                f"  {name:38s} {result.verdict:9s} {seconds:6.1f}s  {result.reason}  {where}  "
                f"[trace: {trace}]  {result.test[:70]}"
            )
            sys.stdout.flush()
    if names is None and candidates:
        print(f"candidates (not counted): {', '.join(sorted(candidates))}")
    print(f"total {time.monotonic() - total:.0f}s")
    if with_explore:
        explored = 0
        for name in chosen:
            why, token = explore_kill(name)
            explored += why is not None
            print(f"  explore {name:38s} {'killed by ' + why if why else 'not killed'} ({token})", flush=True)
        print(f"explore killed {explored} of {len(chosen)}")
    print(f"trace validation of a recorded run alone caught {traced} of {len(chosen)} (reported, not counted)")
    # A mutant outside the composition's scope (the host tier: its own spec and world, assumed
    # idle by the composition's models) is not owed to the composition's generated tests.
    known = {**candidates, **mutants}
    outside = [n for n in chosen if getattr(known.get(n), "outside", "")]
    scoped = len(chosen) - len(outside)
    alone_scoped = alone - sum(1 for n in outside if n in alone_killed)
    note = f" ({len(outside)} outside the composition: {', '.join(outside)})" if outside else ""
    print(f"killed {killed} of {len(chosen)}; generated tests alone: {alone_scoped} of {scoped}{note}")
    return 0 if killed == len(chosen) and alone_scoped == scoped else 1


def main(argv: list[str] | None, mutants: Mapping[str, Described], candidates: Mapping[str, Described]) -> int:
    """``make mutants``: judge the catalogue (``--list``: print it). Exit status 0 only when every mutant is killed."""
    parser = argparse.ArgumentParser(description="run the generated and racing tests against each mutant")
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the catalogue and exit")
    parser.add_argument(
        "--explore",
        action="store_true",
        help=f"also run `omni-prefix-cache explore --mutant` per mutant (up to {EXPLORE_SECONDS}s each)",
    )
    parser.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="mutants judged in parallel (default: 2)"
    )
    parser.add_argument(
        "--no-trace", action="store_true", help="skip the trace column (recorded runs validated per mutant)"
    )
    parser.add_argument("--trace-child", nargs=2, metavar=("NAME", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trace_child:  # trace_mutants' child: record runs with one mutant applied
        from omni_prefix_cache.testing.trace_mutants import record_runs

        name, folder = args.trace_child
        with contextlib.ExitStack() as stack:
            {**candidates, **mutants}[name].patch(stack)
            return record_runs(folder)
    if args.list:
        for m in mutants.values():
            print(f"{m.name:38s} {m.bug}")
        for m in candidates.values():
            print(f"{m.name:38s} {m.bug} (candidate: not yet killed)")
        return 0
    return run_catalogue(
        mutants, candidates, args.names or None, jobs=args.jobs, with_explore=args.explore, with_trace=not args.no_trace
    )
