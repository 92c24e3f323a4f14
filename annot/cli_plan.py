"""``annot plan``: balanced pipeline stage boundaries for a model, printed
as a table (or JSON) to give ``@stage(split=[...])`` or ``annot rewrite
--split``.

    annot plan model.py:GPT --pp 4 --input idx=int64[8,256]:vocab=50304 \
        --init 'GPTConfig(n_layer=8)'

A ``@stage`` class, or a forward with its blocks at the top, is planned by
:mod:`annot.planner`; a model whose blocks sit deeper (or that you cannot
edit) by :mod:`annot.module_plan`, over its nested blocks and block parts.
"""

from __future__ import annotations

import argparse
import os
import sys

from annot.cli_inputs import Refusal, build_model, degree, describe, import_target, parse_inputs
from annot.errors import AnnotError, PartitionError

__all__ = ["add_plan"]

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


def add_plan(sub) -> None:
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
    p.add_argument("--pp", type=degree, required=True, metavar="N", help="pipeline stages")
    p.add_argument(
        "--tp", type=degree, default=1, metavar="T", help="tensor-parallel degree (default 1)"
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
            if not few or get_stage_spec(cls) is not None:
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
    from annot.stage_choice import stranded_calls

    cost = args.cost or ("time" if sample is not None else "params")
    probe = sample if sample is not None else sample_inputs(model)
    order = call_order(record_calls(model, probe)) if probe is not None else None
    stranded = stranded_calls(model, probe) if probe is not None else None
    plan = plan_module_boundaries(
        model,
        args.pp,
        sample=sample,
        cost=cost,
        order=order,
        memory=memory,
        fit=args.fit,
        optimizer=args.optimizer,
        tp=args.tp,
        stranded=stranded,
    )
    if args.json:
        import json

        doc = {
            "boundaries": plan.boundaries,
            "stage_costs": plan.stage_costs,
            "cost": plan.cost,
            "imbalance": plan.imbalance,
            "stage_memory": plan.stage_memory,
            "units": [u.path for u in plan.units],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(plan.table())
        print(f"split={plan.boundaries!r}")
    return 0
