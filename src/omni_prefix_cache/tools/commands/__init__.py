"""The subcommands of ``omni-prefix-cache``, one module each.

Every module has ``add_parser(sub)``, which declares its arguments on the
subparsers of ``tools.cli``, and ``run(args) -> int``, its exit status
(``common``). They import nothing heavy at module scope: ``--help`` must
not pay torch's import.
"""
