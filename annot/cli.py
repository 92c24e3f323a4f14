"""The ``annot`` command.

    annot rewrite model.py --tp 2                 # rewritten source on stdout
    annot rewrite model.py --tp 2 --diff          # unified diff, like black --diff
    annot rewrite model.py --tp 2 -o out/         # out/model.py, with an @generated header
    annot rewrite model.py --tp 2 --in-place      # overwrite model.py itself
    annot plan model.py:GPT --pp 4 --input idx=int64[8,256]:vocab=50304 \
        --init 'GPTConfig(n_layer=8)'             # balanced stage boundaries, as a table
    annot verify model.py:GPT --tp 2 --input idx=int64[2,16]:64 \
        --hints hints.py:HINTS                    # tp=2 on gloo ranks vs one device
    annot --version

Exit status: 0 on success (``verify``: 1 on a mismatch), 2 on any error (a refusal prints
``file:line:col: reason`` on stderr). On an error nothing is written. Files
are read as bytes and written back with their own encoding, BOM and line
endings; writes are atomic (a temporary file, then ``os.replace``).

Subcommands are argparse sub-parsers: a new one (``annot plan``) is a
``_add_<name>(subparsers)`` function and a line in :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tokenize
from collections.abc import Sequence
from typing import Optional

from annot.cli_inputs import Refusal, build_model, describe, import_target, parse_inputs
from annot.cli_verify import add_verify
from annot.errors import AnnotError, PartitionError, RewriteError
from annot.files import atomic_write

__all__ = ["build_parser", "main", "rewrite_source"]


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
    _add_plan(sub)
    add_verify(sub)
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
    source: bytes, path: str, *, tp: int, pp: int = 1, split: Optional[list[str]] = None
) -> bytes:
    """The one dispatch from ``annot rewrite``'s degrees to the rewriters.

    ``--tp 1`` leaves the source as it is; ``--pp N`` splits every ``@stage``
    class into N stages (its ``split=[...]``, ``annot.boundary()`` markers, or
    ``split`` given here).
    """
    from annot.rewriters.tensor_parallel import rewrite_tensor_parallel

    out = source
    if tp > 1:
        out = rewrite_tensor_parallel(out, tp, path=path)
    if pp > 1:
        from annot.rewriters.hint_reader import read_stage_hints
        from annot.rewriters.stage_split import split_decorated

        encoding, _ = tokenize.detect_encoding(io.BytesIO(out).readline)
        text = out.decode(encoding)
        classes = list(read_stage_hints(text, path))
        boundaries = None
        if split is not None:
            if not classes:
                raise Refusal(
                    f"{path}: --split needs a @stage class to split in source, and this file "
                    "has none. For a model you cannot edit, annot cuts the stages at run time "
                    "(boundaries at any depth, no source change): see them with annot plan "
                    "MODULE:CLASS --pp N, and pass split=[...] to annot.parallelize"
                )
            if len(classes) != 1:
                raise Refusal(
                    f"{path}: --split needs exactly one @stage class, found {len(classes)}"
                )
            boundaries = {classes[0]: split}
        text, splits = split_decorated(text, path=path, boundaries=boundaries)
        for name, sp in splits.items():
            if len(sp.stages) != pp:
                raise Refusal(
                    f"{path}: {name} splits into {len(sp.stages)} stages but --pp is {pp}; "
                    "give --split with pp - 1 module paths"
                )
        out = text.encode(encoding)
    assert isinstance(out, bytes)
    return out


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
    failed = False
    try:
        if args.split and args.pp == 1:
            n = len(args.split.split(",")) + 1
            raise Refusal(f"--split {args.split} cuts pipeline stages: give --pp {n} with it")
        if args.force and args.outdir is None:
            raise Refusal("--force only applies to -o OUTDIR")
        for path in args.files:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as exc:
                raise Refusal(f"{path}: cannot read: {exc.strerror or exc}") from None
            try:
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
            _write_outdir(results, args)
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
    from annot.rewriters.diagnostics import unified_diff

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


def _write_outdir(results: list[tuple[str, bytes, bytes]], args: argparse.Namespace) -> None:
    from annot.rewriters.codegen import add_generated_header, generated_header

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
        header = generated_header(_options(args), os.path.normpath(path), data)
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
    from annot.rewriters.codegen import GENERATED_PREFIX

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


# ---- annot plan -------------------------------------------------------------

_PLAN_EPILOG = """\
FILE is imported as a module to build the model: its top-level code runs
(as with `python FILE`; its directory is put first on sys.path). The model
is CLASS() unless --init / --config-json say otherwise:

  --init 'GPT(GPTConfig(n_layer=8, bias=False))'   the model itself
  --init 'GPTConfig(n_layer=8)'                    GPT(GPTConfig(n_layer=8))
  --init GPTConfig --config-json cfg.json          GPT(GPTConfig(**cfg))
  --config-json '{"width": 64}'                    CLASS(width=64)

--init is read, not evaluated: only calls of classes and functions defined
at the top level of FILE, with literal arguments (numbers, strings, True,
False, None, tuples, lists, dicts) or such calls nested, are accepted.

--input NAME=DTYPE[D0,D1,...][:HIGH] makes one random sample input for
forward's argument NAME (repeat it per argument): floats are normal(0, 1),
ints are uniform in [0, HIGH) (default [0, 2)), bools random. A label may
name the range: idx=int64[8,256]:vocab=50304. DTYPE: float32, float16,
bfloat16, float64, int64, int32, int16, int8, uint8, bool. The sample is
one microbatch: its shape is what each stage is measured on. Without
--input the plan balances parameter bytes and nothing runs.

--tp T divides the parameters and FLOPs of @shard-ed layers by T
(approximate: FLOPs by their parameter share; activations and measured
times are not scaled).

Prints the table (or with --json the plan as JSON) and writes no file.
Exit status 2 on an error (a bad spec, a memory budget no split fits)."""


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="choose balanced pipeline stage boundaries for a model and print them",
        description=(
            "Split CLASS's forward into --pp balanced pipeline stages: the slowest stage as "
            "fast as possible, each within --memory. Prints the stages (first/last module, "
            "parameters, FLOPs, measured time, memory, bytes sent on) and the boundaries to "
            "give @stage(split=[...]) or annot rewrite --split."
        ),
        epilog=_PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="FILE:CLASS", help="the model file and its @stage class")
    p.add_argument("--pp", type=_degree, required=True, metavar="N", help="pipeline stages")
    p.add_argument(
        "--tp", type=_degree, default=1, metavar="T", help="tensor-parallel degree (default 1)"
    )
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=DTYPE[SHAPE][:HIGH]",
        help="a sample input for forward's argument NAME, e.g. idx=int64[8,256]:vocab=50304 "
        "(repeatable; see below)",
    )
    p.add_argument("--init", metavar="EXPR", help="how to build the model (see below)")
    p.add_argument(
        "--config-json",
        metavar="JSON",
        help="keyword arguments as a JSON object, inline or a file path (see below)",
    )
    p.add_argument("--memory", metavar="SIZE", help="memory budget per device, e.g. 16GiB")
    p.add_argument(
        "--fit",
        action="store_true",
        help="with --memory: the fewest stages, at most --pp, that fit (memory-fit mode)",
    )
    p.add_argument(
        "--cost",
        choices=("time", "flops", "params"),
        help="what to balance (default: time with --input, else params)",
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "adam", "sgd", "none"),
        default="adamw",
        help="optimizer state counted in memory (default adamw: 2 states per parameter)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    try:
        path, sep, name = args.target.rpartition(":")
        if not sep or not path or not name:
            raise Refusal(f"{args.target!r}: expected FILE:CLASS, e.g. model.py:GPT")
        if args.fit and args.memory is None:
            raise Refusal("--fit needs --memory (the budget the stages must fit)")
        memory = None
        if args.memory is not None:
            from annot.hints import parse_bytes

            memory = parse_bytes(args.memory, "--memory")
        module = import_target(path)
        cls = module
        for part in name.split("."):
            cls = getattr(cls, part, None)
        import torch.nn as nn

        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise Refusal(f"{path}: defines no nn.Module class {name!r}")
        import torch

        torch.manual_seed(0)
        try:
            model = build_model(module, cls, args.init, args.config_json)
        except (Refusal, AnnotError):
            raise
        except Exception as exc:
            how = (
                "; say how to build it with --init, e.g. --init 'Config(n_layer=8)' (an "
                "argument for the class) or --init NAME --config-json cfg.json"
                if args.init is None
                else ""
            )
            raise Refusal(f"building {name} raised {describe(exc)}{how}") from None
        if not isinstance(model, cls):
            raise Refusal(f"--init built a {type(model).__name__}, not a {name}")
        sample = parse_inputs(args.input, cls)
        from annot.hints import get_stage_spec

        nested = get_stage_spec(cls) is None and not os.path.isfile(path)
        if nested:  # a model you cannot edit: every nested block and block part
            return _run_module_plan(args, model, sample, memory)
        from annot.planner import fit_stages, plan_stages

        common = dict(
            sample=sample,
            cost=args.cost,
            optimizer=args.optimizer,
            source_path=module.__file__,
            progress=True,
            tp=args.tp,
        )
        try:
            if args.fit:
                plan = fit_stages(model, cls, memory=memory, max_stages=args.pp, **common)
            else:
                plan = plan_stages(model, cls, args.pp, memory=memory, **common)
        except PartitionError as exc:
            few = "segments between its split points" in str(exc)  # planner._check_count
            if not few or memory is not None or get_stage_spec(cls) is not None:
                raise
            # forward itself has too few places to cut: its blocks sit deeper
            return _run_module_plan(args, model, sample, memory)
        except AnnotError:
            raise
        except Exception as exc:
            raise Refusal(f"running {name} on the sample raised {describe(exc)}") from None
    except (Refusal, AnnotError, OSError) as exc:
        print(f"annot plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(plan.table())
    return 0


def _run_module_plan(args: argparse.Namespace, model, sample, memory) -> int:
    """``annot plan`` for a model whose blocks sit below its forward (or that
    you cannot edit): :mod:`annot.module_plan` over its blocks and block
    parts, in call order."""
    from annot.hf import sample_inputs
    from annot.module_plan import call_order, plan_module_boundaries
    from annot.runtime.stages import record_calls

    if memory is not None or args.cost == "flops" or args.tp != 1:
        print(
            f"annot plan: {type(model).__name__}: its stages are planned over its modules "
            "(annot.module_plan), which balances parameters or measured time (--cost params / "
            "time) at --tp 1 and does not take --memory, --fit or --cost flops yet",
            file=sys.stderr,
        )
        return 2
    cost = args.cost or ("time" if sample is not None else "params")
    probe = sample if sample is not None else sample_inputs(model)
    order = call_order(record_calls(model, probe)) if probe is not None else None
    plan = plan_module_boundaries(model, args.pp, sample=sample, cost=cost, order=order)
    if args.json:
        import json

        doc = {
            "boundaries": plan.boundaries,
            "stage_costs": plan.stage_costs,
            "cost": plan.cost,
            "imbalance": plan.imbalance,
            "units": [u.path for u in plan.units],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(plan.table())
        print(f"split={plan.boundaries!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
