"""The vLLM general plugin (vllm_plugin.py): with OMNI_PREFIX_CACHE_AS_VLLM_OMNI=1,
``vllm_omni.core.prefix_cache`` and its submodules are this library's modules;
without it nothing changes. tests_vllm/test_vllm_plugin_loader.py runs it
through vLLM's own plugin loader."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from omni_prefix_cache import compat, vllm_plugin


@pytest.fixture
def alias(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The plugin registered with the variable set; uninstalled afterwards."""
    assert not any(name.startswith("vllm_omni") for name in sys.modules), "vllm_omni imported before the test"
    monkeypatch.setenv(vllm_plugin.ENV_VAR, "1")
    vllm_plugin.register()
    yield
    vllm_plugin.uninstall()


@pytest.mark.usefixtures("alias")
def test_upstream_module_paths_are_this_librarys_modules() -> None:
    import omni_prefix_cache
    import omni_prefix_cache.manager

    upstream = importlib.import_module("vllm_omni.core.prefix_cache")
    manager = importlib.import_module("vllm_omni.core.prefix_cache.manager")
    assert upstream is omni_prefix_cache
    assert manager is omni_prefix_cache.manager
    assert upstream.OmniPrefixCacheManager is omni_prefix_cache.manager.OmniPrefixCacheManager
    # The library's modules keep their own identity (name, spec, no borrowed __path__).
    assert manager.__name__ == manager.__spec__.name == "omni_prefix_cache.manager"
    assert not hasattr(manager, "__path__")
    # A nested package resolves too, and still finds its files.
    loader = importlib.import_module("vllm_omni.core.prefix_cache.specs.loader")
    assert loader.spec_dir().joinpath("write_task.yaml").is_file()


@pytest.mark.usefixtures("alias")
def test_a_module_the_library_lacks_stays_missing() -> None:
    with pytest.raises(ModuleNotFoundError, match="runner_mixin"):
        importlib.import_module("vllm_omni.core.prefix_cache.runner_mixin")


def test_register_is_idempotent_and_uninstall_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_plugin.ENV_VAR, "1")
    monkeypatch.setenv(vllm_plugin.SEAMS_ENV_VAR, "1")
    before = list(sys.meta_path)
    vllm_plugin.register()
    vllm_plugin.register()
    assert sum(isinstance(f, vllm_plugin.PrefixCacheAlias) for f in sys.meta_path) == 1
    assert not compat.upstream_seams_installed()  # nothing imported through the alias yet
    importlib.import_module("vllm_omni.core.prefix_cache.interface")
    # Upstream's tests run against the library now: managers serve its per-request seams.
    assert compat.upstream_seams_installed()
    vllm_plugin.uninstall()
    assert sys.meta_path == before and not compat.upstream_seams_installed()
    assert not [name for name in sys.modules if name.startswith("vllm_omni")]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("vllm_omni.core.prefix_cache")


def test_a_deployment_alias_installs_no_test_seams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_plugin.ENV_VAR, "1")
    monkeypatch.delenv(vllm_plugin.SEAMS_ENV_VAR, raising=False)
    vllm_plugin.register()
    try:
        importlib.import_module("vllm_omni.core.prefix_cache.interface")
        assert not compat.upstream_seams_installed()
    finally:
        vllm_plugin.uninstall()


@pytest.mark.parametrize("value", [None, "0", "yes"])
def test_without_the_variable_set_to_1_nothing_happens(value: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != vllm_plugin.ENV_VAR}
    if value is not None:
        env[vllm_plugin.ENV_VAR] = value
    code = (
        "import sys\n"
        "from omni_prefix_cache import vllm_plugin\n"
        "vllm_plugin.register()\n"
        "assert not vllm_plugin.installed()\n"
        "try:\n"
        "    import vllm_omni.core.prefix_cache\n"
        "except ModuleNotFoundError as e:\n"
        "    print('missing', e.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "missing vllm_omni"
