"""Time-boxed fuzzing of every stateful machine with fresh seeds (``make fuzz``, ``make ci-fuzz``).

Machines: one generated machine per spec in ``spec/`` (played against its
runtime adapter from tests/test_generated_specs.py) and every racing
machine defined in ``tests/test_race_*.py``. Each machine runs in chunks of
examples, each chunk under a fresh seed, the machine furthest behind its
time share going next (racing machines get RACE_WEIGHT times a spec
machine's share), until the time is up.

Hypothesis' example database lives in ``--db`` (one folder per machine,
created on first use): each machine first replays what it holds, so a
failure found once is replayed first next time. On the first failure the
run prints the seed, Hypothesis' minimal trace and the one command that
replays it, then exits 1. Every run ends with a summary: machines,
examples, steps, elapsed, and per spec how often each declared move ran.
Not collected by pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import os
import random
import shlex
import sys
import time
import traceback
import unittest
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import UnsatisfiedAssumption
from hypothesis.internal.conjecture import engine
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from omni_prefix_cache.specs import load_spec, spec_names  # noqa: E402
from omni_prefix_cache.testing.interpreter import InterpreterAdapter  # noqa: E402
from omni_prefix_cache.testing.mutant_catalogue import ENV_VAR, applied  # noqa: E402
from omni_prefix_cache.testing.mutants import single_moves  # noqa: E402
from omni_prefix_cache.testing.stateful import build_machine  # noqa: E402

GENERATE = [Phase.generate, Phase.target, Phase.shrink]
# Time share of a racing machine against a generated spec machine. A spec
# machine (a few handles of one lifecycle) runs every declared move within one
# chunk (see the coverage line); a racing machine composes manager,
# controller, staging and occupancy, so its space is the one left unexplored.
RACE_WEIGHT = 3.0
REPLAY_DB = [Phase.reuse, Phase.shrink]


@dataclasses.dataclass
class Target:
    """One machine under fuzzing, with what it has run so far."""

    name: str
    real: type[RuleBasedStateMachine]
    spec: str | None = None  # the spec whose moves it covers (generated machines)
    note: str = ""
    weight: float = 1.0  # share of the run's time
    seconds: float = 0.0
    chunks: int = 0
    examples: int = 0
    steps: int = 0
    rules: Counter[str] = dataclasses.field(default_factory=Counter)
    moves: Counter[tuple[str, str]] = dataclasses.field(default_factory=Counter)
    failed_at: float | None = None  # time.monotonic() of the first failing step (before shrinking)
    machine: type[RuleBasedStateMachine] = dataclasses.field(init=False)  # ``real``, counting into this

    def __post_init__(self) -> None:
        self.machine = counting(self.real, self)

    def failing(self, exc: Exception) -> None:
        # A rejected draw is no failure; anything else escaping a rule, invariant or teardown is.
        if self.failed_at is None and not isinstance(exc, UnsatisfiedAssumption):
            self.failed_at = time.monotonic()


def counting(cls: type[RuleBasedStateMachine], target: Target) -> type[RuleBasedStateMachine]:
    """``cls`` counting examples (instances) and steps (rules run, per rule) into ``target``.

    The rules are the real machine's: each is copied with its function
    wrapped, keeping its name, so traces and replays read as the original.
    """

    class Counting(cls):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            target.examples += 1
            super().__init__()

        def check_invariants(self, *args: Any, **kwargs: Any) -> None:
            try:
                super().check_invariants(*args, **kwargs)
            except Exception as exc:
                target.failing(exc)
                raise

        def teardown(self) -> None:
            try:
                super().teardown()
            except Exception as exc:
                target.failing(exc)
                raise

        @classmethod
        def setup_state(klass) -> Any:
            cache = RuleBasedStateMachine._setup_state_per_class
            if klass not in cache:
                base = cls.setup_state()
                rules = [dataclasses.replace(r, function=_counted_rule(r.function, target)) for r in base.rules]
                cache[klass] = dataclasses.replace(base, rules=rules)
            return cache[klass]

    Counting.__name__ = Counting.__qualname__ = cls.__name__
    return Counting


def _counted_rule(fn: Callable[..., Any], target: Target) -> Callable[..., Any]:
    @functools.wraps(fn)
    def rule(*args: Any, **kwargs: Any) -> Any:
        target.steps += 1
        target.rules[fn.__name__] += 1
        if isinstance(action := kwargs.get("action"), str):  # a rule playing one of several protocol actions
            target.rules[f"{fn.__name__}({action})"] += 1
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            target.failing(exc)
            raise

    return rule


def spec_targets() -> dict[str, Target]:
    """One generated machine per spec file present, on its runtime adapter
    (the interpreter, with a note, for a spec no adapter plays yet)."""
    import test_generated_specs

    out = {}
    for name in spec_names():
        runtime = test_generated_specs.RUNTIMES.get(name)
        adapter: Any = InterpreterAdapter(load_spec(name)) if runtime is None else runtime[0]()
        moves: Counter[tuple[str, str]] = Counter()
        machine = build_machine(adapter, on_move=lambda trigger, source, dest, m=moves: m.update([(trigger, source)]))
        note = "no runtime adapter: fuzzing the spec interpreter only" if runtime is None else ""
        out[f"spec-{name}"] = Target(f"spec-{name}", machine, spec=name, note=note, moves=moves)
    return out


def race_targets() -> dict[str, Target]:
    """Every concrete racing machine defined in tests/test_race_*.py."""
    out = {}
    for path in sorted(TESTS.glob("test_race_*.py")):
        module = importlib.import_module(path.stem)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, RuleBasedStateMachine) and cls.__module__ == module.__name__:
                out[cls_name] = Target(cls_name, cls, weight=RACE_WEIGHT)
    return out


def protocol_targets() -> dict[str, Target]:
    """The machines generated from the composition spec (tests/test_protocol_generated.py)."""
    module = importlib.import_module("test_protocol_generated")
    machines = (module.ManualProtocolMachine, module.EagerProtocolMachine)
    return {cls.__name__: Target(cls.__name__, cls, weight=RACE_WEIGHT) for cls in machines}


def all_targets() -> dict[str, Target]:
    return {**spec_targets(), **race_targets(), **protocol_targets()}


def chunk_settings(examples: int, steps: int, db: Path | None, phases: list[Phase]) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=DirectoryBasedExampleDatabase(db) if db is not None else None,
        derandomize=False,
        phases=phases,
        print_blob=True,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )


def run_chunk(target: Target, chunk_seed: int | None, run_settings: settings) -> None:
    """One chunk; ``chunk_seed`` None replays the database only."""
    machine = target.machine if chunk_seed is None else seed(chunk_seed)(target.machine)
    start = time.monotonic()
    try:
        run_state_machine_as_test(machine, settings=run_settings)
    finally:
        if chunk_seed is not None:
            del machine._hypothesis_internal_use_seed  # the class is reused by the next chunk
        target.seconds += time.monotonic() - start
        target.chunks += 1


def replay_command(args: argparse.Namespace, name: str, chunk_seed: int | None) -> str:
    python = os.path.relpath(sys.executable)
    parts = [sys.executable if python.startswith("..") else python, "tests/fuzz.py", "--machine", name]
    if chunk_seed is None:
        parts += ["--replay-db", "--db", str(args.db)]
    else:
        parts += ["--seed", str(chunk_seed), "--examples", str(args.examples), "--steps", str(args.steps)]
    if args.mutant:
        parts += ["--mutant", args.mutant]
    return shlex.join(parts)


def summary(targets: list[Target], elapsed: float, out: Any = None) -> None:
    """Machines, examples, steps, elapsed; per spec the moves run; per racing machine its rules."""
    examples = sum(t.examples for t in targets)
    steps = sum(t.steps for t in targets)
    p = functools.partial(print, file=out or sys.stdout)
    p(f"\nfuzz summary: {len(targets)} machines, {examples} examples, {steps} steps, {elapsed:.1f}s elapsed")
    for t in targets:
        p(f"  {t.name:28s} {t.chunks:5d} chunks {t.examples:7d} examples {t.steps:9d} steps {t.seconds:7.1f}s")
    spec_runs = [t for t in targets if t.spec is not None]
    if spec_runs:
        p("coverage per spec (each declared move, trigger@SOURCE: times run; from the generated rules):")
    for t in spec_runs:
        declared = single_moves(load_spec(t.spec))
        missed = [f"{trig}@{src}" for trig, src in declared if not t.moves[(trig, src)]]
        ran = " ".join(f"{trig}@{src}:{t.moves[(trig, src)]}" for trig, src in declared)
        verdict = f"UNCOVERED {', '.join(missed)}" if missed else "all covered"
        p(f"  {t.spec}: {len(declared) - len(missed)}/{len(declared)} moves, {verdict} | {ran}")
        if t.note:
            p(f"    ({t.note})")
    for t in targets:
        if t.spec is None:
            rules = {r.function.__name__ for r in t.machine.setup_state().rules}
            actions = {r for r in t.rules if r.split("(")[0] in rules}
            p(f"  {t.name} rules: " + " ".join(f"{r}:{t.rules[r]}" for r in sorted(rules | actions)))


@contextlib.contextmanager
def mutant_applied(name: str | None) -> Iterator[None]:
    if not name:
        yield
        return
    with applied(name):
        yield


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds to fuzz (default 600)")
    parser.add_argument("--machine", action="append", help="a machine to fuzz (repeatable; default: all)")
    parser.add_argument("--list", action="store_true", help="list the machines and exit")
    parser.add_argument("--seed", type=int, help="replay one chunk with this seed (needs one --machine)")
    parser.add_argument("--replay-db", action="store_true", help="replay only what the database holds")
    parser.add_argument("--examples", type=int, default=25, help="examples per chunk (default 25)")
    parser.add_argument("--steps", type=int, default=80, help="max rules per example (default 80)")
    parser.add_argument("--db", type=Path, default=Path(".fuzz-db"), help="example database folder (default .fuzz-db)")
    parser.add_argument("--no-db", action="store_true", help="keep no example database")
    parser.add_argument(
        "--shrink-seconds", type=float, default=120.0, help="cap on shrinking a failure (default 120; Hypothesis: 300)"
    )
    parser.add_argument("--log", action="store_true", help="show the library's log (hidden: failures it injects)")
    parser.add_argument(
        "--mutant", default=os.environ.get(ENV_VAR) or None, help=f"switch a catalogued mutant on (or set {ENV_VAR})"
    )
    args = parser.parse_args(argv)
    if args.seed is not None and len(args.machine or ()) != 1:
        parser.error("--seed replays one machine: name it with --machine")
    return args


class Run:
    """One fuzz run over ``chosen``: chunks, the failure report, the summary."""

    def __init__(self, args: argparse.Namespace, chosen: list[Target]) -> None:
        self.args = args
        self.chosen = chosen
        self.db_root = None if args.no_db else args.db
        self.start = time.monotonic()

    def db(self, target: Target) -> Path | None:
        """The machine's database folder; a mutant's failures are kept apart."""
        if self.db_root is None:
            return None
        return (self.db_root / f"mutant-{self.args.mutant}" if self.args.mutant else self.db_root) / target.name

    def settings(self, db: Path | None, phases: list[Phase]) -> settings:
        return chunk_settings(self.args.examples, self.args.steps, db, phases)

    def replay_seed(self) -> bool:
        """The chunk exactly as the fuzz run played it: generation from the seed, no database."""
        return self.attempt(self.chosen[0], self.args.seed, self.settings(None, GENERATE))

    def replay_databases(self) -> bool:
        """What each machine's database holds, first: a failure found once replays first next time."""
        for t in self.chosen:
            db = self.db(t)
            if db is not None and (db.is_dir() or self.args.replay_db):
                if not self.attempt(t, None, self.settings(db, REPLAY_DB)):
                    return False
        return True

    def fuzz(self) -> bool:
        """Fresh-seed chunks until the time is up, the machine furthest behind its time share next."""
        rng = random.Random()
        last_report = 0.0
        while (elapsed := time.monotonic() - self.start) < self.args.duration:
            t = min(self.chosen, key=lambda c: c.seconds / c.weight)
            chunk_seed = rng.randrange(1 << 32)
            if not self.attempt(t, chunk_seed, self.settings(self.db(t), GENERATE)):
                return False
            if elapsed - last_report >= 10:
                last_report = elapsed
                print(
                    f"[{elapsed:6.1f}s] examples {sum(c.examples for c in self.chosen):7d}  "
                    f"steps {sum(c.steps for c in self.chosen):8d}  last {t.name} seed {chunk_seed}",
                    flush=True,
                )
        return True

    def attempt(self, t: Target, chunk_seed: int | None, run_settings: settings) -> bool:
        """Run one chunk; on failure print the summary, the seed and the replay command."""
        try:
            run_chunk(t, chunk_seed, run_settings)
        except unittest.SkipTest:
            if chunk_seed is not None:
                raise
            # Hypothesis keys stored examples by the machine's source: after the
            # machine changes, its folder holds only entries no rule replays.
            print(f"{t.name}: its database holds no example for the machine as it is now; nothing to replay")
            return True
        except Exception:
            traceback.print_exc()
            elapsed = time.monotonic() - self.start
            summary(self.chosen, elapsed, out=sys.stderr)
            where = "replaying its example database" if chunk_seed is None else f"seed {chunk_seed}"
            found = f"found at {t.failed_at - self.start:.1f}s, " if t.failed_at is not None else ""
            mutant = f" with mutant {self.args.mutant}" if self.args.mutant else ""
            print(
                f"\nFAILED {t.name} ({where}; {found}shrunk and reported at {elapsed:.1f}s){mutant}. "
                "The minimal trace is printed above (state = ...). Replay exactly with:\n"
                f"  {replay_command(self.args, t.name, chunk_seed)}",
                file=sys.stderr,
                flush=True,
            )
            return False
        return True

    def summary(self) -> None:
        summary(self.chosen, time.monotonic() - self.start)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    targets = all_targets()
    if args.list:
        for name, t in targets.items():
            doc = (t.real.__doc__ or "").strip().splitlines()
            print(f"{name:28s} {doc[0] if doc else ''}")
        return 0
    unknown = sorted(set(args.machine or ()) - set(targets))
    if unknown:
        raise SystemExit(f"unknown machine(s) {unknown}; known: {', '.join(targets)}")
    run = Run(args, [targets[n] for n in (args.machine or targets)])
    if not args.log:
        # The racing machines inject failures the library logs with tracebacks; the verdict is the machines'.
        logging.getLogger("omni_prefix_cache").setLevel(logging.CRITICAL)
    # Hypothesis shrinks for up to 300 s; a time-boxed run keeps the best trace found by the cap instead.
    shrink_cap = mock.patch.object(engine, "MAX_SHRINKING_SECONDS", args.shrink_seconds)
    with mutant_applied(args.mutant), shrink_cap:
        if args.mutant:
            print(f"mutant switched on: {args.mutant}")
        if args.seed is not None:
            if not run.replay_seed():
                return 1
            run.summary()
            print(f"replayed {args.machine[0]} seed {args.seed}: passed")
            return 0
        ok = run.replay_databases() and (args.replay_db or run.fuzz())
    if not ok:
        return 1
    run.summary()
    print("fuzz clean" + (f" (mutant {args.mutant} survived)" if args.mutant else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
