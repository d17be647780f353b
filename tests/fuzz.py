"""Long random runs of the racing state machines (``make fuzz DURATION=600``).

Runs each machine in chunks of examples under the ``fuzz`` profile with a
fresh seed per chunk until the time is up, printing a progress line, and on
the first failure prints Hypothesis' minimal trace and the exact command
that replays it (same machine, seed and chunk size). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import hypothesis.core
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_race_controller  # noqa: E402
import test_race_system  # noqa: E402

MACHINES = {
    "controller-manual": test_race_controller.ControllerRace,
    "controller-eager": test_race_controller.EagerControllerRace,
    "system-on-demand": test_race_system.SystemRace,
    "system-eager": test_race_system.EagerSystemRace,
}
COUNTS = {"examples": 0, "steps": 0}


def counted(cls: type) -> type:
    """The machine, counting examples (instances) and steps (invariant checks)."""

    class Counted(cls):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            COUNTS["examples"] += 1
            super().__init__()

        def check_invariants(self, *args, **kwargs):
            COUNTS["steps"] += 1
            return super().check_invariants(*args, **kwargs)

    Counted.__name__ = cls.__name__
    return Counted


def run_chunk(name: str, seed: int, examples: int, steps: int) -> None:
    hypothesis.core.global_force_seed = seed
    try:
        run_state_machine_as_test(
            counted(MACHINES[name]),
            settings=settings(
                max_examples=examples,
                stateful_step_count=steps,
                deadline=None,
                database=None,
                derandomize=False,
                print_blob=True,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        hypothesis.core.global_force_seed = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds to fuzz (default 600)")
    parser.add_argument("--machine", choices=sorted(MACHINES), action="append", help="default: all")
    parser.add_argument("--seed", type=int, help="replay one chunk with this seed (needs one --machine)")
    parser.add_argument("--examples", type=int, default=50, help="examples per chunk")
    parser.add_argument("--steps", type=int, default=80, help="max rules per example")
    args = parser.parse_args(argv)
    names = args.machine or sorted(MACHINES)
    if args.seed is not None:
        if len(names) != 1:
            parser.error("--seed replays one machine: name it with --machine")
        run_chunk(names[0], args.seed, args.examples, args.steps)
        print(f"replayed {names[0]} seed {args.seed}: passed ({COUNTS['examples']} examples, {COUNTS['steps']} steps)")
        return 0
    start = time.monotonic()
    chunks = 0
    rng = random.Random()
    while time.monotonic() - start < args.duration:
        for name in names:
            seed = rng.randrange(1 << 32)
            try:
                run_chunk(name, seed, args.examples, args.steps)
            except BaseException:
                import traceback

                traceback.print_exc()
                print(
                    f"\nFAILED {name} seed {seed}. Replay exactly with:\n"
                    f"  python tests/fuzz.py --machine {name} --seed {seed} "
                    f"--examples {args.examples} --steps {args.steps}",
                    file=sys.stderr,
                )
                return 1
            chunks += 1
            elapsed = time.monotonic() - start
            print(
                f"[{elapsed:7.1f}s] chunks {chunks:5d}  examples {COUNTS['examples']:8d}  "
                f"steps {COUNTS['steps']:9d}  last {name} seed {seed}",
                flush=True,
            )
            if elapsed >= args.duration:
                break
    print(
        f"fuzz clean: {COUNTS['examples']} examples, {COUNTS['steps']} steps in {time.monotonic() - start:.0f}s "
        f"over {', '.join(names)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
