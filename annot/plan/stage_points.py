"""Where a pipeline stage may begin, and which runner cuts the stages there.

A stage is the module calls between boundary k and boundary k + 1, with the
code between them. :class:`StagePoints` is the one place that answers, for a
model (and one meta forward on a sample), where a stage may begin:

* at a module call (:meth:`StagePoints.replay_refusal` says why not): not at
  a module list or dict (never called, :func:`never_called`: a boundary given
  there begins at the first call inside it, :meth:`StagePoints.first_call`), not at a call
  that would strand a tensor (:func:`annot.runtime.runners.stranded.stranded`), not
  at a path that names no submodule;
* and whether the source runner can cut there too
  (:meth:`StagePoints.source_refusal`: the stage-split rewriter's refusal,
  as data).

``split=`` validation (:meth:`StagePoints.check`), the module planner
(:mod:`annot.plan.module_units`, through :attr:`StagePoints.stranded` and
:attr:`StagePoints.order`), the ``@stage`` planner's points
(:meth:`StagePoints.source_paths`), ``annot plan`` and the build ask it; the
build then chooses the runner once (:func:`choose_runner`), records it in
``model.report.runner`` with its reason, and ``explain`` shows it.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch.nn as nn

from annot.core.errors import HintError

__all__ = [
    "RUNNERS",
    "RunnerChoice",
    "StagePoints",
    "check_stranded",
    "choose_runner",
    "never_called",
    "verify_call_order",
]

log = logging.getLogger("annot")

RUNNERS = ("auto", "source", "replay")


def never_called(m: nn.Module) -> bool:
    """A module list or dict: never called (forward calls its elements), so a
    stage cannot begin at it."""
    return isinstance(m, (nn.ModuleList, nn.ModuleDict))


def _shown(path: str) -> str:
    """``path`` as its import names it (``transformers/models/llama/modeling_llama.py``):
    relative to the deepest ``sys.path`` entry holding it, so a reason reads the
    same on every machine; ``path`` itself where none does."""
    full = os.path.abspath(path)
    roots = [os.path.abspath(p or os.curdir) for p in sys.path]
    held = [r for r in roots if full.startswith(r.rstrip(os.sep) + os.sep)]
    return os.path.relpath(full, max(held, key=len)) if held else path


def _source_file(cls: type) -> Optional[str]:
    """The file ``cls`` is defined in, None where there is none to read (a
    class made at run time, a builtin)."""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    return path if path and path.endswith(".py") and os.path.exists(path) else None


class StagePoints:
    """Where a stage of ``ref`` (an instance of ``cls``, on meta or real) may
    begin. ``sample``: one microbatch of forward's arguments; without it a
    transformers model makes a tiny one from its config, else the probes that
    need a forward (:attr:`calls`, :attr:`stranded`) find nothing."""

    def __init__(self, ref: nn.Module, cls: type, sample: Any = None):
        self.ref = ref
        self.cls = cls
        self.sample = sample
        self.names = dict(ref.named_modules(remove_duplicate=False))
        self._splits: dict[tuple[tuple[str, ...], bool], Any] = {}

    # -- the probes: one meta forward each, run when first asked ----------------

    @functools.cached_property
    def calls(self) -> Optional[list[tuple[str, ...]]]:
        """The module calls of one meta forward, in order
        (:func:`annot.runtime.runners.stage_modules.record_calls`); None without a probe."""
        from annot.runtime.runners.stage_modules import record_calls

        return self._probe(record_calls)

    @functools.cached_property
    def stranded(self) -> dict[str, str]:
        """The module calls where a stage cannot begin, each with the tensor it
        would strand (:func:`annot.runtime.runners.stranded.stranded`); empty without a probe."""
        from annot.runtime.runners.stranded import stranded

        return self._probe(stranded) or {}

    @property
    def order(self) -> Optional[list[str]]:
        """Module paths in the order forward first calls them; None without a probe."""
        if self.calls is None:
            return None
        return list(dict.fromkeys(p for paths in self.calls for p in paths))

    def _probe(self, fn) -> Any:
        from annot.hf.models import sample_inputs

        probe = self.sample if self.sample is not None else sample_inputs(self.ref)
        if probe is None:
            return None
        try:
            return fn(self.ref, probe)
        except Exception as exc:  # noqa: BLE001 - user code's forward: a refinement, not required
            log.debug("annot: the meta probe of %s failed (%s)", type(self.ref).__name__, exc)
            return None

    # -- the answers --------------------------------------------------------

    def paths(self) -> list[str]:
        """Every module call where a stage may begin at run time, in call order
        (registration order without a probe)."""
        order = self.order or list(self.names)
        return [p for p in order if p and self.replay_refusal(p) is None]

    def first_call(self, path: str) -> str:
        """Where a stage given as beginning at ``path`` begins: at ``path``'s
        call, or for a module list or dict (never called) at the first call
        inside it, as the automatic split's units do: first in forward's call
        order with a probe, else in registration order (a hand boundary's
        stage owns its modules in that order too)."""
        m = self.names.get(path)
        if m is None or not never_called(m):
            return path
        inside = (
            p
            for p in (self.order or self.names)
            if p.startswith(f"{path}.") and p in self.names and not never_called(self.names[p])
        )
        return next(inside, path)

    def replay_refusal(self, path: str) -> Optional[str]:
        """Why a stage cannot begin at ``path``'s call at run time; None where it can."""
        m = self.names.get(path)
        if m is None:
            return f"{path!r} names no submodule of {type(self.ref).__name__}"
        if never_called(m):
            return f"{path!r} is an nn.{type(m).__name__}, which is never called"
        if path in self.stranded:
            return self.stranded[path]
        return None

    def markers(self) -> int:
        """How many ``annot.boundary()`` markers the root's own ``forward`` has."""
        path = _source_file(self.cls)
        if path is None or "forward" not in vars(self.cls):
            return (
                0  # a forward inherited from a base (x-transformers' wrappers): none of the user's
            )
        return _markers(path, self.cls.__qualname__)

    def source_refusal(self, boundaries: tuple[str, ...], nested: bool = False) -> Optional[str]:
        """Why the source runner (the stage-split rewriter) cannot cut the
        root's ``forward`` at ``boundaries``; None where it can. ``nested``:
        also following boundaries into the forwards the root calls (the
        nested split ``annot rewrite --pp`` prints, which ``runner="source"``
        runs)."""
        split = self._source_split(tuple(boundaries), nested)
        return split if isinstance(split, str) else None

    def source_split(self, boundaries: tuple[str, ...]) -> Any:
        """The nested source split at ``boundaries``
        (:class:`annot.rewriters.split.stage_split.StageSplit`), or the rewriter's
        refusal (a str)."""
        return self._source_split(tuple(boundaries), True)

    def _source_split(self, boundaries: tuple[str, ...], nested: bool) -> Any:
        """The stage split at ``boundaries``, or the rewriter's refusal (a
        str: ``file:line:col: reason``); each asked once (a split of an HF
        modeling file takes a few hundred ms)."""
        key = (boundaries, nested)
        if key not in self._splits:
            self._splits[key] = self._split_now(boundaries, nested)
        return self._splits[key]

    def _split_now(self, boundaries: tuple[str, ...], nested: bool) -> Any:
        path = _source_file(self.cls)
        if path is None:
            return f"{self.cls.__qualname__} has no source file to split"
        from annot.rewrite_cache import read_source
        from annot.rewriters.split.stage_split import split_or_refusal

        return split_or_refusal(
            read_source(path),
            self.cls.__qualname__,
            list(boundaries),
            path=_shown(path),
            nested=nested,
        )

    def source_paths(self, model: nn.Module) -> list[str]:
        """Every module path where the source runner can begin a stage of the
        root's forward, in forward order (:mod:`annot.plan.points`)."""
        from annot.plan.points import split_points
        from annot.rewrite_cache import read_source

        path = _source_file(self.cls)
        if path is None:
            return []
        return split_points(read_source(path), self.cls.__qualname__, model, path=path)

    def check(self, boundaries: tuple[str, ...], runner: str) -> None:
        """Refuse boundaries where no stage may begin, before any rank runs a
        step: a path that names no submodule (listing some that do); and for
        the replay, an empty module list or a call that
        would strand a tensor (naming an enclosing module where the stage can
        begin instead)."""
        for b in boundaries:
            if b not in self.names:
                near = [n for n in self.names if n and b.rsplit(".", 1)[0] in n][:8]
                raise HintError(
                    f"pipeline boundary {b!r} names no submodule of {type(self.ref).__name__}; a "
                    f"boundary is the path of the module whose call begins a stage"
                    + (f" (e.g. {', '.join(near)})" if near else "")
                )
        if runner != "replay":
            return
        for b in boundaries:
            m = self.names[b]
            if never_called(m):  # (one holding modules begins at its first call: first_call)
                raise HintError(
                    f"pipeline boundary {b!r} names an nn.{type(m).__name__}, which is never "
                    "called and holds no module whose call could begin a stage; name the "
                    "module whose call begins the stage"
                )
        check_stranded(self.ref, boundaries, self.stranded)


def check_stranded(ref: nn.Module, boundaries: tuple[str, ...], stranded: dict[str, str]) -> None:
    """Refuse a boundary cut at run time whose call would leave a tensor behind
    (``stranded``: :attr:`StagePoints.stranded`), naming an enclosing module
    where the stage can begin instead."""
    names = dict(ref.named_modules())
    for b in boundaries:
        if b not in stranded:
            continue
        up = b.rpartition(".")[0]
        while up and (up in stranded or up not in names or never_called(names[up])):
            up = up.rpartition(".")[0]
        instead = f"begin the stage at {up!r}, which encloses it, or " if up else ""
        raise HintError(
            f"pipeline boundary {b!r}: a stage cannot begin at that call: {stranded[b]}, so "
            f"the next stage could not receive it. To fix: {instead}begin it at another "
            "module call, or assign that value to a local variable before the call"
        )


def verify_call_order(
    whole: nn.Module, boundaries: tuple[str, ...], held: dict[int, set[str]], args, kwargs
) -> None:
    """On the model's first call, before any rank runs a stage: stages cut at
    run time whose modules were placed without a call order (no ``sample=``,
    no config to make one: in the order the model registers them) are checked
    against the order this call shows, one meta forward of ``whole`` (the
    single-device model on meta). Every module and raw parameter a stage
    calls or reads must be held by that stage (``held``: the layout's
    ``stage_modules``), and no boundary may strand a tensor; else it is
    refused here, naming the module, before any gradient."""
    from annot.runtime.runners.shape_run import Arguments
    from annot.runtime.runners.stage_modules import record_calls, stage_calls
    from annot.runtime.runners.stranded import stranded

    sample = Arguments(tuple(args), dict(kwargs))
    calls = stage_calls(record_calls(whole, sample), boundaries)
    placed = set().union(*held.values())  # (a container a boundary cuts is on no stage)
    modules = dict(whole.named_modules(remove_duplicate=False))
    params = dict(whole.named_parameters(remove_duplicate=False))

    def tensors(path: str) -> set[int]:
        """The parameters ``path`` holds itself: a tied weight is one (held with
        either of its modules: the layout's ties join them)."""
        if path in params:
            return {id(params[path])}
        m = modules.get(path)
        return {id(t) for t in m.parameters(recurse=False)} if m is not None else set()

    for s, paths in sorted(calls.items()):
        mine = set().union(set(), *(tensors(p) for p in held.get(s, set())))
        for path in sorted(paths & placed - held.get(s, set())):
            if tensors(path) and tensors(path) <= mine:
                continue
            other = [t for t, h in sorted(held.items()) if path in h]
            raise HintError(
                f"{type(whole).__name__}'s stages were placed in the order its modules are "
                f"registered (no sample= to show the order forward calls them), and its first "
                f"call shows otherwise: stage {s} (from boundary "
                f"{(('<start>',) + boundaries)[s]!r}) calls or reads {path!r}, which that order "
                f"placed on stage(s) {other}. To fix: pass sample=<one microbatch of forward's "
                "arguments, a tuple or a dict> to annot.parallelize, or give other boundaries "
                "with split=[...]"
            )
    check_stranded(whole, boundaries, stranded(whole, sample))


@functools.lru_cache(maxsize=32)
def _markers(path: str, qualname: str) -> int:
    from annot.rewrite_cache import read_source
    from annot.rewriters.split.stage_split import split_stages

    return len(split_stages(read_source(path), qualname, [], path=path).stages) - 1


@dataclass(frozen=True)
class RunnerChoice:
    """The runner the build chose for a plan, and why (``model.report.runner``)."""

    name: str  # "source" or "replay"
    reason: str


def choose_runner(
    points: StagePoints, boundaries: tuple[str, ...], runner: str = "auto"
) -> RunnerChoice:
    """Which runner runs the stages that begin at ``boundaries``, decided once
    from the plan (``()``: the ``annot.boundary()`` markers of forward).

    ``runner="auto"``: the source split where the rewriter can cut there,
    in the root's forward or following the boundaries into the forwards it
    calls (the nested split ``annot rewrite --pp`` prints: an HF model's
    ``model.layers.4``), a verified fast path: the same losses and gradients
    as the replay (``tests/test_runners.py``: HF Llama, interleaved, T5, raw
    parameters between two towers) and 5% faster or more on the same plans
    (``benchmarks/runners.py``). Else the replay, which cuts at any module
    call, and runs the model's own forward on every rank: where the rewriter
    cannot cut (the reason says why), and where the model's config asks a
    decorator that wraps a split forward's whole call for what only the
    whole call gives (HF's ``output_router_logits=True`` for
    ``@capture_outputs``). ``"source"`` / ``"replay"`` ask for one:
    ``"source"`` where the rewriter cannot cut is refused with its reason,
    and a call asking output capture of a split forward is refused at run
    time (:meth:`annot.runtime.runners.stage_runner.SourceRunner.run_stage`); the
    replay cannot run ``annot.boundary()`` markers."""
    if runner not in RUNNERS:
        raise HintError(f"parallelize: runner={runner!r}; expected one of {', '.join(RUNNERS)}")
    name = type(points.ref).__name__
    if not boundaries:
        if runner == "replay":
            raise HintError(
                f"parallelize: runner='replay', but {name}.forward places its stages with "
                "annot.boundary() markers, which only the source split reads; give the "
                "boundaries as split=[module paths] instead, or use runner='source'"
            )
        return RunnerChoice(
            "source", "annot.boundary() markers in forward: the rewriter cuts there"
        )
    if runner == "source":
        refusal = points.source_refusal(boundaries, nested=True)
        if refusal is not None:
            raise HintError(
                f"parallelize: runner='source', but the stage split cannot cut "
                f"{name}.forward at {list(boundaries)}: {refusal}. Use runner='replay' (or "
                "leave runner= out), which cuts at any module call"
            )
        return RunnerChoice("source", "asked for (runner='source')")
    if runner == "replay":
        return RunnerChoice("replay", "asked for (runner='replay')")
    split = points.source_split(boundaries)
    if isinstance(split, str):
        return RunnerChoice("replay", f"the source split cannot cut there: {split}")
    asked = split.output_request({}, getattr(points.ref, "config", None))
    if asked is not None:
        return RunnerChoice(
            "replay",
            f"the model's config asks {asked}: the decorator collects or converts the outputs "
            "of the whole call, which the replay runs on every rank and the source split cuts "
            "into stages",
        )
    if len(split.forwards) == 1:
        return RunnerChoice(
            "source",
            "the rewriter cuts the root's forward at these boundaries, "
            "and its stage methods run faster than the replay",
        )
    return RunnerChoice(
        "source",
        f"the rewriter cuts {', '.join(split.forwards)} at these boundaries (the nested split "
        "annot rewrite --pp prints), and its stage methods run faster than the replay",
    )
