"""Benchmarks: what the manager costs the engine thread and the output builder per step.

Each scenario is scheduled ahead of time by the simulator's scheduler, so the
timed loop runs only the manager calls (``new_step_starts`` + ``save_outputs``
for the engine thread; ``materialize`` for the output builder). Next to every
timed call the same loop times a memcpy floor: a torch clone of the same
bytes (the step's saved rows for the engine; the rows materialize returned,
as one contiguous tensor per key, for the builder). Targets are ratios to
that floor, so they travel between machines.

Scenarios:

- ``decode``: 64 requests x 1 token per step, hidden 2048 bf16, one
  token-major mm key.
- ``prefill_hits``: 512-token prompts sharing a 256-token system prompt,
  block size 16, 2048-token steps; later arrivals hit the system prompt.
- ``deferred``: a deferred mm key; two-turn conversations whose second turn
  hits the first turn's prompt and answer.
- ``decode_256``: ``decode`` at 256 requests.
- ``decode_mm4``: ``decode`` with four token-major mm keys.
- ``sweep``: ``decode`` at 16, 64 and 256 requests in each mode (engine us
  per request; a fit into fixed + per-request cost).

Every scenario runs in eager and threaded mode (``--mode``). Targets (issue
27, "the engine thread pays per step") are checked per (scenario, mode) and
across rows (``goals``: the sweep fits, one scenario against another) and
printed with their verdicts; with a baseline file (the previous release's report, kept as
``docs/bench_baseline.json``) every row also shows its floor-normalised
ratio to the baseline's.

Each (scenario, mode) also reports the step total: engine plus materialize
wall time of the same step (p50 of the per-step sums). In threaded mode the
committer thread's pass for a step overlaps that step's materialize (the
bench has no forward pass between steps to hide it behind), and the two
threads share the GIL, so work moved off the engine thread can show up as
materialize wall time; the step total is what the engine loop pays for both.
It is compared with the baseline as raw wall time against the sum of the
baseline's two medians (the baseline keeps medians, not per-step sums).
Threaded rows also report the committer thread's CPU time inside each
timed call (read from its thread CPU clock, where the platform has one).

``--metrics both`` (the command's default) runs every (scenario, mode)
twice, back to back, with the runtime metrics (``PrefixCacheConfig.metrics``)
off and on, the first side alternating from pair to pair; the tables are
the off side's (what the targets and the baseline judge) and a last table
gives on / off of the engine, materialize and step p50s. ``--metrics off``
or ``on`` runs one side. The sweep runs with metrics off in both.

``--scrape HZ`` (default 0: none) adds, after those runs, every (scenario,
mode) twice more, back to back, the first side alternating: without and
with a thread that scrapes the Prometheus collector over the run's manager
(``generate_latest``, as a Prometheus server would) HZ times a second on a
schedule while the timed steps run. Both sides run with metrics on whatever
``--metrics`` says (a scrape without them reads only the snapshot), so the
with / without ratio is the scrape's cost alone; a last table gives the
engine and step p50 of both, their ratios, the scrapes done and their p50.

``--forward-us N`` (default 0) simulates the forward pass a real engine runs
between ``new_step_starts`` and ``save_outputs``: the engine thread sleeps N
us there (releasing the GIL, as a wait on the GPU does), outside the timed
engine span. Without it the hit prefetches ``new_step_starts`` starts run
inside ``save_outputs``, on a machine with fewer free cores than threads.

``--warm-pool`` writes every pool slab's pages once when it opens (a
warmup step), so the timed steps carry no first-touch faults; the default
is cold, as the baseline. The CLI also times the pool write's paths alone
(``pool_write``: ``index_copy_``, numpy by row, whole blocks) and runs the
wake probe (``wake_probe``): eager decode alone and with a no-op thread
woken after every step, the machine's share of a threaded row's engine time.

Modules: ``scenarios`` (the traces, their targets and planning), ``floors``
(the memcpy floors and the static buffers), ``measure`` (timing one
scenario), ``results`` (rows, targets' verdicts, the report and the
baseline), ``goals`` (the targets judged across rows), ``pool_write`` (the
pool write's paths alone), ``sweep`` (the batch sweep's spread and fit), ``sides`` (the
``--metrics both`` and ``--scrape`` pairs and their tables), ``scrape``
(the scrape thread), ``wake_probe`` (what waking an idle thread once a
step costs the engine thread on this host, beside the threaded rows),
``vllm_step`` (vLLM's own decode scheduler step, timed in a vLLM venv's
subprocess after the sweep, the yardstick of issue 40's targets:
``--vllm-python``, default ``.venv-vllm/bin/python`` when present),
``report`` (the tables), ``profiling``
(``--profile``), ``runner`` (a whole run, the CLI entry).
"""

from __future__ import annotations

from omni_prefix_cache.tools.bench.measure import run_scenario
from omni_prefix_cache.tools.bench.profiling import profile_scenario
from omni_prefix_cache.tools.bench.report import format_report
from omni_prefix_cache.tools.bench.results import (
    BASELINE_PATH,
    BASELINE_SLACK,
    STEP_SIDE,
    BenchReport,
    MetricsPair,
    ScenarioResult,
    ScrapePair,
    ScrapeStats,
    Target,
    TargetVerdict,
    load_baseline,
)
from omni_prefix_cache.tools.bench.runner import main_bench, run_bench
from omni_prefix_cache.tools.bench.scenarios import (
    DECODE_TARGETS,
    DEFERRED_KEY,
    MM_KEY,
    MODES,
    PREFILL_TARGETS,
    SCENARIOS,
    Scenario,
    StepInput,
    decode_scenario,
    deferred_scenario,
    plan_steps,
    prefill_hits_scenario,
)
from omni_prefix_cache.tools.bench.scrape import Scraper, ScrapeRun, collector_scrape
from omni_prefix_cache.tools.bench.sides import METRICS_CHOICES, run_pair, run_scrape_pair, with_metrics
from omni_prefix_cache.tools.bench.sweep import SWEEP_SIZES, SWEEP_TARGET, fixed_cost_allowed, linear_fit

__all__ = [
    "BASELINE_PATH",
    "BASELINE_SLACK",
    "DECODE_TARGETS",
    "DEFERRED_KEY",
    "METRICS_CHOICES",
    "MM_KEY",
    "MODES",
    "PREFILL_TARGETS",
    "SCENARIOS",
    "STEP_SIDE",
    "SWEEP_SIZES",
    "SWEEP_TARGET",
    "BenchReport",
    "MetricsPair",
    "Scenario",
    "ScenarioResult",
    "ScrapePair",
    "ScrapeRun",
    "ScrapeStats",
    "Scraper",
    "StepInput",
    "Target",
    "TargetVerdict",
    "collector_scrape",
    "decode_scenario",
    "deferred_scenario",
    "fixed_cost_allowed",
    "format_report",
    "linear_fit",
    "load_baseline",
    "main_bench",
    "plan_steps",
    "prefill_hits_scenario",
    "profile_scenario",
    "run_bench",
    "run_pair",
    "run_scenario",
    "run_scrape_pair",
    "with_metrics",
]
