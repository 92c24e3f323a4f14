"""Split a model's ``forward`` into pipeline-stage methods, source to source.

``split_stages(source, "GPT", ["transformer.h.2"])`` keeps ``GPT.forward``
as written (single-device still works) and adds one method per stage after
it::

    # annot: pipeline stages of forward (boundaries: transformer.h.2)
    def _annot_stage_0(self, idx, targets=None):
        ...                                        # statements copied as written
        for block in self.transformer.h[:2]:
            x = block(x)
        return {"x": x, "targets": targets}        # what the next stage needs

    def _annot_stage_1(self, x, targets):
        for block in self.transformer.h[2:]:
            ...
        return logits, loss                        # forward's own return

``stage_{k+1}(self, **stage_k(...))`` composes to ``forward``. A boundary is
a module path where a new stage begins:

* a submodule called by a top-level statement of forward (``"lm_head"``):
  the stage begins before that statement;
* an element of an ``nn.ModuleList`` / ``nn.Sequential`` that forward loops
  over (``"transformer.h.2"``): the loop is cut, stage k runs
  ``for block in self.transformer.h[a:b]:`` (``enumerate`` keeps its count);
* or an ``annot.boundary()`` statement in forward (matched by qualified
  name), which is then left out of the stage code.

What crosses a boundary is computed by :mod:`annot.rewriters.analysis.liveness`: the names
defined before it and read after it, in order of first use after it.
Whatever cannot be split safely is refused with a :class:`RewriteError` at
``file:line:col`` that says how to fix it, never turned into wrong code.

:func:`split_decorated` applies every ``@stage`` class of a file (its
``split=[...]`` read literally) and replaces the decorator with a comment,
so running it again changes nothing.

This module is the entry point; the parts live beside it:
:mod:`~annot.rewriters.split.boundaries` (where a boundary can cut forward, the
rule the planner shares), :mod:`~annot.rewriters.split.forward_body` (forward's
statements and the constructs a split cannot keep),
:mod:`~annot.rewriters.split.forward_stages` (placing the cuts, the refusals, what
crosses) and :mod:`~annot.rewriters.split.stage_methods` (the stage methods and the
class transform).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import libcst as cst
from libcst.metadata import MetadataWrapper

from annot.core.errors import RewriteError
from annot.core.hints import StageSpec
from annot.rewriters.analysis.hint_reader import STAGE_NAMES, find_hints, has_qualified_name
from annot.rewriters.source.diagnostics import Locator, node_source, parse_source
from annot.rewriters.source.hint_literals import format_hint
from annot.rewriters.split.boundaries import qualified
from annot.rewriters.split.forward_stages import ForwardStages, Splitter
from annot.rewriters.split.stage_methods import (
    MethodStages,
    StageMethod,
    StageSplitTransformer,
    build_stages,
    output_arity,
)

__all__ = ["StageMethod", "StageSplit", "split_decorated", "split_or_refusal", "split_stages"]


# Hugging Face's decorators that collect or convert a forward's outputs over the
# whole call, and the call's arguments that ask them to: on a split forward they
# wrap single stages (each of the root's, a nested forward's first), so a call
# asking cannot run on the split (StageSplit.output_request).
# Each of them also takes return_dict out of the call's arguments (else the
# config's) and, where it is False, turns the whole call's output into a tuple
# (ModelOutput.to_tuple); on the root's forward the source runner does that
# around the whole pipeline instead (StageSplit.tuple_at_root).
OUTPUT_WRAPPERS = {
    "capture_outputs": ("output_attentions", "output_hidden_states", "output_router_logits"),
    "check_model_inputs": ("output_attentions", "output_hidden_states", "output_router_logits"),
    "can_return_tuple": (),
}


@dataclass(frozen=True)
class StageSplit:
    """The result of :func:`split_stages`.

    ``source``: the whole module with the class rewritten. ``output_arity``:
    ``n`` if every ``return`` of forward returns a tuple literal of ``n``
    items, else None. ``boundaries``: where each stage after the first
    begins, in forward order (the paths given, and ``boundary()@LINE`` for
    ``annot.boundary()`` markers). ``wrappers``: ``(forward, decorator)``
    for each split forward decorated with one of :data:`OUTPUT_WRAPPERS`
    (``("LlamaModel.forward", "capture_outputs")``), the root's first.
    ``forwards``: each split forward, ``"Class.method"``, the root's first.
    """

    source: str
    stages: tuple[StageMethod, ...]
    output_arity: Optional[int]
    boundaries: tuple[str, ...] = ()
    wrappers: tuple[tuple[str, str], ...] = ()
    forwards: tuple[str, ...] = ()

    @property
    def tuple_at_root(self) -> bool:
        """Whether the root's forward takes ``return_dict`` through one of
        :data:`OUTPUT_WRAPPERS`: the runner then takes it out of the call and
        turns the last stage's output into a tuple where it is False, as the
        decorator does around the whole call."""
        return any(where == self.forwards[0] for where, _ in self.wrappers)

    def output_request(self, kwargs: Mapping, config: Any) -> Optional[str]:
        """The call's argument (or ``config``'s default) that asks a decorator
        in :attr:`wrappers` for what it gives only around the whole call
        (``output_hidden_states=True``, ``return_dict=False``), named with
        the decorator; None where the call asks none. A call's
        ``return_dict=False`` is not asked of the split where
        :attr:`tuple_at_root` (the runner gives it); ``config``'s is, as every
        stage's decorator reads it."""
        for where, name in self.wrappers:
            for flag in OUTPUT_WRAPPERS[name]:
                value = kwargs.get(flag, getattr(config, flag, None))
                if value:
                    return f"{flag}={value!r} (for @{name} on {where})"
        if self.wrappers:
            default = getattr(config, "return_dict", None)
            value = default if self.tuple_at_root else kwargs.get("return_dict", default)
            if value is False:
                where, name = self.wrappers[0]
                return f"return_dict=False (for @{name} on {where})"
        return None


def _stage_decorator(cls: cst.ClassDef, qnames: Mapping) -> Optional[int]:
    for i, dec in enumerate(cls.decorators):
        expr = dec.decorator
        func = expr.func if isinstance(expr, cst.Call) else expr
        if has_qualified_name(qualified(qnames, func), STAGE_NAMES):
            return i
    return None


def _one_line(code: str) -> str:
    code = re.sub(r"\s*\n\s*", " ", code.strip())
    return re.sub(r"([\[(]) ", r"\1", re.sub(r",? ([\])])", r"\1", code))


def _find_class(module: cst.Module, name: str, path: str) -> cst.ClassDef:
    """The class ``name`` (a qualified name like ``Outer.GPT`` is followed
    through class bodies); refused when missing or ambiguous."""
    found: list[cst.ClassDef] = []
    parts = name.split(".")

    class _Find(cst.CSTVisitor):
        def __init__(self) -> None:
            super().__init__()
            self.stack: list[str] = []

        def visit_ClassDef(self, node: cst.ClassDef) -> None:
            self.stack.append(node.name.value)
            if self.stack[-len(parts) :] == parts:
                found.append(node)

        def leave_ClassDef(self, node: cst.ClassDef) -> None:
            self.stack.pop()

    module.visit(_Find())
    if not found:
        raise RewriteError(f"class {name} is not defined in this file", path, 1, 1)
    return found[0]


# Hugging Face's forward decorators that read the call's arguments (defaults
# from the config, return_dict, output flags) or only document it: on a nested
# forward they run on its first stage, which takes the call's arguments. (Output
# capture, output_hidden_states=True, sees only that stage.)
FIRST_STAGE_DECORATORS = frozenset(
    {
        "auto_docstring",
        "can_return_tuple",
        "merge_with_config_defaults",
        "capture_outputs",
        "check_model_inputs",
        "deprecate_kwarg",
    }
)


@dataclass(frozen=True)
class _Level:
    """One method of the call chain, split: at ``given``, called by ``caller``
    (``Class.method``; None for the root's forward)."""

    given: tuple[str, ...]
    splitter: Splitter
    plan: ForwardStages
    built: list
    caller: Optional[str]


def _decorator_names(sp: Splitter) -> list[str]:
    """The names of the split method's decorators (``capture_outputs`` for
    ``@capture_outputs`` and ``@utils.capture_outputs(...)``)."""
    out = []
    for dec in sp.forward.decorators:
        func = dec.decorator.func if isinstance(dec.decorator, cst.Call) else dec.decorator
        out.append(func.attr.value if isinstance(func, cst.Attribute) else node_source(func))
    return out


def _chain(
    wrapper: MetadataWrapper,
    cls: cst.ClassDef,
    method: str,
    boundaries: Sequence[tuple[str, Optional[cst.CSTNode]]],
    path: str,
    nested: bool,
    done: dict[tuple[int, str], _Level],
    caller: Optional[str] = None,
) -> None:
    """Plan ``cls.<method>`` at ``boundaries`` into ``done``, then the callees
    its statements are cut below (a nested forward split at its own paths)."""
    given = tuple(b for b, _ in boundaries)
    key = (id(cls), method)
    if key in done:
        if done[key].given != given:
            raise Locator(wrapper, path).error(
                cls,
                f"{cls.name.value}.{method} would be split twice, at {list(done[key].given)} and at "
                f"{list(given)} (two calls of one class, e.g. an encoder and a decoder stack "
                "built from the same class, cut at different places); annot rewrite writes one "
                "set of stage methods per class: cut both at the same paths, or let annot cut "
                "the stages at run time: annot.parallelize(..., split=[...])",
            )
        return
    sp = Splitter(wrapper, cls, path, method=method, nested=nested)
    if caller is not None:
        for dec, name in zip(sp.forward.decorators, _decorator_names(sp)):
            if name not in FIRST_STAGE_DECORATORS:
                raise sp.error(
                    dec,
                    f"{cls.name.value}.{method} is decorated with "
                    f"@{_one_line(node_source(dec.decorator))}, which wraps the whole call; its "
                    "stage methods cannot keep it. Cut these stages at run time "
                    "(annot.parallelize(..., split=[...])), or place the boundary outside "
                    f"{cls.name.value}",
                )
    plan = sp.plan(boundaries)
    built = build_stages(sp, plan, decorators=caller is None)
    done[key] = _Level(given, sp, plan, built, caller)
    for inner in plan.inner:
        child = inner.callee.cls  # a submodule's class, or this one for a helper method
        if child is None:  # an nn.Sequential: sliced in place
            continue
        try:
            _chain(
                wrapper,
                child,
                inner.callee.method,
                [(b, None) for b in inner.boundaries],
                path,
                nested,
                done,
                caller=f"{cls.name.value}.{method}",
            )
        except RewriteError as err:
            if inner.callee.kind != "module":
                raise
            raise RewriteError(
                f"{err.reason} [in {child.name.value}, called as self.{inner.callee.path}(...) "
                f"by {cls.name.value}.{method}: its paths are the given ones less "
                f"'{inner.callee.path}.']",
                err.path,
                err.line,
                err.col,
            ) from None


def _header(sp: Splitter, plan: ForwardStages, caller: Optional[str]) -> str:
    labels = [c.label for c in plan.cuts]
    what = sp.method if caller is None else f"{sp.cls.name.value}.{sp.method}"
    if not labels:
        return f"# annot: pipeline stages of {what} (one stage: no boundaries)"
    out = f"# annot: pipeline stages of {what} (boundaries: {', '.join(labels)})"
    if caller is not None:
        out += f", run by the stages of {caller}"
        if sp.forward.decorators:
            names = ", ".join(
                "@" + _one_line(node_source(d.decorator)) for d in sp.forward.decorators
            )
            out += (
                f"\n# annot: its decorators ({names}) wrap the whole call: they run on its "
                "first stage, which takes the call's arguments"
            )
    return out


def _stage_modules(level: _Level, done: dict[tuple[int, str], _Level]) -> list[StageMethod]:
    """``level``'s stage methods with the modules they hold: a call of a
    callee's stage method (``model._annot_stage_1``, or a helper method's
    stage of this class) stands for what that stage reads, each as
    ``callee/use`` (``"model/layers[1:3]"``: a use read relative to the
    submodule ``model``), so each stage holds only its part of a nested
    forward."""
    stages = {}  # "model._annot_stage_1" -> the modules that part reads
    for inner in level.plan.inner:
        child_cls = inner.callee.cls
        if child_cls is None:  # an nn.Sequential: sliced in place, paths as written
            continue
        child = done[(id(child_cls), inner.callee.method)]
        under = inner.callee.path if inner.callee.kind == "module" else ""
        for sm in _stage_modules(child, done):
            name = f"{under}.{sm.method}" if under else sm.method
            stages[name] = tuple(f"{under}/{m}" if under else m for m in sm.modules)
    out = []
    for _, sm in level.built:
        modules: dict[str, None] = {}
        for m in sm.modules:
            for held in stages.get(m, (m,)):
                modules.setdefault(held, None)
        out.append(replace(sm, modules=tuple(modules)))
    return out


def _split(
    wrapper: MetadataWrapper,
    cls: cst.ClassDef,
    boundaries: Sequence[tuple[str, Optional[cst.CSTNode]]],
    path: str,
    nested: bool = False,
) -> StageSplit:
    done: dict[tuple[int, str], _Level] = {}
    _chain(wrapper, cls, "forward", boundaries, path, nested, done)
    root = done[(id(cls), "forward")]
    plan, built = root.plan, root.built
    inserts = [
        (
            lv.splitter.cls,
            MethodStages(
                lv.splitter.method,
                lv.splitter.prefix,
                _header(lv.splitter, lv.plan, lv.caller),
                [f for f, _ in lv.built],
            ),
        )
        for lv in done.values()
    ]
    n = len(built)
    qnames = root.splitter.qnames
    idx = _stage_decorator(cls, qnames)
    comment = None
    if idx is not None:
        dec = cls.decorators[idx]
        text = "@" + _one_line(node_source(dec.decorator))
        try:
            hits = [h for h in find_hints(wrapper, "stage", path) if h.node is cls]
            if hits:
                text = format_hint(hits[0].spec)
        except RewriteError:
            pass
        comment = f"# annot: {text} applied: {n} stage{'s' if n != 1 else ''}"
    transformer = StageSplitTransformer(inserts, cls, idx, comment)
    source = wrapper.module.visit(transformer).code
    labels = tuple(c.label for c in plan.cuts)
    stages = tuple(_stage_modules(root, done))
    forwards = tuple(f"{lv.splitter.cls.name.value}.{lv.splitter.method}" for lv in done.values())
    wrappers = tuple(
        (where, name)
        for where, lv in zip(forwards, done.values())
        for name in _decorator_names(lv.splitter)
        if name in OUTPUT_WRAPPERS
    )
    return StageSplit(source, stages, output_arity(plan.returns), labels, wrappers, forwards)


def split_stages(
    source: str,
    class_name: str,
    boundaries: Sequence[str],
    *,
    path: str = "<string>",
    nested: bool = False,
) -> StageSplit:
    """Split ``class_name``'s forward in ``source`` at ``boundaries`` (module
    paths where a new stage begins, in forward order; ``annot.boundary()``
    statements in forward are boundaries too). k boundaries give k + 1
    stages. Raises :class:`RewriteError` for what cannot be split safely.

    ``nested``: a boundary below a call (``"model.layers.2"`` below
    ``self.model(...)``, a helper method, an nn.Sequential called whole) is
    followed into the callee's source in this file, which gets stage methods
    of its own (:mod:`annot.rewriters.split.nested_calls`); how ``annot rewrite``
    prints a model whose blocks sit in nested forwards. Without it such a
    boundary is refused: the runtime cuts those stages at run time.
    """
    wrapper = MetadataWrapper(parse_source(source, path))
    cls = _find_class(wrapper.module, class_name, path)
    return _split(wrapper, cls, [(b, None) for b in boundaries], path, nested)


def split_or_refusal(
    source: str,
    class_name: str,
    boundaries: Sequence[str],
    *,
    path: str = "<string>",
    nested: bool = False,
) -> Union[StageSplit, str]:
    """:func:`split_stages`'s split, or why it cannot cut ``class_name``'s
    forward at ``boundaries`` (its refusal, ``file:line:col: reason``): the
    answer the build chooses a runner by
    (:func:`annot.plan.stage_points.choose_runner`), never an exception."""
    try:
        return split_stages(source, class_name, boundaries, path=path, nested=nested)
    except RewriteError as err:
        return str(err)


def split_decorated(
    source: str,
    *,
    path: str = "<string>",
    boundaries: Optional[Mapping[str, Sequence[str]]] = None,
    nested: bool = False,
) -> tuple[str, dict[str, StageSplit]]:
    """Apply every ``@stage`` class of ``source``: ``(new source, {class: split})``.

    Boundaries come from ``boundaries[class name]`` when given (how the
    runtime passes ``auto`` placements), else from the decorator's literal
    ``split=[...]`` (plus ``annot.boundary()`` markers). A file without
    ``@stage`` (e.g. one this already rewrote) is returned unchanged.
    ``nested``: as for :func:`split_stages`.
    """
    boundaries = dict(boundaries or {})
    wrapper = MetadataWrapper(parse_source(source, path))
    hints = find_hints(wrapper, "stage", path)
    results: dict[str, StageSplit] = {}
    # bottom-up, so the positions of classes still to do stay those of `source`
    for hint in reversed(hints):
        wrapper = MetadataWrapper(parse_source(source, path))
        cls = [h for h in find_hints(wrapper, "stage", path) if h.name == hint.name][-1]
        spec = cls.spec
        assert isinstance(spec, StageSpec)  # find_hints(..., "stage") reads @stage hints
        if hint.name in boundaries:
            given: list[tuple[str, Optional[cst.CSTNode]]] = [
                (b, None) for b in boundaries[hint.name]
            ]
        elif spec.auto:
            raise Locator(wrapper, path).error(
                cls.decorator,
                f"@stage(auto=True) on {hint.name}: automatic boundaries are chosen from the "
                "built model; use annot.parallelize, or pass boundaries={"
                f"{hint.name!r}: [...]}} here",
            )
        else:
            given = [(b, n) for b, n in zip(spec.split, _split_nodes(cls.decorator))]
        result = _split(wrapper, cls.node, given, path, nested)
        results[hint.name] = result
        source = result.source
    return source, dict(reversed(list(results.items())))


def _split_nodes(dec: cst.Decorator) -> list[cst.CSTNode]:
    """The string literal nodes of ``split=[...]`` (for error positions)."""
    call = dec.decorator
    if isinstance(call, cst.Call):
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == "split":
                if isinstance(arg.value, (cst.List, cst.Tuple)):
                    return [e.value for e in arg.value.elements]
                return [arg.value]
    return []
