"""Test support: spec-driven test generation, reference models, mutants."""
