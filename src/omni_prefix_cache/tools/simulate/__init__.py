"""A verified serving simulation: a vLLM-like engine loop driving the manager.

``run_simulation(SimConfig(...))`` replays a synthetic trace (shared system
prompts, chunked prefill, decode, preemption, streaming continuations,
same-step hits, aborts, a deferred key) and checks every materialized row
exactly against a row function of the token prefix.
"""

from omni_prefix_cache.tools.simulate.engine import SimConfig, SimResult, Simulation, run_simulation
from omni_prefix_cache.tools.simulate.workload import WorkloadConfig

__all__ = ["SimConfig", "SimResult", "Simulation", "WorkloadConfig", "run_simulation"]
