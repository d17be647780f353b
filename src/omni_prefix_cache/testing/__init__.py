"""Test support: spec-driven test generation, reference models, mutants.

- ``stateful``: ``build_machine(adapter)`` turns any spec into a Hypothesis
  ``RuleBasedStateMachine`` (one rule per trigger, Bundles of handles, the
  spec's invariants) played against a runtime through a ``SpecAdapter``.
- ``interpreter``: a generic runtime that runs a spec's compiled table.
- ``adapters``: the adapters for the real runtime objects, one module per spec.
- ``mutants``: spec copies with a move added or removed.
- ``modelcheck``: the bounded exhaustive check of the composition spec
  (``omni-prefix-cache check``); needs no Hypothesis. Its broken variants
  are spec mutations (``model_mutations``).
- ``protocol_tests``: ``build_machine(spec, eager=...)`` turns the composition
  spec into a machine against the real manager + manual committer (one rule
  per operation driver, one invariant per protocol invariant, the row oracle).
- ``mutant_catalogue``: runtime bugs re-injected for ``make mutants``;
  ``mutant_runner`` judges them (subprocess runs, kill classification).
"""
