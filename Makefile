# Everyday commands. `make setup` installs what a fresh machine lacks.
PYTHON ?= python3
PYTEST ?= $(PYTHON) -m pytest

.PHONY: setup diagrams diagrams-check typed-specs typed-specs-check test lint demo simulate bench check examples

setup:
	bash .ci/setup.sh

diagrams:
	$(PYTHON) -m omni_prefix_cache diagrams --out diagrams

diagrams-check:
	$(PYTHON) -m omni_prefix_cache diagrams --out diagrams --check

# Typed state enums and trigger names (src/omni_prefix_cache/spec_types/) from spec/*.yaml;
# committed, and checked for staleness by tests/test_spec_types.py.
typed-specs:
	$(PYTHON) -m omni_prefix_cache.specs.typed

typed-specs-check:
	$(PYTHON) -m omni_prefix_cache.specs.typed --check

# ruff, then mypy --strict over the package (its settings: [tool.mypy] in pyproject.toml).
lint:
	$(PYTHON) -m ruff check src tests spec examples
	$(PYTHON) -m ruff format --check src tests spec examples
	$(PYTHON) -m mypy --strict src

# The CI bound of the exhaustive model check (~15-60 s), then the test suite.
test:
	$(PYTHON) -m omni_prefix_cache check
	$(PYTEST) -q

# The engine-loop examples; each checks its own rows (tests/test_examples.py runs them too).
examples:
	$(PYTHON) examples/minimal_engine.py
	$(PYTHON) examples/threaded_lagged.py

# Fresh machine -> install -> a verified serving simulation with defaults.
demo:
	bash .ci/setup.sh
	$(PYTHON) -m omni_prefix_cache simulate

# SIMFLAGS: e.g. SIMFLAGS="--eager --seed 3 --json"
simulate:
	$(PYTHON) -m omni_prefix_cache simulate $(SIMFLAGS)

# BENCHFLAGS: e.g. BENCHFLAGS="--json" or BENCHFLAGS="--profile prefill_hits"
bench:
	$(PYTHON) -m omni_prefix_cache bench $(BENCHFLAGS)

.PHONY: mutants
mutants:
	$(PYTHON) -m omni_prefix_cache.testing.mutant_catalogue

# Bounded exhaustive check of the composed model (the CI bound, about a minute).
# CHECKFLAGS: e.g. CHECKFLAGS="--tasks 3 --steps 3" or CHECKFLAGS="--broken escalate-requeues-copying"
check:
	$(PYTHON) -m omni_prefix_cache check $(CHECKFLAGS)

.PHONY: fuzz
DURATION ?= 600
fuzz:
	$(PYTHON) tests/fuzz.py --duration $(DURATION)
