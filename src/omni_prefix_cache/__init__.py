"""Omni prefix cache: full-prompt hidden states and token-major mm outputs
for multi-stage vLLM serving, even when prefix caching skipped the forward.

Rows are mirrored into a CPU block pool addressed by KV slot id; the
lifecycles that govern them are declared in the repository's ``spec/``.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str
    from omni_prefix_cache.adapter import (
        PrefixCacheEventKind,
        PrefixCacheRequestEvent,
        PrefixCacheRequestOwner,
        PrefixCacheSchedulerAdapter,
        PrefixCacheStep,
        PrefixCacheWrite,
        PrefixCacheWriteLayout,
    )
    from omni_prefix_cache.block_pool import PrefixBlockPool
    from omni_prefix_cache.controller import OmniPrefixCacheController
    from omni_prefix_cache.group_view import (
        FullAttentionGroupView,
        check_prefix_cache_kv_groups,
        check_prefix_cache_kv_transfer,
        get_prefix_cache_group_view,
        stage_prefix_cache_config,
    )
    from omni_prefix_cache.interface import (
        HIDDEN_KEY,
        ModelCachePolicy,
        OmniPrefixCacheInvalidArgumentError,
        OmniPrefixCacheInvalidTypeError,
        OmniPrefixCacheJoinTimeoutError,
        OmniPrefixCacheShutdownError,
        OmniPrefixCacheStagingTimeoutError,
        OmniPrefixCacheUnmatchError,
        OmniPrefixCacheWriteFailedError,
        PrefixCacheConfig,
        PrefixCacheRequestProgress,
        StageCacheOutputs,
        WriteSchedule,
    )
    from omni_prefix_cache.manager import OmniPrefixCacheManager

__all__ = [
    "HIDDEN_KEY",
    "FullAttentionGroupView",
    "OmniPrefixCacheController",
    "OmniPrefixCacheManager",
    "PrefixBlockPool",
    "check_prefix_cache_kv_groups",
    "check_prefix_cache_kv_transfer",
    "get_prefix_cache_group_view",
    "stage_prefix_cache_config",
    "ModelCachePolicy",
    "OmniPrefixCacheInvalidArgumentError",
    "OmniPrefixCacheInvalidTypeError",
    "OmniPrefixCacheJoinTimeoutError",
    "OmniPrefixCacheShutdownError",
    "OmniPrefixCacheStagingTimeoutError",
    "OmniPrefixCacheUnmatchError",
    "OmniPrefixCacheWriteFailedError",
    "PrefixCacheConfig",
    "PrefixCacheEventKind",
    "PrefixCacheRequestEvent",
    "PrefixCacheRequestOwner",
    "PrefixCacheRequestProgress",
    "PrefixCacheSchedulerAdapter",
    "PrefixCacheStep",
    "PrefixCacheWrite",
    "PrefixCacheWriteLayout",
    "StageCacheOutputs",
    "WriteSchedule",
    "__version__",
]


# Where each public name outside interface.py lives (resolved on first use).
_HOMES = {
    **dict.fromkeys(
        (
            "PrefixCacheEventKind",
            "PrefixCacheRequestEvent",
            "PrefixCacheRequestOwner",
            "PrefixCacheSchedulerAdapter",
            "PrefixCacheStep",
            "PrefixCacheWrite",
            "PrefixCacheWriteLayout",
        ),
        "omni_prefix_cache.adapter",
    ),
    "PrefixBlockPool": "omni_prefix_cache.block_pool",
    "OmniPrefixCacheController": "omni_prefix_cache.controller",
    "OmniPrefixCacheManager": "omni_prefix_cache.manager",
    "FullAttentionGroupView": "omni_prefix_cache.group_view",
    "check_prefix_cache_kv_groups": "omni_prefix_cache.group_view",
    "check_prefix_cache_kv_transfer": "omni_prefix_cache.group_view",
    "get_prefix_cache_group_view": "omni_prefix_cache.group_view",
    "stage_prefix_cache_config": "omni_prefix_cache.group_view",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omni-prefix-cache")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    # The public names live in interface.py, which imports torch (seconds);
    # resolving them on first use keeps `omni-prefix-cache --help` fast.
    if name == "__version__":
        value: Any = _version()
        globals()[name] = value
        return value
    if name in __all__:
        # The adapter's names resolve without torch.
        value = getattr(import_module(_HOMES.get(name, "omni_prefix_cache.interface")), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
