"""``omni-prefix-cache diagrams``: render every spec into DOT (and SVG), or
check the committed DOT files against the specs."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from omni_prefix_cache.tools.commands.common import EXIT_ERROR, EXIT_FAILED, EXIT_OK, HelpFormatter, describe


def add_parser(sub: Any) -> None:
    """Declare ``diagrams`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "diagrams",
        help="render every spec into DOT (and SVG) diagrams",
        description=describe(
            "Render every spec/*.yaml into <out>/<name>.dot and .svg (the SVG needs graphviz's dot), "
            "and the package map (packages.dot: which layer imports which, read from the source). "
            "With --check, compare the committed .dot files with the specs and the source instead."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", default="diagrams", help="output folder")
    p.add_argument("--check", action="store_true", help="exit 1 if a committed .dot differs from the specs")
    p.add_argument("--no-svg", action="store_true", help="write .dot files only")
    p.set_defaults(func=run, validate=lambda args: validate(p, args))


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The output folder exists (created) and is writable; else a usage error."""
    if args.check:
        return
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"argument --out: cannot create folder {str(out)!r}: {exc.strerror or exc}")
    if not os.access(out, os.W_OK | os.X_OK):
        parser.error(f"argument --out: folder {str(out)!r} is not writable")


def run(args: argparse.Namespace) -> int:
    """Write (or with ``--check`` compare) the diagrams; the exit status."""
    try:
        from omni_prefix_cache.specs.diagrams import stale_diagrams, write_diagrams
    except ImportError as exc:
        print(f"diagrams: {exc}; install the extra: pip install 'omni-prefix-cache[diagrams]'", file=sys.stderr)
        return EXIT_ERROR
    from omni_prefix_cache.tools.package_map import render_package_map

    # The package map is drawn from the source beside the specs' pictures.
    extra = {"packages": render_package_map()}

    out = Path(args.out)
    if args.check:
        stale = stale_diagrams(out, extra)
        if stale:
            print(f"stale diagrams in {out}: {', '.join(stale)} (run: make diagrams)", file=sys.stderr)
            return EXIT_FAILED
        print(f"diagrams in {out} match the specs and the source")
        return EXIT_OK
    try:
        written = write_diagrams(out, svg=not args.no_svg, extra=extra)
    except OSError as exc:
        print(f"diagrams: cannot write to {out}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    for path in written:
        print(f"wrote {path}")
    return EXIT_OK
