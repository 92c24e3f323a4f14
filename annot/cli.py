"""The ``annot`` command.

    annot rewrite model.py --tp 2                 # rewritten source on stdout
    annot rewrite model.py --tp 2 --diff          # unified diff, like black --diff
    annot rewrite model.py --tp 2 -o out/         # out/model.py, with an @generated header
    annot rewrite model.py --tp 2 --in-place      # overwrite model.py itself
    annot --version

Exit status: 0 on success, 2 on any error (a refusal prints
``file:line:col: reason`` on stderr). On an error nothing is written. Files
are read as bytes and written back with their own encoding, BOM and line
endings; writes are atomic (a temporary file, then ``os.replace``).

Subcommands are argparse sub-parsers: a new one (``annot plan``) is a
``_add_<name>(subparsers)`` function and a line in :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import tokenize
from collections.abc import Sequence
from typing import Optional

from annot.errors import AnnotError, RewriteError

__all__ = ["build_parser", "main", "rewrite_source"]


class _Refusal(Exception):
    """A command-line mistake: printed as ``annot rewrite: <message>``, exit 2."""


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("annot")
    except Exception:  # not installed (running from a checkout)
        return "0+unknown"


def _degree(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="annot",
        description="Make @shard / @stage annotated PyTorch models parallel by source rewriting.",
    )
    parser.add_argument("--version", action="version", version=f"annot {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_rewrite(sub)
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


# ---- annot rewrite ----------------------------------------------------------


def _add_rewrite(sub) -> None:
    p = sub.add_parser(
        "rewrite",
        help="rewrite annotated model files into their parallel form",
        description=(
            "Rewrite @shard-annotated model files into tensor-parallel source "
            "(Megatron layout). Prints to stdout unless --diff, -o or --in-place."
        ),
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="model source files")
    p.add_argument(
        "--tp", type=_degree, default=1, metavar="N", help="tensor-parallel degree (default 1)"
    )
    p.add_argument(
        "--pp", type=_degree, default=1, metavar="N", help="pipeline-parallel degree (default 1)"
    )
    p.add_argument(
        "--split",
        metavar="PATHS",
        help="with --pp: comma-separated module paths where stages begin, for the @stage class "
        "(overrides its split=[...]; needed for @stage(auto=True): see `annot plan`)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "-o",
        "--output",
        dest="outdir",
        metavar="OUTDIR",
        help="write OUTDIR/<file name> with an @generated header (OUTDIR is created)",
    )
    mode.add_argument("--diff", action="store_true", help="print a unified diff, change nothing")
    mode.add_argument("--in-place", action="store_true", help="overwrite the input files")
    p.set_defaults(run=_run_rewrite)


def rewrite_source(
    source: bytes, path: str, *, tp: int, pp: int = 1, split: Optional[list[str]] = None
) -> bytes:
    """The one dispatch from ``annot rewrite``'s degrees to the rewriters.

    ``--tp 1`` leaves the source as it is; ``--pp N`` splits every ``@stage``
    class into N stages (its ``split=[...]``, ``annot.boundary()`` markers, or
    ``split`` given here).
    """
    from rewriters.tensor_parallel import rewrite_tensor_parallel

    out = source
    if tp > 1:
        out = rewrite_tensor_parallel(out, tp, path=path)
    if pp > 1:
        from rewriters.hint_reader import read_stage_hints
        from rewriters.stage_split import split_decorated

        encoding, _ = tokenize.detect_encoding(io.BytesIO(out).readline)
        text = out.decode(encoding)
        classes = list(read_stage_hints(text, path))
        boundaries = None
        if split is not None:
            if len(classes) != 1:
                raise _Refusal(
                    f"{path}: --split needs exactly one @stage class, found {len(classes)}"
                )
            boundaries = {classes[0]: split}
        text, splits = split_decorated(text, path=path, boundaries=boundaries)
        for name, sp in splits.items():
            if len(sp.stages) != pp:
                raise _Refusal(
                    f"{path}: {name} splits into {len(sp.stages)} stages but --pp is {pp}; "
                    "give --split with pp - 1 module paths"
                )
        out = text.encode(encoding)
    assert isinstance(out, bytes)
    return out


def _options(args: argparse.Namespace) -> str:
    return f"--tp {args.tp}" + (f" --pp {args.pp}" if args.pp > 1 else "")


def _decode(data: bytes) -> str:
    """Source bytes as text, honouring a coding cookie or BOM."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


def _run_rewrite(args: argparse.Namespace) -> int:
    results: list[tuple[str, bytes, bytes]] = []
    failed = False
    try:
        for path in args.files:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as exc:
                raise _Refusal(f"{path}: cannot read: {exc.strerror or exc}") from None
            try:
                results.append((path, data, rewrite_source(
                    data, path, tp=args.tp, pp=args.pp,
                    split=args.split.split(",") if args.split else None,
                )))
            except RewriteError as exc:
                print(exc, file=sys.stderr)
                failed = True
        if failed:
            return 2
        if args.diff:
            _print_diffs(results, args)
        elif args.outdir is not None:
            _write_outdir(results, args)
        elif args.in_place:
            _write_in_place(results)
        else:
            _print_sources(results)
    except (_Refusal, AnnotError, OSError) as exc:
        print(f"annot rewrite: {exc}", file=sys.stderr)
        return 2
    return 0


def _print_sources(results: list[tuple[str, bytes, bytes]]) -> None:
    for path, _, out in results:
        if len(results) > 1:
            _write_stdout(f"# ==> {path} <==\n".encode())
        _write_stdout(out)


def _write_stdout(data: bytes) -> None:
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:  # a text-only stream (e.g. io.StringIO)
        sys.stdout.write(_decode(data))
        return
    sys.stdout.flush()
    buffer.write(data)
    buffer.flush()


def _print_diffs(results: list[tuple[str, bytes, bytes]], args: argparse.Namespace) -> None:
    from rewriters.diagnostics import unified_diff

    label = f"annot tp={args.tp}" + (f" pp={args.pp}" if args.pp > 1 else "")
    for path, data, out in results:
        sys.stdout.write(unified_diff(_decode(data), _decode(out), path, label))
    sys.stdout.flush()


def _destination(outdir: str, path: str) -> str:
    """``OUTDIR/<basename of path>``, refusing anything that would land outside
    OUTDIR or on the input file."""
    name = os.path.basename(path)
    if name in ("", ".", "..") or os.path.isabs(name) or os.sep in name:
        raise _Refusal(f"{path}: cannot name an output file after it")
    root = os.path.realpath(outdir)
    if os.path.exists(root) and not os.path.isdir(root):
        raise _Refusal(f"-o {outdir}: exists and is not a directory")
    dest = os.path.join(root, name)
    real = os.path.realpath(dest)
    if os.path.dirname(real) != root:
        raise _Refusal(
            f"-o {outdir}: {dest} is a link to {real}, outside {outdir}; annot writes only "
            "inside OUTDIR, so remove the link or pick another directory"
        )
    if os.path.realpath(path) == real or (os.path.exists(dest) and os.path.samefile(path, dest)):
        raise _Refusal(
            f"-o {outdir}: writing {dest} would overwrite the input {path}; pick another "
            "directory, or use --in-place to rewrite the file itself"
        )
    return dest


def _write_outdir(results: list[tuple[str, bytes, bytes]], args: argparse.Namespace) -> None:
    from rewriters.codegen import add_generated_header, generated_header

    plan: dict[str, tuple[str, bytes]] = {}
    for path, data, out in results:
        dest = _destination(args.outdir, path)
        if dest in plan:
            raise _Refusal(
                f"-o {args.outdir}: {plan[dest][0]} and {path} would both be written to {dest}; "
                "rewrite them into different directories"
            )
        header = generated_header(_options(args), os.path.normpath(path), data)
        content = add_generated_header(out, header, path)
        assert isinstance(content, bytes)
        plan[dest] = (path, content)
    os.makedirs(args.outdir, exist_ok=True)
    for dest, (_, content) in plan.items():
        _atomic_write(dest, content)
        print(
            f"annot rewrite: wrote {os.path.join(args.outdir, os.path.basename(dest))}",
            file=sys.stderr,
        )


def _write_in_place(results: list[tuple[str, bytes, bytes]]) -> None:
    for path, data, out in results:
        if out != data:
            _atomic_write(path, out)
            print(f"annot rewrite: rewrote {path}", file=sys.stderr)


def _atomic_write(dest: str, data: bytes) -> None:
    """Write ``data`` to ``dest`` through a temporary file in the same directory
    and ``os.replace``: readers see the old file or the new one, never half."""
    try:
        mode = os.stat(dest).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(
        prefix=f".{os.path.basename(dest)}.", suffix=".tmp", dir=os.path.dirname(dest) or "."
    )
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


if __name__ == "__main__":
    sys.exit(main())
