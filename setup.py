"""Package discovery; every other setting lives in pyproject.toml.

pyproject's ``[tool.setuptools]`` table can either list packages or discover
them, not both, and the specs need both: every package under ``src/`` is
discovered (a new sub-package ships without editing a list), and the
repository's ``spec/`` folder, the specs' one source, ships as
``omni_prefix_cache._spec`` (see ``package-dir`` in pyproject.toml).
tests/test_packaging.py builds a wheel and fails when a module is missing.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages("src", include=["omni_prefix_cache", "omni_prefix_cache.*"]), "omni_prefix_cache._spec"])
