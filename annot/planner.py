"""Automatic pipeline partitioning of a model's ``forward``: where to cut.

:func:`plan_stages` answers "at which module paths should ``GPT.forward`` be
split into ``n`` stages so that the slowest stage is as fast as possible and
every stage fits in memory?" in four steps:

1. **Split points.** :func:`split_points` lists every place
   :func:`annot.rewriters.stage_split.split_stages` can begin a stage: before each
   top-level statement of forward that calls a ``self.<submodule>`` (named by
   that submodule, e.g. ``"ln_f"``), and before each iteration of a top-level
   loop over an ``nn.ModuleList`` / ``nn.Sequential`` (``"h.0"`` .. ``"h.7"``).
   They are read from the class's source by the same rules ``split_stages``
   resolves a boundary with (a path names its *first* use in forward; uses
   nested in a branch, ``with`` or loop body cannot begin a stage), then
   checked by splitting at all of them at once.
2. **Segments.** Splitting at every split point gives one stage method per
   segment. The rewritten class is compiled from that source in a copy of the
   model module's namespace and bound to a shallow copy of the built model, so
   each segment runs the model's *real* code on its real weights.
3. **Costs.** With a sample input, :func:`annot.runtime.cost.profile_segments` runs
   the segments in turn (forward + backward): time, FLOPs, activation bytes,
   bytes crossing to the next segment. Parameter, gradient and optimizer-state
   bytes are counted from the segments' modules; a parameter several segments
   use (an embedding tied to the LM head) becomes a shared group, charged once
   per stage that holds it. Without a sample only parameters are counted.
   A segment's time is its fastest of ``rounds`` passes over all segments
   (a busy machine preempts some runs; the fastest is closest to the cost).
   Segments timed on their own run with their weights in cache, so on a CPU
   a stage holding a large layer (an LM head) can run somewhat slower whole
   than its segments add up to: :func:`measure_split` times the stages of a
   given split whole, to check a plan or compare it with a hand split.
4. **Partition.** :func:`annot.runtime.partition.partition` (exact min-bottleneck,
   per-device ``memory`` budget), or :func:`annot.runtime.partition.fit` for the
   fewest stages that fit (:func:`fit_stages`, RaNNC's memory-fit mode).

A single segment costlier than a whole mean stage (total / ``n_stages``)
bounds the balance from below; the plan then carries a warning naming it.
The planner does not recurse into that module's own forward: cut it by hand
(split its forward into more top-level statements, or turn its internals into
a module list) or use fewer stages.

``tp`` (tensor-parallel degree) divides the parameter figures of layers a
``@shard`` spec splits (all but ``Replicate``; a ``Row`` layer's bias stays
whole) by ``tp``, and each segment's FLOPs by the same share: an
approximation, as the activations and measured times are not scaled.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import inspect
import linecache
import math
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import libcst as cst
import torch
import torch.nn as nn

from annot.errors import PartitionError, RewriteError
from annot.files import atomic_write
from annot.rewriters.stage_split import Use, Uses, place_boundary
from annot.runtime.cost import format_bytes, format_count, format_seconds

__all__ = ["StagePlanResult", "fit_stages", "measure_split", "plan_stages", "split_points"]

_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}  # optimizer states per element
_COSTS = ("time", "flops", "params")
_COST_WORDS = {
    "time": "measured time (forward + backward of one sample microbatch)",
    "flops": "FLOPs (forward + backward of one sample microbatch)",
    "params": "parameter bytes",
}


# ---- step 1: split points, from the source --------------------------------------------


def _resolve(uses: Sequence[Use], path: str) -> Optional[tuple[int, int]]:
    """Where split_stages begins a stage for boundary ``path``: (item, element),
    or None where it would refuse it (stage_split's own rule, and a loop with a
    ``break`` is never split)."""
    found = place_boundary(uses, path)
    if found is None or found.problem or (found.element and found.use.breaks):
        return None
    return found.use.item, found.element


def _find_class(module: cst.Module, qualname: str) -> cst.ClassDef:
    body: Sequence[cst.CSTNode] = module.body
    found: Optional[cst.ClassDef] = None
    for part in qualname.split("."):
        found = next(
            (s for s in body if isinstance(s, cst.ClassDef) and s.name.value == part), None
        )
        if found is None:
            raise PartitionError(f"class {qualname} is not defined at the top of its source file")
        body = found.body.body
    assert found is not None
    return found


def _forward_items(cls_node: cst.ClassDef) -> tuple[str, list[cst.BaseStatement]]:
    fwd = next(
        (
            s
            for s in cls_node.body.body
            if isinstance(s, cst.FunctionDef) and s.name.value == "forward"
        ),
        None,
    )
    if fwd is None:
        raise PartitionError(
            f"class {cls_node.name.value} has no forward in its body; plan the class whose "
            "forward is split (a forward inherited from a base class is not rewritten)"
        )
    positional = [*fwd.params.posonly_params, *fwd.params.params]
    if not positional:
        raise PartitionError("forward takes no `self` parameter; annot splits methods")
    body = fwd.body
    stmts = (
        [cst.SimpleStatementLine(body=body.body)]
        if isinstance(body, cst.SimpleStatementSuite)
        else list(body.body)
    )
    if (
        stmts
        and isinstance(stmts[0], cst.SimpleStatementLine)
        and len(stmts[0].body) == 1
        and isinstance(stmts[0].body[0], cst.Expr)
        and isinstance(stmts[0].body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    ):
        stmts = stmts[1:]  # the docstring
    return positional[0].name.value, stmts


def _module_at(model: nn.Module, path: str) -> Any:
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _proposals(source: str, qualname: str, model: nn.Module) -> list[tuple[str, tuple, tuple]]:
    """(path, (item, element), group) for every split point, in forward order."""
    module = cst.parse_module(source)
    self_name, items = _forward_items(_find_class(module, qualname))
    uses: list[Use] = []
    for i, stmt in enumerate(items):
        finder = Uses(self_name, i, qnames={})
        stmt.visit(finder)
        uses += finder.uses
    out: dict[tuple[int, int], tuple[str, tuple]] = {}
    for i in range(len(items)):
        mine = [u for u in uses if u.item == i and u.context is None]
        for u in mine:  # a stage beginning before statement i
            path = {"call": u.path, "loop": f"{u.path}.0", "loop-other": u.path}[u.kind]
            if i > 0 and _resolve(uses, path) == (i, 0):
                out.setdefault((i, 0), (path, ("statement", i)))
                break
        for u in mine:  # a stage beginning at iteration k of a loop over a module list
            seq = _module_at(model, u.path) if u.kind == "loop" else None
            if not isinstance(seq, (nn.ModuleList, nn.Sequential)):
                continue
            for k in range(1, len(seq)):
                path = f"{u.path}.{k}"
                if _resolve(uses, path) == (i, k):
                    out.setdefault((i, k), (path, ("loop", i, u.path)))
    return [(p, pos, g) for pos, (p, g) in sorted(out.items())]


def _split(source: str, qualname: str, paths: Sequence[str], path: str):
    return _split_cached(source, qualname, tuple(paths), path)


@functools.lru_cache(maxsize=16)
def _split_cached(source: str, qualname: str, paths: tuple[str, ...], path: str):
    """split_stages, remembered: planning the same class again (another stage
    count, a memory-fit run) does not parse it again. StageSplit is immutable."""
    from annot.rewriters.stage_split import split_stages

    return split_stages(source, qualname, list(paths), path=path)


def split_points(
    source: str, class_name: str, model: nn.Module, *, path: str = "<string>"
) -> list[str]:
    """Every module path where ``split_stages`` can begin a stage of
    ``class_name``'s forward, in forward order (``model`` gives the lengths
    of the module lists forward loops over). Points it would refuse (a loop
    with a ``break``, a loop variable read after the loop, a ``return`` before
    the point, ...) are left out. Raises :class:`PartitionError` when forward
    has ``annot.boundary()`` markers: those fix the stages by hand."""
    return _points_and_split(source, class_name, model, path)[0]


def _no_markers(class_name: str, split: Any) -> None:
    markers = [b for b in split.boundaries if b.startswith("boundary()@")]
    if markers:
        raise PartitionError(
            f"{class_name}.forward has annot.boundary() markers ({', '.join(markers)}): they "
            "place the stages by hand, so there is nothing to plan; remove them to let annot "
            "choose the boundaries"
        )


def _points_and_split(source: str, qualname: str, model: nn.Module, path: str):
    """The split points and the split of forward at all of them."""
    props = _proposals(source, qualname, model)
    try:
        split = _split(source, qualname, [p for p, _, _ in props], path)
        _no_markers(qualname, split)
        return [p for p, _, _ in props], split
    except RewriteError:
        _no_markers(qualname, _split(source, qualname, [], path))
    ok: dict[tuple, bool] = {}  # one check per statement / per split loop
    kept = []
    for p, _, group in props:
        if group not in ok:
            try:
                _split(source, qualname, [p], path)
                ok[group] = True
            except RewriteError:
                ok[group] = False
        if ok[group]:
            kept.append(p)
    try:
        return kept, _split(source, qualname, kept, path)
    except RewriteError as exc:
        raise PartitionError(
            f"cannot split {qualname}.forward at all of its split points {kept}: {exc}"
        ) from None


# ---- step 2: segments, from the rewritten class ------------------------------------------


class _Holder(nn.Module):
    """The parameters and buffers a segment reads directly from the root model
    (``self.pos_emb``), registered as the same objects."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            key = name.replace(".", "_")
            if isinstance(t, nn.Parameter):
                self.register_parameter(key, t)
            else:
                self.register_buffer(key, t)


def _stage_modules(model: nn.Module, paths: Sequence[str]) -> tuple[nn.Module, ...]:
    """The modules (and direct tensors) behind a stage's ``self`` paths:
    ``"h[2:4]"`` -> blocks 2 and 3; methods and plain attributes are skipped."""
    mods: dict[int, nn.Module] = {}
    loose: dict[str, torch.Tensor] = {}
    for p in paths:
        base, _, sl = p.partition("[")
        obj = _module_at(model, base)
        if sl:
            lo, hi = sl.rstrip("]").split(":")
            if not isinstance(obj, (nn.ModuleList, nn.Sequential)):
                continue
            for m in list(obj)[int(lo or 0) : int(hi) if hi else None]:
                mods.setdefault(id(m), m)
        elif isinstance(obj, nn.Module):
            mods.setdefault(id(obj), obj)
        elif isinstance(obj, torch.Tensor):
            loose[p] = obj
    out = list(mods.values())
    if loose:
        out.append(_Holder(loose))
    return tuple(out)


def _compile_class(text: str, qualname: str, cls: type, label: str) -> type:
    """The class ``qualname`` of the rewritten ``text``, executed in a copy of
    ``cls``'s module namespace (the module's other code does not run again)."""
    import sys

    tree = ast.parse(text)
    body: list[ast.stmt] = tree.body
    node: Optional[ast.ClassDef] = None
    for part in qualname.split("."):
        node = next((s for s in body if isinstance(s, ast.ClassDef) and s.name == part), None)
        if node is None:
            raise PartitionError(f"class {qualname} is missing from the rewritten source")
        body = node.body
    assert node is not None
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    filename = f"<annot plan {label} {digest}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    original = sys.modules.get(cls.__module__)
    ns: dict[str, Any] = dict(vars(original)) if original is not None else {}
    ns["__builtins__"] = __builtins__
    code = compile(ast.Module(body=[node], type_ignores=[]), filename, "exec")
    exec(code, ns)
    return ns[node.name]


def _stage_fn(stage, first: bool, kwargs: bool):
    """A segment callable in annot.runtime.cost's convention: the first one takes the
    sample (spread when a tuple), each next one the dict the stage before returned.
    ``__wrapped__`` is the stage method, so the profile cache keys on its code."""
    if first and not kwargs:

        def run(*args):
            return stage(*args)
    else:

        def run(state):
            return stage(**state)

    run.__wrapped__ = stage
    return run


# ---- step 3: costs -----------------------------------------------------------------------


def _sharded_ids(model: nn.Module) -> set[int]:
    """ids of the parameters a ``@shard`` spec splits (approximately: a Row
    layer's bias and Replicate entries stay whole)."""
    from annot.hints import get_shard_spec
    from annot.specs import Replicate, Row

    out: set[int] = set()
    for m in model.modules():
        spec = get_shard_spec(type(m))
        if spec is None:
            continue
        for name, s in spec.specs.items():
            if isinstance(s, Replicate):
                continue
            target = getattr(m, name, None)
            if isinstance(target, nn.Parameter):
                out.add(id(target))
            elif isinstance(target, nn.Module):
                for pname, p in target.named_parameters(recurse=False):
                    if not (isinstance(s, Row) and pname == "bias"):
                        out.add(id(p))
    return out


def _costs(
    model: nn.Module,
    names: Sequence[str],
    modules: Sequence[Sequence[nn.Module]],
    measured: Optional[Sequence[Any]],
    *,
    optimizer: str,
    cost: str,
    tp: int,
):
    """One SegmentCost per segment: parameter-side bytes counted here (shared
    parameters keyed by their name in the model), the rest from ``measured``."""
    from annot.runtime.cost import SegmentCost

    qual = {id(p): n for n, p in model.named_parameters()}
    sharded = _sharded_ids(model) if tp > 1 else set()
    owned: list[dict[int, nn.Parameter]] = []
    for mods in modules:
        ps: dict[int, nn.Parameter] = {}
        for m in mods:
            for p in m.parameters():
                ps.setdefault(id(p), p)
        owned.append(ps)
    users: dict[int, int] = {}
    for ps in owned:
        for pid in ps:
            users[pid] = users.get(pid, 0) + 1
    states = _STATES[optimizer]
    out = []
    for j, ps in enumerate(owned):
        p_bytes = g_bytes = s_bytes = n_params = n_sharded = 0
        shared: dict[str, int] = {}
        shared_numel: dict[str, int] = {}
        for pid, p in ps.items():
            div = tp if pid in sharded else 1
            numel = math.ceil(p.numel() / div)
            pb = numel * p.element_size()
            gb = pb if p.requires_grad else 0
            sb = states * pb if p.requires_grad else 0
            p_bytes, g_bytes, s_bytes = p_bytes + pb, g_bytes + gb, s_bytes + sb
            n_params += numel
            n_sharded += p.numel() if div > 1 else 0
            if users[pid] > 1:
                key = qual.get(pid, f"{names[j]}:{pid}")
                shared[key] = pb + gb + sb
                shared_numel[key] = numel
        total = sum(p.numel() for p in ps.values())
        # the FLOPs of the sharded layers shrink by tp: approximated by their share of parameters
        scale = 1.0 - (n_sharded / total) * (1 - 1 / tp) if total and tp > 1 else 1.0
        buffers = {id(b): b.numel() * b.element_size() for m in modules[j] for b in m.buffers()}
        meas = measured[j] if measured is not None else None
        c = SegmentCost(
            name=names[j],
            params=p_bytes,
            n_params=n_params,
            grads=g_bytes,
            optimizer=s_bytes,
            buffers=sum(buffers.values()),
            activations=meas.activations if meas else 0,
            flops=int(meas.flops * scale) if meas else 0,
            forward_flops=int(meas.forward_flops * scale) if meas else 0,
            time=meas.time if meas else 0.0,
            output_bytes=meas.output_bytes if meas else 0,
            shared=shared,
            shared_numel=shared_numel,
        )
        value = {"time": c.time, "flops": float(c.flops), "params": float(c.params)}[cost]
        out.append(replace(c, cost=value))
    return out


# ---- the result ----------------------------------------------------------------------------


# Units, shared with annot.runtime.cost's table.
_bytes, _count, _seconds = format_bytes, format_count, format_seconds


@dataclass(frozen=True)
class StagePlanResult:
    """A plan: ``boundaries`` (module paths where stages 1.. begin, for
    ``split_stages`` / ``parallelize(split=...)``), the ``partition`` over
    the ``segments`` (their names: the split point each begins at) and their
    ``costs`` (:class:`annot.runtime.cost.SegmentCost`)."""

    class_name: str
    boundaries: tuple[str, ...]
    partition: Any  # annot.runtime.partition.Partition
    segments: tuple[str, ...]
    costs: tuple[Any, ...]
    cost: str
    measured: bool
    tp: int = 1
    memory_budget: Optional[int] = None
    warnings: tuple[str, ...] = field(default=())

    @property
    def n_stages(self) -> int:
        return self.partition.n_stages

    @property
    def imbalance(self) -> float:
        """Slowest stage / mean stage, in the balanced cost."""
        return self.partition.imbalance

    def stages(self) -> list[dict[str, Any]]:
        """Per stage: its segments, first/last segment names, parameters
        (shared ones counted once per stage), FLOPs, measured seconds, memory
        (as the partitioner charged it), bytes it sends on, balanced cost."""
        out = []
        part = self.partition
        for s, (a, b) in enumerate(part.bounds):
            seg = self.costs[a:b]
            n_params, seen = 0, set()
            for c in seg:
                n_params += c.n_params
                for key, numel in c.shared_numel.items():
                    n_params -= numel if key in seen else 0
                    seen.add(key)
            last = s == part.n_stages - 1
            out.append(
                {
                    "stage": s,
                    "segments": [a, b],
                    "first": self.segments[a],
                    "last": self.segments[b - 1],
                    "params": n_params,
                    "flops": sum(c.flops for c in seg) if self.measured else None,
                    "time": sum(c.time for c in seg) if self.measured else None,
                    "memory": part.stage_memory[s],
                    "sends": None if last or not self.measured else seg[-1].output_bytes,
                    "cost": part.stage_costs[s],
                }
            )
        return out

    def table(self) -> str:
        """The plan as a terminal table, with the imbalance and any warnings."""
        what = _COST_WORDS[self.cost]
        head = [
            f"annot plan: {self.class_name} in {self.n_stages} stages over "
            f"{len(self.segments)} segments; balanced cost: {what}"
        ]
        if not self.measured:
            head.append(
                "  no sample input: FLOPs, time and activation memory not measured "
                "(give a sample to balance measured time)"
            )
        if self.tp > 1:
            head.append(
                f"  tp={self.tp}: parameters and FLOPs of @shard-ed layers divided by "
                f"{self.tp} (approximate: FLOPs by their parameter share)"
            )
        if self.memory_budget is not None:
            head.append(f"  memory budget per device: {_bytes(self.memory_budget)}")
        header = ("stage", "first", "last", "params", "FLOPs", "time", "memory", "sends")
        rows = []
        for st in self.stages():
            rows.append(
                (
                    str(st["stage"]),
                    st["first"],
                    st["last"],
                    _count(st["params"]),
                    "-" if st["flops"] is None else _count(st["flops"]),
                    "-" if st["time"] is None else _seconds(st["time"]),
                    _bytes(st["memory"]),
                    "-" if st["sends"] is None else _bytes(st["sends"]),
                )
            )
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

        def line(r: Sequence[str]) -> str:
            return "  ".join(
                v.rjust(w) if i >= 3 else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))
            ).rstrip()

        out = [*head, line(header), line(["-" * w for w in widths]), *map(line, rows)]
        out.append(f"imbalance (max/mean stage cost): {self.imbalance:.2f}")
        out.append("boundaries: " + (", ".join(self.boundaries) or "(none: one stage)"))
        out += [f"warning: {w}" for w in self.warnings]
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        """The plan as plain data (``json.dumps``-able)."""
        return {
            "class": self.class_name,
            "n_stages": self.n_stages,
            "cost": self.cost,
            "measured": self.measured,
            "tp": self.tp,
            "memory_budget": self.memory_budget,
            "boundaries": list(self.boundaries),
            "segments": [
                {
                    "name": c.name,
                    "cost": c.cost,
                    "params": c.n_params,
                    "memory": c.memory,
                    **({"time": c.time, "flops": c.flops} if self.measured else {}),
                }
                for c in self.costs
            ],
            "stages": self.stages(),
            "imbalance": self.imbalance,
            "bottleneck": self.partition.bottleneck,
            "warnings": list(self.warnings),
        }


# ---- the entry points ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Measured:
    class_name: str
    segments: tuple[str, ...]
    costs: list[Any]
    cost: str
    measured: bool


def _read(cls: type, source_path: Optional[str]) -> tuple[str, str]:
    path = source_path or inspect.getfile(cls)
    with tokenize.open(path) as f:  # honours a coding cookie / BOM
        return f.read(), str(path)


def _measure(
    model: nn.Module,
    cls: type,
    *,
    sample: Union[tuple, dict, torch.Tensor, None],
    cost: Optional[str],
    optimizer: str,
    source_path: Optional[str],
    progress: bool,
    cache_dir: Any,
    tp: int,
    repeats: int = 1,
    rounds: int = 5,
    points: Optional[Sequence[str]] = None,
) -> _Measured:
    from annot.runtime.cost import Segment

    if not isinstance(model, cls):
        raise PartitionError(
            f"model is a {type(model).__name__}, not a {cls.__name__}; pass the built model and "
            "its class: plan_stages(model, type(model), n)"
        )
    if cost is None:
        cost = "time" if sample is not None else "params"
    if cost not in _COSTS:
        raise PartitionError(f"cost={cost!r}; expected 'time', 'flops' or 'params'")
    if sample is None and cost != "params":
        raise PartitionError(
            f"cost={cost!r} is measured on a sample input: pass sample=(x, ...) (forward's "
            "positional arguments) or sample={'idx': x, ...}, or use cost='params'"
        )
    if optimizer not in _STATES:
        raise PartitionError(f"optimizer={optimizer!r}; expected one of {sorted(_STATES)}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PartitionError(f"tp={tp!r}; expected an int >= 1")
    for what, n in (("repeats", repeats), ("rounds", rounds)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PartitionError(f"{what}={n!r}; expected an int >= 1")

    source, path = _read(cls, source_path)
    qualname = cls.__qualname__
    if points is None:
        points, split = _points_and_split(source, qualname, model, path)
    else:
        points = list(points)
        try:
            split = _split(source, qualname, points, path)
        except RewriteError as exc:
            raise PartitionError(f"cannot split {qualname}.forward at {points}: {exc}") from None
        _no_markers(qualname, split)
    new_cls = _compile_class(split.source, qualname, cls, qualname)
    bound = copy.copy(model)  # same parameters and submodules, the rewritten methods
    if type(model) is cls:
        bound.__class__ = new_cls
        methods = [getattr(bound, st.method) for st in split.stages]
    else:  # a subclass: keep its class, borrow the stage functions
        import types

        methods = [types.MethodType(new_cls.__dict__[st.method], model) for st in split.stages]
    modules = [_stage_modules(model, st.modules) for st in split.stages]
    first = next(
        (
            p.split("[")[0]
            for p in split.stages[0].modules
            if isinstance(_module_at(model, p.split("[")[0]), nn.Module)
        ),
        "(start of forward)",
    )
    names = (first, *points)

    measured = None
    if sample is not None:
        kwargs = isinstance(sample, dict)
        inputs = (sample,) if kwargs else (sample if isinstance(sample, tuple) else (sample,))
        segs = [
            Segment(_stage_fn(m, i == 0, kwargs), tuple(mods), names[i])
            for i, (m, mods) in enumerate(zip(methods, modules))
        ]
        measured = _profile(segs, inputs, optimizer, progress, cache_dir, repeats, rounds)
    costs = _costs(model, names, modules, measured, optimizer=optimizer, cost=cost, tp=tp)
    return _Measured(cls.__name__, names, costs, cost, sample is not None)


def _profile(segs, inputs, optimizer, progress, cache_dir, repeats: int, rounds: int) -> list:
    """annot.runtime.cost.profile_segments, ``rounds`` times over all the segments;
    each segment keeps its fastest round (the median of ``repeats`` runs).
    A burst of load elsewhere on the machine slows a few consecutive segments
    of one round; across rounds it lands on different ones. Cached as JSON
    in ``cache_dir`` under annot.runtime.cost.cache_key (plus the round count)."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    from annot.runtime.cost import SegmentCost, cache_key, profile_segments

    path = None
    if cache_dir is not None:
        key = cache_key(segs, inputs, optimizer=optimizer, repeats=repeats)
        path = Path(cache_dir) / f"{key}-r{rounds}.json"
        try:
            data = json.loads(path.read_text())
            hit = [SegmentCost(**item) for item in data]
            if len(hit) == len(segs):
                return hit
        except (OSError, ValueError, TypeError):
            pass  # missing or unreadable: profile again
    runs = [
        profile_segments(segs, inputs, optimizer=optimizer, progress=progress, repeats=repeats)
        for _ in range(rounds)
    ]
    out = [min(column, key=lambda c: c.time) for column in zip(*runs)]
    if path is not None:
        atomic_write(path, json.dumps([asdict(c) for c in out]))
    return out


def _result(m: _Measured, part: Any, memory: Optional[int], tp: int) -> StagePlanResult:
    starts = [a for a, _ in part.bounds[1:]]
    total = sum(c.cost for c in m.costs)
    mean = total / part.n_stages
    warnings = []
    for c in m.costs:
        if part.n_stages > 1 and mean > 0 and c.cost > mean:
            warnings.append(
                f"segment {c.name!r} alone costs {c.cost / mean:.2f}x the mean stage cost "
                f"(total / {part.n_stages}); no split balances better than that. annot does not "
                f"cut inside {c.name}: split its forward by hand, or use fewer stages"
            )
    return StagePlanResult(
        class_name=m.class_name,
        boundaries=tuple(m.segments[a] for a in starts),
        partition=part,
        segments=m.segments,
        costs=tuple(m.costs),
        cost=m.cost,
        measured=m.measured,
        tp=tp,
        memory_budget=memory,
        warnings=tuple(warnings),
    )


def _check_count(m: _Measured, n: int, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PartitionError(f"{what}={n!r}; expected an int >= 1")
    if n > len(m.segments):
        raise PartitionError(
            f"{m.class_name}.forward has {len(m.segments)} segments between its split points "
            f"({', '.join(m.segments[1:]) or 'none'}), fewer than the {n} stages asked for; "
            "use fewer stages, or give forward more top-level statements / a longer module list"
        )


def plan_stages(
    model: nn.Module,
    cls: type,
    n_stages: int,
    *,
    sample: Union[tuple, dict, torch.Tensor, None] = None,
    cost: Optional[str] = None,
    memory: Optional[int] = None,
    optimizer: str = "adamw",
    source_path: Optional[str] = None,
    progress: bool = False,
    cache_dir: Any = None,
    tp: int = 1,
    bandwidth: Optional[float] = None,
    repeats: int = 1,
    rounds: int = 5,
) -> StagePlanResult:
    """The best split of ``cls.forward`` (``model`` is a built ``cls``) into
    ``n_stages`` pipeline stages::

        plan = plan_stages(model, GPT, 4, sample=(idx, targets), memory=16 * 2**30)
        print(plan.table())
        annot.parallelize(GPT, cfg, mesh=annot.Mesh(pp=4), split=list(plan.boundaries))

    ``sample``: one microbatch, forward's positional arguments as a tuple or
    its keyword arguments as a dict. ``cost``: "time" (default with a
    sample), "flops" or "params" (default without). ``memory``: bytes per
    device; :class:`PartitionError` (with the numbers) when no split fits.
    ``bandwidth`` (bytes per unit of cost) charges the bytes crossing each cut.
    ``tp``: see the module docstring. Each segment's time is its fastest of
    ``rounds`` rounds over all the segments, a round timing the median of
    ``repeats`` runs of each: on a busy machine a run is often preempted, and
    the fastest is the closest to its cost. Profiles are cached in ``cache_dir``.
    """
    from annot.runtime.cost import partition_args
    from annot.runtime.partition import partition

    m = _measure(
        model,
        cls,
        sample=sample,
        cost=cost,
        optimizer=optimizer,
        source_path=source_path,
        progress=progress,
        cache_dir=cache_dir,
        tp=tp,
        repeats=repeats,
        rounds=rounds,
    )
    _check_count(m, n_stages, "n_stages")
    args = partition_args(m.costs, bandwidth=bandwidth)
    part = partition(n_stages=n_stages, memory_budget=memory, **args)
    return _result(m, part, memory, tp)


def fit_stages(
    model: nn.Module,
    cls: type,
    *,
    memory: int,
    max_stages: Optional[int] = None,
    sample: Union[tuple, dict, torch.Tensor, None] = None,
    cost: Optional[str] = None,
    optimizer: str = "adamw",
    source_path: Optional[str] = None,
    progress: bool = False,
    cache_dir: Any = None,
    tp: int = 1,
    bandwidth: Optional[float] = None,
    repeats: int = 1,
    rounds: int = 5,
) -> StagePlanResult:
    """Memory-fit mode (RaNNC): the fewest stages (at most ``max_stages``,
    default one per segment) whose every stage fits ``memory`` bytes, split
    as :func:`plan_stages` would; ``.n_stages`` is the count."""
    from annot.runtime.cost import partition_args
    from annot.runtime.partition import fit

    m = _measure(
        model,
        cls,
        sample=sample,
        cost=cost,
        optimizer=optimizer,
        source_path=source_path,
        progress=progress,
        cache_dir=cache_dir,
        tp=tp,
        repeats=repeats,
        rounds=rounds,
    )
    cap = len(m.segments) if max_stages is None else max_stages
    _check_count(m, cap, "max_stages")
    args = partition_args(m.costs, bandwidth=bandwidth)
    part = fit(memory_budget=memory, max_stages=cap, **args)
    return _result(m, part, memory, tp)


def measure_split(
    model: nn.Module,
    cls: type,
    boundaries: Sequence[str],
    *,
    sample: Union[tuple, dict, torch.Tensor],
    optimizer: str = "adamw",
    repeats: int = 1,
    rounds: int = 5,
    source_path: Optional[str] = None,
    tp: int = 1,
) -> list[Any]:
    """Profile the stages of a given split (``boundaries`` as for
    ``split_stages``, e.g. a hand-written ``@stage(split=...)`` or another
    tool's choice): one :class:`annot.runtime.cost.SegmentCost` per stage, each
    stage run whole on the sample, the output of the stage before it."""
    if sample is None:
        raise PartitionError("measure_split runs the stages: pass sample=(x, ...)")
    m = _measure(
        model,
        cls,
        sample=sample,
        cost="time",
        optimizer=optimizer,
        source_path=source_path,
        progress=False,
        cache_dir=None,
        tp=tp,
        repeats=repeats,
        rounds=rounds,
        points=boundaries,
    )
    return list(m.costs)
