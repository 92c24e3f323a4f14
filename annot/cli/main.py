"""The ``annot`` command.

    annot rewrite model.py --tp 2                 # rewritten source on stdout
    annot rewrite model.py --tp 2 --diff          # unified diff, like black --diff
    annot rewrite model.py --tp 2 -o out/         # out/model.py, with an @generated header
    annot rewrite model.py --tp 2 --in-place      # overwrite model.py itself
    annot plan model.py:GPT --pp 4 --input idx=int64[8,256]:vocab=50304 \
        --init 'GPTConfig(n_layer=8)'             # balanced stage boundaries, as a table
    annot verify model.py:GPT --tp 2 --input idx=int64[2,16]:64 \
        --hints hints.py:HINTS                    # tp=2 on gloo ranks vs one device
    annot hints model.py:GPT --init 'GPTConfig()' # the tp hints read off the sources
    annot --version

Exit status: 0 on success (``verify``: 1 on a mismatch), 2 on any error (a refusal prints
``file:line:col: reason`` on stderr). On an error nothing is written. Files
are read as bytes and written back with their own encoding, BOM and line
endings; writes are atomic (a temporary file, then ``os.replace``).

Subcommands are argparse sub-parsers, one module each (``annot/cli/rewrite.py``,
``cli_plan.py``, ``cli_verify.py``): a new one is an ``add_<name>(subparsers)``
function in ``annot/cli_<name>.py`` and a line in :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

from annot.cli.hints import add_hints
from annot.cli.plan import add_plan
from annot.cli.rewrite import add_rewrite, rewrite_source
from annot.cli.verify import add_verify

__all__ = ["build_parser", "main", "rewrite_source"]


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("annot")
    except PackageNotFoundError:  # not installed (running from a checkout)
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="annot",
        description="Make @shard / @stage annotated PyTorch models parallel by source rewriting.",
    )
    parser.add_argument("--version", action="version", version=f"annot {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_rewrite(sub)
    add_plan(sub)
    add_verify(sub)
    add_hints(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``annot`` command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
