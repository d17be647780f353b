"""vLLM general plugin: serve ``vllm_omni.core.prefix_cache`` from this library, opt-in.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes
(``vllm.plugins.load_general_plugins``); this package registers ``register``
there. With ``OMNI_PREFIX_CACHE_AS_VLLM_OMNI=1`` in the environment it installs
an import alias: ``vllm_omni.core.prefix_cache`` resolves to
``omni_prefix_cache``, and ``vllm_omni.core.prefix_cache.X`` to
``omni_prefix_cache.X`` (the same module objects, so a vLLM-Omni model runner
that imports upstream's names gets this library's). A submodule this library
does not have stays a ``ModuleNotFoundError``. Without the variable, or with
any other value than ``1``, nothing happens.

Where vLLM-Omni itself is installed its own ``vllm_omni`` and
``vllm_omni.core`` packages load as usual; only ``prefix_cache`` under them is
replaced. Where it is not, those two parents are empty placeholder packages,
so the alias still imports. Nothing here imports vLLM or torch.

Upstream's own tests run against the library under the alias too. With
``OMNI_PREFIX_CACHE_UPSTREAM_SEAMS=1`` as well, the first module imported
through the alias also installs compat's upstream seams
(``omni_prefix_cache.compat.install_upstream_seams``): managers built from
then on serve the per-request seams those tests wrap. A deployment leaves it
unset, so its managers never look for a wrapped seam. ``uninstall`` takes
the seams back out.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

ENV_VAR = "OMNI_PREFIX_CACHE_AS_VLLM_OMNI"
# With the alias: also serve upstream's test seams (running upstream's own tests; never in a deployment).
SEAMS_ENV_VAR = "OMNI_PREFIX_CACHE_UPSTREAM_SEAMS"
UPSTREAM = "vllm_omni.core.prefix_cache"
LIBRARY = "omni_prefix_cache"
# The upstream package's parents, given as empty placeholders only when no
# other finder provides them (vLLM-Omni not installed).
PARENTS = ("vllm_omni", "vllm_omni.core")
_PLACEHOLDER = "omni_prefix_cache placeholder"


def _library_name(fullname: str) -> str | None:
    """This library's module for an upstream module name (None: not ours)."""
    if fullname == UPSTREAM:
        return LIBRARY
    if fullname.startswith(UPSTREAM + "."):
        return LIBRARY + fullname[len(UPSTREAM) :]
    return None


class PrefixCacheAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on ``sys.meta_path``: upstream's prefix-cache modules are this
    library's modules, imported under their own names and registered under
    upstream's too."""

    def __init__(self) -> None:
        # alias name -> the library module's own spec, while it is loaded under the alias
        self._own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}
        # None until the first alias import; then whether it installed compat's seams.
        self.installed_seams: bool | None = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        name = _library_name(fullname)
        real = None if name is None else importlib.util.find_spec(name)
        if real is None:
            return None
        # A package only where the library's module is one (a plain module
        # given a __path__ would look like a package).
        return importlib.machinery.ModuleSpec(fullname, self, is_package=real.submodule_search_locations is not None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        name = _library_name(spec.name)
        assert name is not None  # find_spec answered only for upstream's names
        module = importlib.import_module(name)
        self._own_specs[spec.name] = module.__spec__
        if self.installed_seams is None:
            self.installed_seams = False
            if os.environ.get(SEAMS_ENV_VAR) == "1":
                from omni_prefix_cache import compat

                self.installed_seams = compat.install_upstream_seams()
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just set the alias's spec on the library's
        # module; give it back its own so it still knows its name and files.
        alias = module.__spec__.name if module.__spec__ is not None else ""
        if alias in self._own_specs:
            module.__spec__ = self._own_specs.pop(alias)


class PlaceholderParents(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: ``vllm_omni`` and ``vllm_omni.core`` as
    empty packages when nothing else provides them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PARENTS:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, None, loader_state=_PLACEHOLDER, is_package=True)
        spec.submodule_search_locations = []
        return spec


def installed() -> bool:
    """Whether the alias is on ``sys.meta_path``."""
    return any(isinstance(f, PrefixCacheAlias) for f in sys.meta_path)


def install() -> None:
    """Put the alias on ``sys.meta_path`` (idempotent). Any thread; call
    before the first ``import vllm_omni.core.prefix_cache``: a module already
    imported under that name stays what it is."""
    if installed():
        return
    sys.meta_path.insert(0, PrefixCacheAlias())
    sys.meta_path.append(PlaceholderParents())


def uninstall() -> None:
    """Take the alias off ``sys.meta_path`` and drop the modules imported
    through it (and the placeholder parents) from ``sys.modules``; takes
    out compat's seams where the alias installed them."""
    if any(isinstance(f, PrefixCacheAlias) and f.installed_seams for f in sys.meta_path):
        from omni_prefix_cache import compat

        compat.uninstall_upstream_seams()
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, PrefixCacheAlias | PlaceholderParents)]
    for name, module in list(sys.modules.items()):
        placeholder = name in PARENTS and getattr(module.__spec__, "loader_state", None) == _PLACEHOLDER
        if _library_name(name) is not None or placeholder:
            del sys.modules[name]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the alias when
    ``OMNI_PREFIX_CACHE_AS_VLLM_OMNI=1``, else do nothing."""
    if os.environ.get(ENV_VAR) == "1":
        install()
