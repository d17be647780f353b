# Everyday commands. `make setup` installs what a fresh machine lacks.
PYTHON ?= python3
PYTEST ?= $(PYTHON) -m pytest

.PHONY: setup diagrams diagrams-check test lint demo simulate bench

setup:
	bash .ci/setup.sh

diagrams:
	$(PYTHON) -m omni_prefix_cache diagrams --out diagrams

diagrams-check:
	$(PYTHON) -m omni_prefix_cache diagrams --out diagrams --check

lint:
	$(PYTHON) -m ruff check src tests spec
	$(PYTHON) -m ruff format --check src tests spec

test:
	$(PYTEST) -q

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
