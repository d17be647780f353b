"""Systematic interleaving exploration of the runtime's real threads.

- ``scheduler``: the controlled scheduler and the primitives it swaps into
  the ``omni_prefix_cache.device.sync`` seam for one run.
- ``strategies``: bounded-exhaustive DFS, PCT, replay tokens.
- ``scenarios``: the real manager driven from several threads, with probes,
  named invariants and the row oracle.
- ``runner``: ``explore`` and ``replay`` (``omni-prefix-cache explore``).
- ``history``: free-running stress with a linearizability check.
"""
