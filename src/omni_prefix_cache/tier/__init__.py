"""The host tier: hidden states and mm rows kept past GPU-slot reuse, keyed by
vLLM block hash, for hits a KV connector loads (spec/host_tier.yaml).

``metadata`` is what the scheduler side tells the worker each step;
``index`` is the scheduler side's record of what the tier holds (LRU, bounded
by bytes); ``store`` is the worker side's entries and their rows; ``connector``
is the vLLM KV connector that wraps the configured one (imported by vLLM only).
"""
