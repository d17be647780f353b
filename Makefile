# Everyday commands. `make setup` installs what a fresh machine lacks.
PYTHON ?= python3
PYTEST ?= $(PYTHON) -m pytest

.PHONY: setup diagrams diagrams-check test lint

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
