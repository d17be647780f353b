# Everyday commands. `make setup` installs what a fresh machine lacks.
PYTHON ?= python3
PYTEST ?= $(PYTHON) -m pytest

.PHONY: setup diagrams diagrams-check typed-specs typed-specs-check test lint demo simulate bench check examples wheel-check

setup:
	bash .ci/setup.sh

diagrams:
	$(PYTHON) -m omni_prefix_cache diagrams --out diagrams

diagrams-check:
	$(PYTHON) -m omni_prefix_cache diagrams --out diagrams --check

# Typed state enums and trigger names (src/omni_prefix_cache/specs/types/) from spec/*.yaml;
# committed, and checked for staleness by tests/test_spec_types.py.
typed-specs:
	$(PYTHON) -m omni_prefix_cache.specs.typegen

typed-specs-check:
	$(PYTHON) -m omni_prefix_cache.specs.typegen --check

# ruff, then mypy --strict over the package (its settings: [tool.mypy] in pyproject.toml).
lint:
	$(PYTHON) -m ruff check src tests tests_vllm spec examples
	$(PYTHON) -m ruff format --check src tests tests_vllm spec examples
	$(PYTHON) -m mypy --strict src

# The CI bound of the exhaustive model check (~15-60 s), the CI bound of the interleaving
# explorer (~1-2 min), then the test suite.
test:
	$(PYTHON) -m omni_prefix_cache check
	$(PYTHON) -m omni_prefix_cache explore --ci
	$(PYTEST) -q

# The engine-loop examples; each checks its own rows (tests/test_examples.py runs them too).
examples:
	$(PYTHON) examples/minimal_engine.py
	$(PYTHON) examples/threaded_lagged.py

# The wheel built from this checkout, installed into a clean venv (no -e, no src/ on the path):
# the seed suite, simulate and the examples run from it (~1 min; CI runs it).
wheel-check:
	PYTHON=$(PYTHON) bash .ci/wheel-check.sh

# Fresh machine -> install -> a verified serving simulation with defaults.
demo:
	bash .ci/setup.sh
	$(PYTHON) -m omni_prefix_cache simulate

# SIMFLAGS: e.g. SIMFLAGS="--eager --seed 3 --json"
simulate:
	$(PYTHON) -m omni_prefix_cache simulate $(SIMFLAGS)

# Issue 40's run: a 5 ms simulated forward per step (the committer works in its gap), every row
# the median of three runs. BENCHFLAGS: e.g. BENCHFLAGS="--json", "--repeat 1" or "--profile prefill_hits"
bench:
	$(PYTHON) -m omni_prefix_cache bench --forward-us 5000 --repeat 3 $(BENCHFLAGS)

.PHONY: mutants
# MUTANTFLAGS: e.g. MUTANTFLAGS="--explore" (also run `explore --mutant` per mutant, up to 5 min each)
mutants:
	$(PYTHON) -m omni_prefix_cache.testing.mutant_catalogue $(MUTANTFLAGS)

# The runtime's real threads under a controlled scheduler (docs/explore.md): every scenario to
# its bound. EXPLOREFLAGS: e.g. "--mutant cow_copy_missed_before_reads_lock", "--replay TOKEN",
# "--strategy pct --budget 500", "--scenario reuse-read --json".
.PHONY: explore stress
explore:
	$(PYTHON) -m omni_prefix_cache explore $(EXPLOREFLAGS)

# Free-running threads at full speed, the history checked for linearizability (DURATION s).
stress:
	$(PYTHON) -m omni_prefix_cache.testing.explore.history --duration $(or $(DURATION),60)

# Bounded exhaustive check of the composition spec, the write path then the request lifecycle
# (the CI bound, well under a minute; CHECKFLAGS="--model lifecycle --life-steps 4" for a longer lifecycle).
# CHECKFLAGS: e.g. CHECKFLAGS="--tasks 3 --steps 3 --keys 2", CHECKFLAGS="--broken escalate-requeues-copying"
# (a catalogued spec mutation) or CHECKFLAGS="--broken path/to/protocol.yaml" (a mutation kept as a file)
check:
	$(PYTHON) -m omni_prefix_cache check $(CHECKFLAGS)

# The CUDA path's first-run check (<3 min on one GPU); a CPU dry run without CUDA.
# GPUCHECKFLAGS: e.g. GPUCHECKFLAGS="--dry-run" or GPUCHECKFLAGS="--json --steps 800"
.PHONY: gpu-check
gpu-check:
	$(PYTHON) -m omni_prefix_cache.tools.gpu_check $(GPUCHECKFLAGS)

# A recorded 700-step simulate run (threaded committer, lagged materialize), validated against the
# specs afterwards (docs/trace.md); CI runs it. TRACE: where the trace goes; TRACEFLAGS: e.g. "--eager".
.PHONY: trace-check
TRACE ?= build/trace-check.jsonl
trace-check:
	@mkdir -p $(dir $(TRACE))
	$(PYTHON) -m omni_prefix_cache simulate --steps 700 --arrival-steps 300 --quiet --trace $(TRACE) $(TRACEFLAGS)

# Fresh-seed fuzzing of every stateful machine (generated spec machines and racing
# machines), each failure found kept in FUZZ_DB and replayed first next time.
# `make fuzz` runs long by hand (DURATION default 600 s); `make ci-fuzz` is CI's pass
# (default 180 s). MUTANT=<name> switches a catalogued mutant on; FUZZFLAGS passes more
# (e.g. FUZZFLAGS="--machine SystemRace"; `$(PYTHON) tests/fuzz.py --help`).
.PHONY: fuzz ci-fuzz
FUZZ_DB ?= .fuzz-db
FUZZ_ARGS = --db $(FUZZ_DB) $(if $(MUTANT),--mutant $(MUTANT)) $(FUZZFLAGS)
fuzz:
	$(PYTHON) tests/fuzz.py --duration $(or $(DURATION),600) $(FUZZ_ARGS)

ci-fuzz:
	$(PYTHON) tests/fuzz.py --duration $(or $(DURATION),180) $(FUZZ_ARGS)

# The real vLLM 0.33.0 (CPU, no weights) in .venv-vllm, built on first use (timed; ~0.5 GB download),
# then tests_vllm: the simulate workload on vLLM's scheduler and InputBatch, protocol checks.
.PHONY: test-vllm
test-vllm:
	PYTHON=$(PYTHON) bash .ci/setup-vllm.sh
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests_vllm
