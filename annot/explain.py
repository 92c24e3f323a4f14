"""``train_step.explain(...)``: what annot will do, as text a person can read.

Shows the mesh, the pipeline stages (owner rank, modules, values crossing to
the next stage, parameters held), the schedule as a table, and this rank's
rewritten source (the stage methods, and where the full rewritten file is).
"""

from __future__ import annotations

__all__ = []


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _params_under(module, paths: set[str]) -> int:
    total = 0
    seen = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        if any(name == k or name.startswith(k + ".") for k in paths):
            seen.add(id(p))
            total += p.numel()
    return total


def explain_step(step, args, kwargs) -> str:
    model = step.model
    ctx = model.ctx
    report = model.report
    out = [
        f"annot plan: {ctx.mesh!r}, world size {ctx.world_size}, this rank {ctx.rank} "
        f"(dp {ctx.dp_rank}, pp {ctx.pp_rank}, tp {ctx.tp_rank}), device {ctx.device}"
    ]
    if args or kwargs:
        from annot.microbatch import split_microbatches

        mbs = split_microbatches(step.fn, args, kwargs, step.microbatches, step.non_split)
        shapes = [
            f"{type(v).__name__}{list(v.shape) if hasattr(v, 'shape') else ''}" for v in mbs[0][0]
        ]
        out.append(f"microbatches: {len(mbs)} of {', '.join(shapes) or '(no positional args)'}")
    plan = model.pipeline
    if plan is None or plan.num_stages == 1:
        out.append("pipeline: none (pp=1)")
    else:
        rows = []
        for st in plan.split.stages:
            held = plan.stage_modules.get(st.index, set())
            rows.append(
                [
                    str(st.index),
                    f"pp{plan.owner(st.index)}",
                    ", ".join(st.modules) or "-",
                    ", ".join(st.outputs) if st.outputs is not None else "(returns)",
                    f"{_params_under(model.module, held):,}"
                    if st.index in plan.local_stage_ids
                    else "-",
                ]
            )
        out.append(
            f"pipeline: {plan.num_stages} stages, boundaries {list(plan.boundaries)}, "
            f"schedule {step.schedule}"
        )
        out.append(_table(rows, ["stage", "rank", "modules", "sends", "params (this rank)"]))
        if report is not None and report.plan_table:
            out.append("boundaries chosen by the planner:\n" + report.plan_table)
        for tie in plan.ties:
            out.append(
                f"tied weight {' = '.join(tie.names)} held by stages {list(tie.stages)}: "
                "gradients summed over them"
            )
        from annot.runtime.schedule_table import format_table
        from annot.runtime.schedules import get_schedule

        out.append("schedule (rows = pipeline ranks):")
        out.append(
            format_table(get_schedule(step.schedule, plan.pp, step.microbatches, plan.chunks))
        )
    for rec in report.compiled if report is not None else []:
        out.append(
            f"rewritten source of {rec.source_path} -> {rec.cache_path} "
            f"({'cache hit' if rec.hit else 'compiled'} in {rec.seconds * 1000:.0f} ms)"
        )
    if plan is not None and plan.num_stages > 1:
        for s in plan.local_stage_ids:
            out.append(f"--- stage {s} (this rank) ---\n{plan.split.stages[s].source.rstrip()}")
    return "\n".join(out)
