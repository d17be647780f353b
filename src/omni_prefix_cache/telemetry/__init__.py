"""Runtime metrics: spec-generated move counts and time in state, and the
data-path figures (``docs/stats.md``, "Metrics"). The bottom layer: imports
nothing of the package, so every runtime layer may record into it."""
