# Makes spec/*.yaml installable as the package data `omni_prefix_cache._spec`
# (see pyproject.toml). The specs themselves are the YAML files beside this.
