"""Omni prefix cache: full-prompt hidden states and token-major mm outputs
for multi-stage vLLM serving, even when prefix caching skipped the forward.

Rows are mirrored into a CPU block pool addressed by KV slot id; the
lifecycles that govern them are declared in the repository's ``spec/``.
"""

from omni_prefix_cache.interface import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheInvalidArgumentError,
    OmniPrefixCacheInvalidTypeError,
    OmniPrefixCacheShutdownError,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    OmniPrefixCacheWriteFailedError,
    PrefixCacheConfig,
    StageCacheOutputs,
    WriteSchedule,
)

__all__ = [
    "HIDDEN_KEY",
    "ModelCachePolicy",
    "OmniPrefixCacheInvalidArgumentError",
    "OmniPrefixCacheInvalidTypeError",
    "OmniPrefixCacheShutdownError",
    "OmniPrefixCacheStagingTimeoutError",
    "OmniPrefixCacheUnmatchError",
    "OmniPrefixCacheWriteFailedError",
    "PrefixCacheConfig",
    "StageCacheOutputs",
    "WriteSchedule",
]
