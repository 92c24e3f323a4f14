"""``annot plan``: balanced pipeline stage boundaries for a model, printed
as a table (or JSON) to give ``@stage(split=[...])`` or ``annot rewrite
--split``.

    annot plan model.py:GPT --pp 4 --input idx=int64[8,256]:vocab=50304 \
        --init 'GPTConfig(n_layer=8)'

A ``@stage`` class, or a forward with its blocks at the top, is planned by
:mod:`annot.plan.planner`; a model whose blocks sit deeper (or that you cannot
edit) over its nested blocks and block parts (:mod:`annot.plan.module_units`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from annot.cli.inputs import Refusal, build_model, degree, describe, import_target, parse_inputs
from annot.core.errors import AnnotError
from annot.plan.memory_model import PRECISIONS, SCHEDULES
from annot.plan.planner import DEFAULT_SEQ_LEN

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
    _model_arguments(p)
    _plan_arguments(p)
    _training_arguments(p)
    p.set_defaults(run=_run_plan)


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """The model and the sample it is measured on."""
    p.add_argument("target", metavar="FILE:CLASS", help="the model file and its @stage class")
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
    p.add_argument(
        "--seq-len",
        type=degree,
        metavar="L",
        help="tokens per sequence of the sample a transformers model is measured on "
        f"(default {DEFAULT_SEQ_LEN}; --input gives the shape itself)",
    )
    p.add_argument(
        "--microbatch-size",
        type=degree,
        metavar="B",
        help="sequences per microbatch of that sample (default 1)",
    )


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    """The mesh, the budget, what is balanced, the output."""
    p.add_argument("--pp", type=degree, metavar="N", help="pipeline stages")
    p.add_argument(
        "--world-size",
        type=degree,
        metavar="N",
        help="instead of --pp: a what-if table of every pp x tp x dp of N devices (with --memory)",
    )
    p.add_argument(
        "--tp", type=degree, default=1, metavar="T", help="tensor-parallel degree (default 1)"
    )
    p.add_argument(
        "--dp", type=degree, default=1, metavar="D", help="data-parallel degree (default 1)"
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
        help="what to balance (default: flops with --input, else params)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _training_arguments(p: argparse.ArgumentParser) -> None:
    """How the model trains: what memory each stage holds."""
    p.add_argument(
        "--optimizer",
        choices=("adamw", "adam", "sgd", "none"),
        default="adamw",
        help="optimizer state counted in memory (default adamw: 2 states per parameter)",
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32; bf16-autocast (annot's precision='bf16': float32 weights, bf16 "
        "activations); bf16 (bf16 weights and gradients with float32 master copies) "
        "(default fp32)",
    )
    p.add_argument(
        "--microbatches",
        type=degree,
        default=8,
        metavar="M",
        help="microbatches per step: activations in flight and the bubble (default 8)",
    )
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="1f1b",
        help="pipeline schedule: how many microbatches each stage holds (default 1f1b)",
    )
    p.add_argument(
        "--recompute",
        "--checkpoint",  # its old name
        dest="recompute",
        action="store_true",
        help="activation recompute of every block (default off)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="optimizer state (and without a pipeline weights and gradients) sharded over "
        "dp (default off)",
    )


def _training(args: argparse.Namespace):
    from annot.plan.memory_model import Training

    return Training(
        optimizer=args.optimizer,
        precision=args.precision,
        microbatches=args.microbatches,
        schedule=args.schedule,
        recompute=args.recompute,
        fsdp=args.fsdp,
    )


def _settings(args: argparse.Namespace, sample: Optional[dict], made: bool) -> str:
    """The line that says what the memory figures assume (every default shown)."""
    if sample is None:
        shape = "no sample: no activations (give --input)"
    elif made:
        shape = f"microbatch {args.microbatch_size or 1} x {args.seq_len or DEFAULT_SEQ_LEN} tokens"
    else:
        shape = "microbatch " + ", ".join(
            f"{k}={list(v.shape)}" for k, v in sample.items() if hasattr(v, "shape")
        )
    return (
        f"assuming: {shape}; {args.microbatches} microbatches, schedule {args.schedule}, "
        f"precision {args.precision}, optimizer {args.optimizer}, activation recompute "
        f"{'on' if args.recompute else 'off'}, fsdp {'on' if args.fsdp else 'off'}"
        + (f" (dp={args.dp})" if args.fsdp and args.world_size is None else "")
    )


def _to(device: str, sample):
    import torch

    return torch.utils._pytree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, sample
    )


def _run_plan(args: argparse.Namespace) -> int:
    try:
        path, name = _check_arguments(args)
        setup = _training(args)
        memory = None
        if args.memory is not None:
            from annot.core.hints import parse_bytes

            memory = parse_bytes(args.memory, "--memory")
        module = import_target(path)
        cls = _model_class(module, path, name)
        from annot.plan.planner import assumed_sample
        from annot.plan.unit_source import default_cost, plans_over_modules

        nested = plans_over_modules(cls)  # the units parallelize would plan over
        cost = args.cost or default_cost(args.input or None, nested)
        # from shapes alone: no weight is allocated, except that the @stage
        # planner times its segments on the model built for real; the nested
        # planner times one unit at a time, each materialized alone
        device = "cpu" if cost == "time" and not nested and args.world_size is None else "meta"
        model = _build(args, module, cls, name, device)
        sample, made = assumed_sample(
            model,
            parse_inputs(args.input, cls),
            seq_len=args.seq_len,
            microbatch_size=args.microbatch_size,
        )
        if sample is not None and device == "meta":
            sample = _to("meta", sample)
        if nested or args.world_size is not None:
            # a model you cannot edit (every nested block and block part), or the what-if table
            return _run_module_plan(args, model, sample, memory, cost, setup, made)
        plan = _plan_segments(args, model, module, cls, name, sample, made, cost, memory, setup)
    except (Refusal, AnnotError, OSError) as exc:
        print(f"annot plan: {exc}", file=sys.stderr)
        return 2
    runner = _runner(model, cls, None if made else sample, plan.boundaries)
    if args.json:
        import json

        doc = plan.to_json()
        doc["runner"] = {"name": runner.name, "reason": runner.reason}
        print(json.dumps(doc, indent=2))
    else:
        print(_settings(args, None if made else sample, False))
        print(plan.table())
        print(f"runner: {runner.name} ({runner.reason})")
    return 0


def _check_arguments(args: argparse.Namespace) -> tuple[str, str]:
    """``(FILE, CLASS)`` of the target, once the options agree with each other."""
    path, sep, name = args.target.rpartition(":")
    if not sep or not path or not name:
        raise Refusal(f"{args.target!r}: expected FILE:CLASS, e.g. model.py:GPT")
    if (args.pp is None) == (args.world_size is None):
        raise Refusal(
            "give --pp N (a plan for N pipeline stages) or --world-size N with --memory "
            "(the table of every pp x tp x dp of N devices), not both"
        )
    if args.world_size is not None and args.memory is None:
        raise Refusal("--world-size needs --memory (the bytes of each device)")
    if args.fit and args.memory is None:
        raise Refusal("--fit needs --memory (the budget the stages must fit)")
    if args.input and (args.seq_len or args.microbatch_size):
        raise Refusal("--input gives the sample's shape; leave out --seq-len / --microbatch-size")
    return path, name


def _model_class(module, path: str, name: str) -> type:
    import torch.nn as nn

    cls = module
    for part in name.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise Refusal(f"{path}: defines no nn.Module class {name!r}")
    return cls


def _build(args: argparse.Namespace, module, cls: type, name: str, device: str):
    """The model, built on ``device`` as ``--init`` / ``--config-json`` say;
    the user's constructor raising is refused, naming it."""
    import torch

    torch.manual_seed(0)
    try:
        with torch.device(device):
            model = build_model(module, cls, args.init, args.config_json)
    except (Refusal, AnnotError):
        raise
    except Exception as exc:  # noqa: BLE001 - the user's constructor: refused, named
        how = (
            "; say how to build it with --init, e.g. --init 'Config(n_layer=8)' (an "
            "argument for the class) or --init NAME --config-json cfg.json"
            if args.init is None
            else ""
        )
        raise Refusal(f"building {name} raised {describe(exc)}{how}") from None
    if not isinstance(model, cls):
        raise Refusal(f"--init built a {type(model).__name__}, not a {name}")
    return model


def _plan_segments(args, model, module, cls, name, sample, made, cost, memory, setup):
    """The plan over the segments of an ``@stage(auto=True)`` class's forward."""
    from annot.plan import planner
    from annot.plan.segment_plan import SourceSegments

    units = SourceSegments(cls, source_path=module.__file__, progress=True)
    try:
        return planner.plan(
            model,
            args.pp,
            units=units,
            sample=None if made else sample,
            cost=cost,
            memory=memory,
            fit=args.fit,
            tp=args.tp,
            setup=setup,
            optimizer=args.optimizer,
        )
    except AnnotError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's forward: refused, named
        raise Refusal(f"running {name} on the sample raised {describe(exc)}") from None


def _runner(model, cls: type, sample, boundaries):
    """The runner ``parallelize`` chooses for this plan
    (:func:`annot.plan.stage_points.choose_runner`)."""
    from annot.plan.stage_points import StagePoints, choose_runner

    return choose_runner(StagePoints(model, cls, sample), tuple(boundaries))


def _run_module_plan(args: argparse.Namespace, model, sample, memory, cost, setup, made) -> int:
    """``annot plan`` for a model whose blocks sit below its forward (or that
    you cannot edit): :mod:`annot.plan.module_units` over its blocks and block
    parts, in call order; with ``--world-size`` the what-if table
    (:mod:`annot.plan.what_if`)."""
    from annot.plan import planner
    from annot.plan.module_units import ModuleUnits, measure_units
    from annot.plan.stage_points import StagePoints
    from annot.plan.units import call_order
    from annot.plan.what_if import Progress, format_what_if, what_if
    from annot.runtime.runners.stage_modules import record_calls

    progress = Progress()
    probe = sample if sample is not None else None
    if probe is None:
        from annot.hf.models import sample_inputs

        probe = sample_inputs(model)
        if probe is not None and next(model.parameters()).is_meta:
            probe = _to("meta", probe)
    progress.note("recording the order of module calls (one meta forward)")
    order = call_order(record_calls(model, probe)) if probe is not None else None
    stranded = StagePoints(model, type(model), probe).stranded if probe is not None else None
    progress.note("measuring every unit: FLOPs and bytes saved for backward")
    measures = measure_units(
        model,
        sample=sample,
        cost=cost,
        order=order,
        stranded=stranded,
        setup=setup,
        min_units=1 if args.fit or args.pp is None else args.pp,
        progress=progress,
    )
    settings = _settings(args, sample, made)
    if not args.json:
        print(settings)
    if args.world_size is not None:
        choices = what_if(measures, args.world_size, memory, progress)
        if args.json:
            import json

            doc: dict[str, Any] = {
                "assuming": settings,
                "choices": [
                    {
                        "pp": c.pp,
                        "tp": c.tp,
                        "dp": c.dp,
                        "fits": c.fits,
                        "slowest": c.slowest if c.plan is not None else None,
                        "bubble": c.bubble,
                        "stage_memory": c.plan.stage_memory if c.plan is not None else None,
                        "boundaries": c.plan.boundaries if c.plan is not None else None,
                        "refusal": c.refusal,
                    }
                    for c in choices
                ],
            }
            print(json.dumps(doc, indent=2))
        else:
            print(format_what_if(choices, args.world_size, memory, cost))
        return 0
    progress.note(f"partitioning {len(measures.fine)} units into {args.pp} stages")
    units = ModuleUnits(measures=measures)
    plan = planner.plan(
        model, args.pp, units=units, tp=args.tp, dp=args.dp, memory=memory, fit=args.fit
    )
    runner = _runner(model, type(model), probe, plan.boundaries)
    if args.json:
        import json

        doc = plan.to_json()
        doc["assuming"] = settings
        doc["runner"] = {"name": runner.name, "reason": runner.reason}
        print(json.dumps(doc, indent=2))
    else:
        print(plan.table())
        print(f"runner: {runner.name} ({runner.reason})")
        print(f"split={list(plan.boundaries)!r}")
    return 0
