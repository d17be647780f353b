"""``omni-prefix-cache`` command line: diagrams, check, simulate."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cmd_diagrams(args: argparse.Namespace) -> int:
    from omni_prefix_cache.specs.diagrams import stale_diagrams, write_diagrams

    out = Path(args.out)
    if args.check:
        stale = stale_diagrams(out)
        if stale:
            print(f"stale diagrams in {out}: {', '.join(stale)} (run: make diagrams)", file=sys.stderr)
            return 1
        print(f"diagrams in {out} match the specs")
        return 0
    for path in write_diagrams(out, svg=not args.no_svg):
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-prefix-cache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("diagrams", help="render every spec into DOT (and SVG)")
    p.add_argument("--out", default="diagrams", help="output folder (default: diagrams)")
    p.add_argument("--check", action="store_true", help="fail if a committed .dot differs from the specs")
    p.add_argument("--no-svg", action="store_true", help="write .dot only")
    p.set_defaults(func=_cmd_diagrams)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
