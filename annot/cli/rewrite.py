"""``annot rewrite``: annotated model files rewritten into their parallel form.

    annot rewrite model.py --tp 2                 # rewritten source on stdout
    annot rewrite model.py --tp 2 --diff          # unified diff, like black --diff
    annot rewrite model.py --tp 2 -o out/         # out/model.py, with an @generated header
    annot rewrite model.py --tp 2 --in-place      # overwrite model.py itself
    annot rewrite transformers.models.llama.modeling_llama:LlamaForCausalLM \
        --pp 2 --split model.layers.4 -o out/     # a nested forward, from an installed file

:func:`rewrite_source` is the one dispatch from the degrees to the rewriters
(tensor-parallel for ``--tp``, stages split for ``--pp``); the rest prints,
diffs or writes its results, refusing any write that would land outside
OUTDIR, on an input file, an installed one (in site-packages), or (without
``--force``) over a file annot did not write.

``FILE:CLASS`` or ``MODULE:CLASS`` names the root class to split at
``--split``, in a file with no ``@stage``: a boundary below a call
(``model.layers.4`` inside ``self.model(...)``) is followed into that class's
source, which gets stage methods of its own
(:mod:`annot.rewriters.split.nested_calls`).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import sys
import sysconfig
import tokenize
from typing import Optional

from annot.cli.inputs import Refusal, degree
from annot.core.errors import AnnotError, RewriteError
from annot.core.files import atomic_write

__all__ = ["add_rewrite", "rewrite_source"]


def add_rewrite(sub) -> None:
    p = sub.add_parser(
        "rewrite",
        help="rewrite annotated model files into their parallel form",
        description=(
            "Rewrite @shard-annotated model files into tensor-parallel source "
            "(Megatron layout). Prints to stdout unless --diff, -o or --in-place."
        ),
    )
    p.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="model source files; FILE:CLASS or MODULE:CLASS (an installed module, e.g. "
        "transformers.models.llama.modeling_llama:LlamaForCausalLM) names the class --split "
        "cuts, following boundaries into nested forwards",
    )
    p.add_argument(
        "--tp", type=degree, default=1, metavar="N", help="tensor-parallel degree (default 1)"
    )
    p.add_argument(
        "--pp", type=degree, default=1, metavar="N", help="pipeline-parallel degree (default 1)"
    )
    p.add_argument(
        "--split",
        metavar="PATHS",
        help="with --pp: comma-separated module paths where stages begin, for the @stage class "
        "or the CLASS given (overrides its split=[...]; needed for @stage(auto=True) and "
        "CLASS: see `annot plan`)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "-o",
        "--output",
        dest="outdir",
        metavar="OUTDIR",
        help="write OUTDIR/<file name> with an @generated header (OUTDIR is created); a "
        "file there without annot's header is not overwritten unless --force",
    )
    mode.add_argument("--diff", action="store_true", help="print a unified diff, change nothing")
    mode.add_argument("--in-place", action="store_true", help="overwrite the input files")
    p.add_argument(
        "--force", action="store_true", help="with -o: overwrite files annot did not write"
    )
    p.set_defaults(run=_run_rewrite)


def rewrite_source(
    source: bytes,
    path: str,
    *,
    tp: int,
    pp: int = 1,
    split: Optional[list[str]] = None,
    root: Optional[str] = None,
) -> bytes:
    """The one dispatch from ``annot rewrite``'s degrees to the rewriters.

    ``--tp 1`` leaves the source as it is; ``--pp N`` splits every ``@stage``
    class into N stages (its ``split=[...]``, ``annot.boundary()`` markers, or
    ``split`` given here), or the class ``root`` at ``split``, following
    boundaries below its calls into the nested forwards of this file.
    """
    from annot.rewriters.tp.rewrite import rewrite_tensor_parallel

    out = source
    if tp > 1:
        out = rewrite_tensor_parallel(out, tp, path=path)
    if pp > 1 and root is not None:
        from annot.rewriters.split.stage_split import split_stages

        if split is None:
            raise Refusal(
                f"{path}:{root}: give --split with {pp - 1} module path(s) where stages begin "
                f"(`annot plan MODULE:{root} --pp {pp}` prints a balanced choice)"
            )
        encoding, _ = tokenize.detect_encoding(io.BytesIO(out).readline)
        result = split_stages(out.decode(encoding), root, split, path=path, nested=True)
        if len(result.stages) != pp:
            raise Refusal(
                f"{path}:{root} splits into {len(result.stages)} stages but --pp is {pp}; give "
                "--split with pp - 1 module paths"
            )
        return result.source.encode(encoding)
    if pp > 1:
        from annot.rewriters.analysis.hint_reader import read_stage_hints
        from annot.rewriters.split.stage_split import split_decorated

        encoding, _ = tokenize.detect_encoding(io.BytesIO(out).readline)
        text = out.decode(encoding)
        classes = list(read_stage_hints(text, path))
        boundaries = None
        if split is not None:
            if not classes:
                raise Refusal(
                    f"{path}: --split needs a @stage class to split, and this file has none: "
                    f"name the class to split as {path}:CLASS (or MODULE:CLASS), whose "
                    "boundaries may lie in nested forwards (model.layers.4)"
                )
            if len(classes) != 1:
                raise Refusal(
                    f"{path}: --split needs exactly one @stage class, found {len(classes)}"
                )
            boundaries = {classes[0]: split}
        text, splits = split_decorated(text, path=path, boundaries=boundaries, nested=True)
        for name, sp in splits.items():
            if len(sp.stages) != pp:
                raise Refusal(
                    f"{path}: {name} splits into {len(sp.stages)} stages but --pp is {pp}; "
                    "give --split with pp - 1 module paths"
                )
        out = text.encode(encoding)
    assert isinstance(out, bytes)
    return out


def _source(spec: str) -> tuple[str, Optional[str]]:
    """``FILE``, ``FILE:CLASS``, ``MODULE`` or ``MODULE:CLASS`` -> (the file's
    path, CLASS or None)."""
    if os.path.exists(spec):
        return spec, None
    where, _, cls = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if cls and not cls.isidentifier():
        raise Refusal(f"{spec}: {cls!r} is not a class name (FILE:CLASS or MODULE:CLASS)")
    dotted = all(part.isidentifier() for part in where.split("."))
    if os.path.exists(where) or where.endswith(".py") or not dotted:
        return where, cls or None
    try:
        found = importlib.util.find_spec(where)
    except Exception as exc:  # noqa: BLE001 - a parent package's __init__ may raise anything
        raise Refusal(
            f"{spec}: cannot find module {where!r} ({type(exc).__name__}: {exc}); for a file, "
            f"give its path: {where.replace('.', '/')}.py:{cls or 'CLASS'}"
        ) from None
    if found is None or not found.origin or not found.origin.endswith(".py"):
        raise Refusal(
            f"{spec}: {where!r} is neither a file nor an importable Python module with source "
            f"(a file: {where.replace('.', '/')}.py:{cls or 'CLASS'})"
        )
    return found.origin, cls or None


def _installed(path: str) -> bool:
    """Whether ``path`` lies in an installed package (site- or dist-packages,
    the interpreter's own library)."""
    real = os.path.realpath(path)
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    parts = real.split(os.sep)
    return (
        "site-packages" in parts
        or "dist-packages" in parts
        or any(real.startswith(os.path.realpath(r) + os.sep) for r in roots)
    )


def _options(args: argparse.Namespace) -> str:
    """The options that made a file, for its @generated header (re-runnable)."""
    out = f"--tp {args.tp}" + (f" --pp {args.pp}" if args.pp > 1 else "")
    return out + (f" --split {args.split}" if args.split else "")


def _decode(data: bytes) -> str:
    """Source bytes as text, honouring a coding cookie or BOM."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


def _run_rewrite(args: argparse.Namespace) -> int:
    results: list[tuple[str, bytes, bytes]] = []
    roots: dict[str, Optional[str]] = {}
    failed = False
    try:
        if args.split and args.pp == 1:
            n = len(args.split.split(",")) + 1
            raise Refusal(f"--split {args.split} cuts pipeline stages: give --pp {n} with it")
        if args.force and args.outdir is None:
            raise Refusal("--force only applies to -o OUTDIR")
        for spec in args.files:
            path, root = _source(spec)
            if root is not None and args.pp == 1:
                raise Refusal(f"{spec}: CLASS names the class --split cuts: give --pp N with it")
            if args.in_place and _installed(path):
                raise Refusal(
                    f"{spec}: {path} is an installed file; annot does not rewrite it in place. "
                    "Write the rewritten copy with -o OUTDIR"
                )
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as exc:
                raise Refusal(f"{path}: cannot read: {exc.strerror or exc}") from None
            try:
                roots[path] = root
                results.append(
                    (
                        path,
                        data,
                        rewrite_source(
                            data,
                            path,
                            tp=args.tp,
                            pp=args.pp,
                            split=args.split.split(",") if args.split else None,
                            root=root,
                        ),
                    )
                )
            except RewriteError as exc:
                print(exc, file=sys.stderr)
                failed = True
        if failed:
            return 2
        if args.diff:
            _print_diffs(results, args)
        elif args.outdir is not None:
            _write_outdir(results, args, roots)
        elif args.in_place:
            _write_in_place(results)
        else:
            _print_sources(results)
    except (Refusal, AnnotError, OSError) as exc:
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
    from annot.rewriters.source.diagnostics import unified_diff

    label = f"annot tp={args.tp}" + (f" pp={args.pp}" if args.pp > 1 else "")
    for path, data, out in results:
        sys.stdout.write(unified_diff(_decode(data), _decode(out), path, label))
    sys.stdout.flush()


def _destination(outdir: str, path: str) -> str:
    """``OUTDIR/<basename of path>``, refusing anything that would land outside
    OUTDIR or on the input file."""
    name = os.path.basename(path)
    if name in ("", ".", "..") or os.path.isabs(name) or os.sep in name:
        raise Refusal(f"{path}: cannot name an output file after it")
    root = os.path.realpath(outdir)
    if os.path.exists(root) and not os.path.isdir(root):
        raise Refusal(f"-o {outdir}: exists and is not a directory")
    dest = os.path.join(root, name)
    real = os.path.realpath(dest)
    if os.path.dirname(real) != root:
        raise Refusal(
            f"-o {outdir}: {dest} is a link to {real}, outside {outdir}; annot writes only "
            "inside OUTDIR, so remove the link or pick another directory"
        )
    if os.path.realpath(path) == real or (os.path.exists(dest) and os.path.samefile(path, dest)):
        raise Refusal(
            f"-o {outdir}: writing {dest} would overwrite the input {path}; pick another "
            "directory, or use --in-place to rewrite the file itself"
        )
    return dest


def _write_outdir(
    results: list[tuple[str, bytes, bytes]],
    args: argparse.Namespace,
    roots: dict[str, Optional[str]],
) -> None:
    from annot.rewriters.source.codegen import add_generated_header, generated_header

    plan: dict[str, tuple[str, bytes]] = {}
    for path, data, out in results:
        dest = _destination(args.outdir, path)
        if dest in plan:
            raise Refusal(
                f"-o {args.outdir}: {plan[dest][0]} and {path} would both be written to {dest}; "
                "rewrite them into different directories"
            )
        if os.path.exists(dest) and not args.force and not _annot_wrote(dest):
            raise Refusal(
                f"-o {args.outdir}: {dest} exists and annot did not write it (no @generated "
                "header); nothing the user wrote is overwritten: pick another directory, "
                "move the file, or pass --force"
            )
        root = roots.get(path)
        source = os.path.normpath(path) + (f":{root}" if root else "")
        header = generated_header(_options(args), source, data)
        content = add_generated_header(out, header, path)
        assert isinstance(content, bytes)
        plan[dest] = (path, content)
    os.makedirs(args.outdir, exist_ok=True)
    for dest, (_, content) in plan.items():
        atomic_write(dest, content)
        print(
            f"annot rewrite: wrote {os.path.join(args.outdir, os.path.basename(dest))}",
            file=sys.stderr,
        )


def _annot_wrote(path: str) -> bool:
    """True if ``path`` carries annot's @generated header in its first lines."""
    from annot.rewriters.source.codegen import GENERATED_PREFIX

    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace").splitlines()[:4]
    except OSError:
        return False
    return any(line.lstrip("\ufeff").startswith(GENERATED_PREFIX) for line in head)


def _write_in_place(results: list[tuple[str, bytes, bytes]]) -> None:
    for path, data, out in results:
        if out != data:
            atomic_write(path, out)
            print(f"annot rewrite: rewrote {path}", file=sys.stderr)
