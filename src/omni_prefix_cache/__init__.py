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
        StageCacheOutputs,
        WriteSchedule,
    )

__all__ = [
    "HIDDEN_KEY",
    "ModelCachePolicy",
    "OmniPrefixCacheInvalidArgumentError",
    "OmniPrefixCacheInvalidTypeError",
    "OmniPrefixCacheJoinTimeoutError",
    "OmniPrefixCacheShutdownError",
    "OmniPrefixCacheStagingTimeoutError",
    "OmniPrefixCacheUnmatchError",
    "OmniPrefixCacheWriteFailedError",
    "PrefixCacheConfig",
    "StageCacheOutputs",
    "WriteSchedule",
    "__version__",
]


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
        value = getattr(import_module("omni_prefix_cache.interface"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
