"""``train_step.explain(...)``: what annot will do, as text a person can read.

Shows the mesh, the pipeline stages (owner rank, modules, values crossing to
the next stage, parameters held), which runner runs them, the tied weights,
the schedule as a table, and this rank's code for its stages.

Two runners cut a pipeline (:mod:`annot.runtime.runners.stage_runner`, chosen once
by the build, :func:`annot.plan.stage_points.choose_runner`, with its reason in
``model.report``, and recorded on the layout,
:class:`annot.runtime.pipeline.layout.PipelineLayout`): the *source split* (the
rewriter cut the root's ``forward`` into stage methods; each stage's modules
and outgoing values are known from the source) and the *replay* (the model's
own ``forward`` runs on every rank and the stages are cut at run time at
module calls, :mod:`annot.runtime.runners.replay`; each stage's modules are the ones
it was placed, and what crosses is the tensors live at the next boundary's
call, whose shapes are known once this rank has run the stage). Each has a
view here with the same three questions: modules, sends, code.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch.nn as nn

from annot.runtime.runners.placeholder import Absent

__all__ = []

_SENDS_SHOWN = 8  # replayed stages: tensors listed before "+N more"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _params_under(module: nn.Module, paths: set[str]) -> list[nn.Parameter]:
    """The parameters (each once) of the modules at ``paths`` under ``module``."""
    out: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if any(name == k or name.startswith(k + ".") for k in paths):
            out.setdefault(id(p), p)
    return list(out.values())


def _stage_memory(model, params: list[nn.Parameter], schedule: str, microbatches: int) -> str:
    """What a stage's parameters take on this rank while training with AdamW
    (weights, gradients, optimizer state; :mod:`annot.plan.memory_model`,
    the planner's arithmetic), e.g. ``1.2 MiB + 1.2 MiB + 2.4 MiB``."""
    from annot.plan.cost_table import format_bytes
    from annot.plan.memory_model import SCHEDULES, Training, param_bytes

    trainable = [p for p in params if p.requires_grad]
    setup = Training(
        precision="bf16-autocast" if model.autocast_dtype is not None else "fp32",
        schedule=schedule if schedule in SCHEDULES else "1f1b",
        microbatches=microbatches,
    )
    pb = param_bytes(sum(p.numel() for p in trainable), len(trainable), True, setup)
    frozen = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    parts = [pb.weights + frozen, pb.grads, pb.master + pb.optimizer]
    return " + ".join(format_bytes(b) for b in parts)


def _held_modules(layout, order: dict[str, int], s: int) -> str:
    """The outermost modules stage ``s`` holds that no other stage holds
    anything of, in ``order`` (module paths by registration), blocks in runs."""
    held = layout.stage_modules
    others = set().union(*(held[o] for o in held if o != s))

    def position(path: str) -> tuple[int, str]:
        while path not in order and path:
            path = path.rpartition(".")[0]  # a container's own parameter: at its module
        return order.get(path, len(order)), path

    return ", ".join(runs_of_blocks(sorted(held_units(held[s], others), key=position))) or "-"


class SourceSplitStages:
    """The stages of a root ``forward`` cut into stage methods by the rewriter
    (and, for boundaries in the forwards it calls, theirs: the nested split)."""

    runner = "source split"

    def __init__(self, layout, root: nn.Module):
        self.layout = layout
        self.stages = layout.split.stages
        self.nested = layout.split.forwards[1:]
        self.order = {p: i for i, p in enumerate(tree_paths(root))}
        self.how = (
            "the root forward cut into stage methods by the rewriter"
            + (f", and {', '.join(self.nested)} with it" if self.nested else "")
            + "; the code below is what runs"
        )

    def modules(self, s: int) -> str:
        if self.nested:  # what the root's stage reads is its callees' stages: their modules
            return _held_modules(self.layout, self.order, s)
        return ", ".join(self.stages[s].modules) or "-"

    def sends(self, s: int) -> str:
        outputs = self.stages[s].outputs
        return ", ".join(outputs) if outputs is not None else "(returns)"

    def code(self, s: int) -> str:
        code = self.stages[s].source.rstrip()
        if self.nested:
            code += (
                f"\n# (the stage methods of {', '.join(self.nested)} it calls: in the rewritten "
                "source above)"
            )
        return code


class ReplayStages:
    """The stages of a model cut at run time at module calls (:mod:`annot.runtime.runners.replay`)."""

    runner = "replay"
    how = (
        "the model's own forward runs on every rank, cut at run time where a boundary "
        "module is called; earlier stages are replayed on the meta device"
    )

    def __init__(self, layout, root: nn.Module, executor: Optional[Any]):
        self.layout = layout
        self.root = root
        self.executor = (
            executor  # annot.runtime.pipeline.executor.PipelineExecutor, once a step ran
        )
        self.order = {p: i for i, p in enumerate(tree_paths(root))}

    def modules(self, s: int) -> str:
        return _held_modules(self.layout, self.order, s)

    def sends(self, s: int) -> str:
        if s == self.layout.num_stages - 1:
            return "(returns)"
        where = f"tensors live at {self.layout.boundaries[s]}'s call"
        shapes = self.sent_shapes(s)
        if shapes is None:
            mine = s in self.layout.local_stage_ids
            return where + (" (shapes after the first step)" if mine else "")
        more = f", +{len(shapes) - _SENDS_SHOWN} more" if len(shapes) > _SENDS_SHOWN else ""
        return f"{where}: {', '.join(shapes[:_SENDS_SHOWN])}{more}"

    def sent_shapes(self, s: int) -> Optional[list[str]]:
        """What stage ``s`` sent in this rank's last forward, None where this
        rank does not run it or has not run a step yet."""
        stages = self.executor.stages if self.executor is not None else {}
        outputs = stages[s].fn.outputs if s in stages else None
        if outputs is None:
            return None
        return [
            f"{t.dtype}{list(t.shape)}".replace("torch.", "") for t in outputs["t"] if t is not None
        ]

    def code(self, s: int) -> str:
        b = self.layout.boundaries
        start = f"the call of {b[s - 1]}" if s > 0 else "the start"
        stop = f"the call of {b[s]}" if s < len(b) else "the end (the step body's loss too)"
        earlier = "stage 0" if s == 1 else f"stages 0-{s - 1}"
        replayed = f", replaying {earlier} on meta up to its start" if s > 0 else ""
        return f"{type(self.root).__name__}.forward runs unchanged from {start} to {stop}{replayed}"


def stage_view(layout, root: nn.Module, executor: Optional[Any]):
    """The view of ``layout``'s stages for the runner it recorded."""
    if layout.runner.name == "replay":
        return ReplayStages(layout, root, executor)
    return SourceSplitStages(layout, root)


def tree_paths(root: nn.Module, prefix: str = "") -> list[str]:
    """Every module path under ``root`` in registration order, looking through
    the placeholders of other stages' modules into their meta shadows."""
    out = [prefix]
    inner = root.shadow if isinstance(root, Absent) and root.shadow is not None else root
    for name, child in inner.named_children():
        out += tree_paths(child, f"{prefix}.{name}" if prefix else name)
    return out


def held_units(mine: set[str], others: set[str]) -> set[str]:
    """``mine`` (module paths and parameter names a stage holds) as the
    outermost modules no other stage holds anything of (``model.layers.0``
    for its every layer and norm); a path held by several stages as itself."""

    def others_in(a: str) -> bool:
        return any(o == a or o.startswith(a + ".") for o in others)

    out = set()
    for path in mine:
        parts = path.split(".")
        prefixes = (".".join(parts[:i]) for i in range(1, len(parts) + 1))
        out.add(next((a for a in prefixes if not others_in(a)), path))
    return out


_INDEXED = re.compile(r"^(?P<parent>.+)\.(?P<index>\d+)$")


def runs_of_blocks(paths: list[str]) -> list[str]:
    """Consecutive elements of one container as a slice: ``model.layers.0``,
    ``model.layers.1`` -> ``model.layers[0:2]`` (order kept)."""
    out: list[str] = []
    run: Optional[tuple[str, int, int]] = None  # parent, start, stop

    def flush() -> None:
        if run is not None:
            parent, a, b = run
            out.append(f"{parent}[{a}:{b}]" if b - a > 1 else f"{parent}.{a}")

    for path in paths:
        m = _INDEXED.match(path)
        if m and run is not None and run[0] == m["parent"] and run[2] == int(m["index"]):
            run = (run[0], run[1], run[2] + 1)
            continue
        flush()
        run = (m["parent"], int(m["index"]), int(m["index"]) + 1) if m else None
        if not m:
            out.append(path)
    flush()
    return out


def _header(step, args, kwargs) -> list[str]:
    ctx = step.model.ctx
    out = [
        f"annot plan: {ctx.mesh!r}, world size {ctx.world_size}, this rank {ctx.rank} "
        f"(dp {ctx.dp_rank}, pp {ctx.pp_rank}, tp {ctx.tp_rank}), device {ctx.device}"
    ]
    if ctx.mesh.cp > 1:
        cp, r = ctx.mesh.cp, ctx.cp_rank
        out.append(
            f"context parallel: cp={cp}, batch {ctx.batch_rank} of {ctx.mesh.batches} "
            f"(ranks {ctx.axis_ranks('cp')} read it); this rank holds chunks {r} and "
            f"{2 * cp - 1 - r} of {2 * cp} of each sequence (zig-zag), keys and values "
            "all-gathered per attention layer"
        )
    if args or kwargs:
        from annot.training.microbatch import split_microbatches

        mbs = split_microbatches(step.fn, args, kwargs, step.microbatches, step.non_split)
        shapes = [
            f"{type(v).__name__}{list(v.shape) if hasattr(v, 'shape') else ''}" for v in mbs[0][0]
        ]
        out.append(f"microbatches: {len(mbs)} of {', '.join(shapes) or '(no positional args)'}")
    return out


def _pipeline(step, view) -> list[str]:
    model, layout = step.model, step.model.pipeline

    def memory(held: list[nn.Parameter]) -> str:
        return _stage_memory(model, held, step.schedule, step.microbatches)

    rows = [
        [
            str(s),
            f"pp{layout.owner(s)}",
            view.modules(s),
            view.sends(s),
            *(
                [f"{sum(p.numel() for p in held):,}", memory(held)]
                if s in layout.local_stage_ids
                else ["-", "-"]
            ),
        ]
        for s in range(layout.num_stages)
        for held in [_params_under(model.module, layout.stage_modules.get(s, set()))]
    ]
    out = [
        f"pipeline: {layout.num_stages} stages, boundaries {list(layout.boundaries)}, "
        f"schedule {step.schedule}",
        f"runner: {view.runner} ({view.how})",
        *(
            [f"runner chosen at build: {model.report.runner_reason}"]
            if model.report is not None and model.report.runner_reason
            else []
        ),
        _table(
            rows,
            ["stage", "rank", "modules", "sends", "params (this rank)", "memory (this rank)"],
        ),
        "memory: weights + gradients + AdamW state of the stage's parameters (activations "
        "come on top: annot plan --seq-len ... estimates them)",
    ]
    if model.report is not None:
        out.extend(model.report.boundary_notes)
    if model.report is not None and model.report.plan_table:
        out.append("boundaries chosen by the planner:\n" + model.report.plan_table)
    for tie in layout.ties:
        out.append(
            f"tied weight {' = '.join(tie.names)} held by stages {list(tie.stages)}: "
            "gradients summed over them"
        )
    from annot.runtime.pipeline.schedule_table import format_table
    from annot.runtime.pipeline.schedules import get_schedule

    out.append("schedule (rows = pipeline ranks):")
    out.append(
        format_table(get_schedule(step.schedule, layout.pp, step.microbatches, layout.chunks))
    )
    return out


def _rewritten(report) -> list[str]:
    return [
        f"rewritten source of {rec.source_path} -> {rec.cache_path} "
        f"({'cache hit' if rec.hit else 'rewritten'} in {rec.seconds * 1000:.0f} ms)"
        for rec in (report.rewritten if report is not None else [])
    ]


def _inferred(report) -> list[str]:
    """The tp hints read off the sources (nothing was hinted), and what stayed whole."""
    found = report.inferred if report is not None else None
    if found is None:
        return []
    out = ["tp hints read off the sources (nothing hinted; `annot hints` prints them):"]
    out += [f"  {k!r}: {v!r}" for k, v in found.hints.items()]
    if found.checked:
        out.append(f"  checked against the whole module on the first call: {found.checked}")
    out += [f"  {note}" for note in found.notes]
    return out


def _experts(model) -> list[str]:
    """Which experts this rank holds (``Experts()`` at ep > 1), and what crosses."""
    ctx, report = model.ctx, model.report
    if report is None or not report.experts or ctx.mesh.ep == 1:
        return []
    ep, rank = ctx.mesh.ep, ctx.ep_rank
    out = [
        f"experts over ep={ep} (expert group: ranks {ctx.axis_ranks('ep')}, this rank's place "
        f"{rank}; the same experts on ranks {ctx.axis_ranks('edp')}):"
    ]
    modules = dict(model.module.named_modules())
    for path in report.experts:
        m = modules.get(path)
        if m is None:
            continue  # on another pipeline stage
        total = m.annot_experts
        per = total // ep
        sent = m.__dict__.get("annot_sent_bytes")
        last = "" if sent is None else f"; its last call sent {sent / 1024:.1f} KiB forward"
        out.append(
            f"  {path}: experts {rank * per}-{(rank + 1) * per - 1} of {total} held here{last}"
        )
    out.append(
        "  per call: each (token, choice) pair to its expert's rank and its result back by "
        "all-to-all (forward), as many bytes again in backward; pairs whose expert is here stay"
    )
    return out


def explain_step(step, args, kwargs) -> str:
    model = step.model
    layout = model.pipeline
    out = _header(step, args, kwargs) + _inferred(model.report) + _experts(model)
    if layout is None or layout.num_stages == 1:
        return "\n".join([*out, "pipeline: none (pp=1)", *_rewritten(model.report)])
    view = stage_view(layout, model.module, step.executor)
    out += _pipeline(step, view)
    out += _rewritten(model.report)
    out += [f"--- stage {s} (this rank) ---\n{view.code(s)}" for s in layout.local_stage_ids]
    return "\n".join(out)
