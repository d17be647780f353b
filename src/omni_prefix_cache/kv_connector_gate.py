"""Which KV connectors a prefix-cache stage may run behind.

The mirror holds rows for the slots this stage computed. A KV connector
that loads KV (CPU offload, LMCache, a P/D transfer...) hands the scheduler
``num_computed_tokens`` for tokens whose KV it writes into newly allocated
GPU blocks; nothing in ``SchedulerOutput`` marks those tokens as external.
The manager would read them as a local hit and serve whatever rows those
blocks last held: another request's. vLLM's ``OffloadingConnector`` loads
whatever its ``kv_role`` (a producer loads too), and LMCache loads as a
producer with producer reuse, so the role says nothing: a connector is
admitted only when it is known never to load.

``STORE_ONLY_KV_CONNECTORS`` lists vLLM's own connectors whose scheduler
side never reports loadable tokens (``get_num_new_matched_tokens`` always
``0``), checked against vLLM 0.33. A ``MultiConnector`` is admitted when
every child is. A connector loaded from ``kv_connector_module_path`` is
someone else's code and is refused, whatever its name.

A loading connector is admitted behind this library's wrapper,
``OmniTierConnector`` from ``omni_prefix_cache.tier.connector`` (the
top-level connector, any role, wrapping any connector in its
``omni_tier_inner``): it caps the loads to the blocks whose rows the host
tier holds and names every load in the step's metadata, so the worker
restores those rows into the new blocks. Only at the top level: inside a
``MultiConnector`` its metadata is nested where the worker does not look,
so there it is refused. Nothing here imports vLLM: the config is read by
its attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_prefix_cache.interface import OmniPrefixCacheUnmatchError

# vLLM connectors that only store, with why (vLLM 0.33 source).
STORE_ONLY_KV_CONNECTORS: Mapping[str, str] = {
    "ExampleHiddenStatesConnector": "saves hidden states; get_num_new_matched_tokens always returns (0, False)",
}

_MULTI = "MultiConnector"
# The wrapper that admits a loading connector (tier/connector.py), and where vLLM loads it from.
TIER_CONNECTOR = "OmniTierConnector"
TIER_CONNECTOR_MODULE = "omni_prefix_cache.tier.connector"
_UNSET = object()


def _describe(name: str, role: object) -> str:
    return f"KV connector {name!r} (kv_role={role!r})"


def _refusal(name: object, role: object, module_path: object, extra: object, top: bool = True) -> str | None:
    """Why a connector with these settings may load KV past the mirror (None:
    it only stores, or it is the tier wrapper at the top level)."""
    if name is None:
        return None
    if name == TIER_CONNECTOR and module_path == TIER_CONNECTOR_MODULE:
        if top:
            return None
        return (
            f"{_describe(TIER_CONNECTOR, role)} is nested in a {_MULTI}, where the worker does not find its "
            f"metadata; make it the top-level connector, wrapping the {_MULTI}"
        )
    if module_path:
        where = f"kv_connector_module_path={module_path!r}"
        return f"{_describe(str(name), role)} comes from {where}, not known to only store"
    if name == _MULTI:
        children = extra.get("connectors", []) if isinstance(extra, Mapping) else []
        for child in children:
            child = child if isinstance(child, Mapping) else {}
            why = _refusal(
                child.get("kv_connector"),
                child.get("kv_role", role),
                child.get("kv_connector_module_path"),
                child.get("kv_connector_extra_config", {}),
                top=False,
            )
            if why is not None:
                return f"{_describe(_MULTI, role)} has a child that can load: {why}"
        return None
    if name in STORE_ONLY_KV_CONNECTORS:
        return None
    return f"{_describe(str(name), role)} can load KV"


def kv_connector_refusal(kv_transfer_config: Any) -> str | None:
    """Why ``kv_transfer_config`` (vLLM's ``KVTransferConfig`` or anything
    with its attributes; None for none) must not run behind a prefix-cache
    stage, or None when it may. A config without a ``kv_connector`` field
    counts as a connector when it claims any role."""
    if kv_transfer_config is None:
        return None
    name = getattr(kv_transfer_config, "kv_connector", _UNSET)
    role = getattr(kv_transfer_config, "kv_role", None)
    if name is _UNSET:
        claims = (getattr(kv_transfer_config, f, False) for f in ("is_kv_consumer", "is_kv_producer"))
        return f"{_describe('<unnamed>', role)} can load KV" if role or any(claims) else None
    return _refusal(
        name,
        role,
        getattr(kv_transfer_config, "kv_connector_module_path", None),
        getattr(kv_transfer_config, "kv_connector_extra_config", {}),
    )


def check_kv_connector(kv_transfer_config: Any) -> None:
    """Raise ``OmniPrefixCacheUnmatchError`` naming the connector unless it
    only stores KV or is the tier wrapper (see the module doc). Called by the
    stage gate."""
    why = kv_connector_refusal(kv_transfer_config)
    if why is None:
        return
    allowed = ", ".join(sorted(STORE_ONLY_KV_CONNECTORS))
    raise OmniPrefixCacheUnmatchError(
        "omni prefix caching cannot tell locally cached tokens from KV received through a KV connector: "
        f"{why}, and a hit it loads lands in new GPU blocks whose rows the mirror never wrote (another "
        f"request's rows would be served as this one's). Connectors known to only store: {allowed}. "
        f"To run behind a loading connector, wrap it: kv_connector={TIER_CONNECTOR!r}, "
        f"kv_connector_module_path={TIER_CONNECTOR_MODULE!r}, kv_connector_extra_config="
        "{'omni_tier_inner': {<the connector's KVTransferConfig fields>}, 'omni_tier_max_bytes': ..., "
        "'omni_tier_bytes_per_token': ...} (docs/integration.md). "
        "Or disable enable_prefix_caching on this stage, or run it without the connector"
    )
