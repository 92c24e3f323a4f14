"""Where a pipeline boundary can cut ``forward``: one rule for the stage
splitter and the planner.

:class:`Uses` records every ``self.<path>`` that a top-level statement of
forward calls or loops over (and each ``annot.boundary()`` marker), with the
construct it is nested in. :func:`place_boundary` is the rule that turns a
boundary's module path into a place: before a top-level statement, or at an
iteration of a loop over an ``nn.ModuleList`` / ``nn.Sequential``.
:mod:`annot.rewriters.split.stage_split` refuses a place that has a problem, with its
reason; :mod:`annot.plan.planner` proposes only the places that have none.
:func:`piece_iter` writes the slice of such a loop that one stage runs
(``[*self.h][a:b]``, ``enumerate([*self.h][a:b], a)``), the inverse of
:func:`loop_target`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import libcst as cst
import libcst.matchers as m

from annot.rewriters.analysis.hint_reader import BOUNDARY_NAMES, has_qualified_name

__all__ = [
    "Placement",
    "SelfPaths",
    "Use",
    "Uses",
    "loop_breaks",
    "loop_target",
    "piece_iter",
    "place_boundary",
    "qualified",
    "self_path",
    "uses_in",
]


def qualified(qnames: Mapping, node: cst.CSTNode) -> set:
    """``QualifiedNameProvider`` metadata of ``node`` (resolving lazy values)."""
    value = qnames.get(node, ())
    return value() if callable(value) else value


# ---- self attribute chains ------------------------------------------------------


def _int_index(node: cst.Subscript) -> Optional[int]:
    if len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
        value = node.slice[0].slice.value
        if isinstance(value, cst.Integer):
            return int(value.evaluated_value)
    return None


def self_path(node: cst.CSTNode, self_name: str, *, ints: bool = True) -> Optional[str]:
    """``self.a.b`` -> ``"a.b"`` (``self.h[2]`` -> ``"h.2"`` when ``ints``)."""
    parts: list[str] = []
    while True:
        if isinstance(node, cst.Attribute):
            parts.append(node.attr.value)
            node = node.value
        elif ints and isinstance(node, cst.Subscript) and _int_index(node) is not None:
            parts.append(str(_int_index(node)))
            node = node.value
        elif isinstance(node, cst.Name) and node.value == self_name and parts:
            return ".".join(reversed(parts))
        else:
            return None


def _int_slice(node: cst.Subscript) -> Optional[str]:
    """``x[2:4]`` -> ``"[2:4]"``, ``x[:2]`` -> ``"[0:2]"`` (int literals only)."""
    if len(node.slice) != 1 or not isinstance(node.slice[0].slice, cst.Slice):
        return None
    sl = node.slice[0].slice
    if sl.step is not None:
        return None
    bounds = []
    for b in (sl.lower, sl.upper):
        if b is None:
            bounds.append("")
        elif isinstance(b, cst.Integer):
            bounds.append(str(b.evaluated_value))
        else:
            return None
    return f"[{bounds[0] or 0}:{bounds[1]}]"


class SelfPaths(cst.CSTVisitor):
    """Every ``self.<path>`` a piece of code reads, in source order."""

    def __init__(self, self_name: str) -> None:
        super().__init__()
        self.self_name = self_name
        self.found: dict[str, None] = {}

    def visit_Call(self, node: cst.Call) -> bool:
        if isinstance(node.func, cst.Subscript):
            path = self_path(node.func, self.self_name)
            if path is not None:  # self.h[2](x)
                self.found[path] = None
                for arg in node.args:
                    arg.visit(self)
                return False
        return True

    def visit_Subscript(self, node: cst.Subscript) -> bool:
        sl = _int_slice(node)
        inner = node.value
        if sl is not None and m.matches(inner, m.List(elements=[m.StarredElement()])):
            # a stage's piece (piece_iter): [*self.h][1:3] reads self.h[1:3]
            inner = cst.ensure_type(inner, cst.List).elements[0].value
        base = self_path(inner, self.self_name, ints=False)
        if base is not None and sl is not None:
            self.found[base + sl] = None
            return False
        if sl is not None and isinstance(inner, cst.Subscript):  # a stage's piece of a prefix
            base = _module_list(inner, self.self_name)
            if base is not None and self_path(inner, self.self_name) is None:
                self.found[base + sl] = None  # [*self.h[:n]][1:3] reads (at most) self.h[1:3]
                inner.slice[0].visit(self)
                return False
        return True

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        path = self_path(node, self.self_name, ints=False)
        if path is not None:
            self.found[path] = None
            return False
        return True


# ---- where forward calls what ---------------------------------------------------


@dataclass(frozen=True, eq=False)
class Use:
    """One use of a ``self`` path in forward that a boundary may name.

    ``kind``: ``call`` (``self.p(...)``), ``loop`` (``for b in self.p`` or
    ``enumerate(self.p)``), ``loop-other`` (a loop whose iterable mentions
    ``self.p`` in another form) or ``marker`` (an ``annot.boundary()`` call).
    """

    kind: str
    path: str
    node: cst.CSTNode
    item: int
    context: Optional[str]
    start: Optional[int] = 0  # enumerate's start (None: not a literal)
    breaks: bool = False  # a loop whose body has its own ``break``


def _module_list(seq: cst.BaseExpression, self_name: str) -> Optional[str]:
    """The path of a module list a loop iterates from its first element:
    ``self.h`` and a prefix of it whose length is an int literal or a setting
    on ``self`` (HF's ``self.layers[: self.config.num_hidden_layers]``; each
    stage's piece reads it again, so not a local the loop may change), whose
    element ``i`` is ``self.h[i]``; else None."""
    path = self_path(seq, self_name)
    if path is not None:
        return path
    if isinstance(seq, cst.Subscript) and len(seq.slice) == 1:
        sl = seq.slice[0].slice
        if (
            isinstance(sl, cst.Slice)
            and sl.step is None
            and (sl.lower is None or (isinstance(sl.lower, cst.Integer) and sl.lower.value == "0"))
            and (  # read again by every stage's piece: a literal or a setting on self
                isinstance(sl.upper, cst.Integer)
                or (sl.upper is not None and self_path(sl.upper, self_name, ints=False))
            )
        ):
            return self_path(seq.value, self_name)
    return None


def loop_target(iter_: cst.BaseExpression, self_name: str) -> Optional[tuple[str, Optional[int]]]:
    """``self.h`` -> ("h", 0); ``enumerate(self.h, 1)`` -> ("h", 1); a prefix
    ``self.h[:n]`` as ``self.h``; else None."""
    path = _module_list(iter_, self_name)
    if path is not None:
        return path, 0
    if (
        isinstance(iter_, cst.Call)
        and isinstance(iter_.func, cst.Name)
        and iter_.func.value == "enumerate"
        and iter_.args
        and iter_.args[0].keyword is None
        and not iter_.args[0].star
        and len(iter_.args) <= 2
    ):
        path = _module_list(iter_.args[0].value, self_name)
        if path is None:
            return None
        if len(iter_.args) == 1:
            return path, 0
        start = iter_.args[1]
        if start.star or (start.keyword is not None and start.keyword.value != "start"):
            return None
        return path, int(start.value.evaluated_value) if isinstance(
            start.value, cst.Integer
        ) else None
    return None


class Uses(cst.CSTVisitor):
    """Collect the :class:`Use` records of one top-level statement of forward,
    each with the construct it is nested in (None at the top level)."""

    def __init__(self, self_name: str, item: int, qnames: Mapping) -> None:
        super().__init__()
        self.self_name = self_name
        self.item = item
        self.qnames = qnames
        self.ctx: list[str] = []
        self.uses: list[Use] = []

    def _context(self) -> Optional[str]:
        return self.ctx[-1] if self.ctx else None

    def _add(
        self, kind: str, path: str, node: cst.CSTNode, start: Optional[int] = 0, breaks=False
    ) -> None:
        self.uses.append(Use(kind, path, node, self.item, self._context(), start, breaks))

    def _nested(self, what: str, *parts: Optional[cst.CSTNode]) -> None:
        self.ctx.append(what)
        for p in parts:
            if p is not None:
                p.visit(self)
        self.ctx.pop()

    def _loop(self, node: cst.CSTNode, iter_: cst.BaseExpression) -> None:
        hit = loop_target(iter_, self.self_name)
        if hit is not None:
            breaks = isinstance(node, cst.For) and bool(loop_breaks(node.body))
            self._add("loop", hit[0], node, hit[1], breaks)
            return
        paths = SelfPaths(self.self_name)
        iter_.visit(paths)
        for p in paths.found:
            self._add("loop-other", re.sub(r"\[.*$", "", p), iter_)

    def visit_Call(self, node: cst.Call) -> None:
        if has_qualified_name(qualified(self.qnames, node.func), BOUNDARY_NAMES):
            self._add("marker", "", node)
            return
        path = self_path(node.func, self.self_name)
        if path is not None:
            self._add("call", path, node)

    def visit_If(self, node: cst.If) -> bool:
        node.test.visit(self)
        self._nested("an `if` branch", node.body, node.orelse)
        return False

    def visit_For(self, node: cst.For) -> bool:
        self._loop(node, node.iter)
        node.iter.visit(self)
        self._nested("the body of a `for` loop", node.body, node.orelse)
        return False

    def visit_While(self, node: cst.While) -> bool:
        self._nested("a `while` loop", node.test, node.body, node.orelse)
        return False

    def visit_With(self, node: cst.With) -> bool:
        for item in node.items:
            item.visit(self)
        self._nested("a `with` block", node.body)
        return False

    def visit_Try(self, node: cst.Try) -> bool:
        self._nested("a `try` statement", node.body, *node.handlers, node.orelse, node.finalbody)
        return False

    def visit_TryStar(self, node: cst.TryStar) -> bool:
        self._nested("a `try` statement", node.body, *node.handlers, node.orelse, node.finalbody)
        return False

    def visit_Match(self, node: cst.Match) -> bool:
        node.subject.visit(self)
        self._nested("a `match` case", *node.cases)
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self._nested("a nested function", *node.children)
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self._nested("a nested class", *node.children)
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        self._nested("a lambda", *node.children)
        return False

    def _comprehension(self, node: cst.BaseComp) -> bool:
        self.ctx.append("a comprehension")
        comp: Optional[cst.CompFor] = node.for_in
        while comp is not None:
            self._loop(comp, comp.iter)
            comp = comp.inner_for_in
        for child in node.children:
            child.visit(self)
        self.ctx.pop()
        return False

    def visit_ListComp(self, node: cst.ListComp) -> bool:
        return self._comprehension(node)

    def visit_SetComp(self, node: cst.SetComp) -> bool:
        return self._comprehension(node)

    def visit_DictComp(self, node: cst.DictComp) -> bool:
        return self._comprehension(node)

    def visit_GeneratorExp(self, node: cst.GeneratorExp) -> bool:
        return self._comprehension(node)


def uses_in(stmts: Sequence[cst.CSTNode], self_name: str, qnames: Mapping) -> list[Use]:
    """The :class:`Use` records of a body's top-level statements, item by item."""
    out: list[Use] = []
    for i, stmt in enumerate(stmts):
        collector = Uses(self_name, i, qnames)
        stmt.visit(collector)
        out += collector.uses
    return out


@dataclass(frozen=True)
class Placement:
    """Where a boundary naming a module path would begin a stage: before top-level
    statement ``use.item`` (``element`` 0) or at iteration ``element`` of the loop
    ``use`` is. ``problem`` says why it cannot: ``loop-other`` (the loop iterates
    another form of the list), ``nested`` (first used inside a branch, loop, ...),
    ``start`` (enumerate's start is not an int literal); None when it can."""

    use: Use
    element: int
    problem: Optional[str] = None


def place_boundary(uses: Sequence[Use], path: str) -> Optional[Placement]:
    """The rule that decides where forward can be cut, shared by the splitter
    (which refuses a problem with its reason) and the planner (which proposes
    only the paths that have none): the first use of ``path``, or of the module
    list whose element it names. None: forward never uses it."""
    for use in uses:
        element: Optional[int] = None
        if use.kind == "call" and use.path == path:
            element = 0
        elif use.kind in ("loop", "loop-other"):
            rest = path[len(use.path) + 1 :]
            if path == use.path:
                element = 0
            elif path.startswith(use.path + ".") and rest.isascii() and rest.isdigit():
                element = int(rest)
                if use.kind == "loop-other":
                    return Placement(use, element, "loop-other")
        if element is None:
            continue
        if use.context is not None:
            return Placement(use, element, "nested")
        if element and use.start is None:
            return Placement(use, element, "start")
        return Placement(use, element)
    return None


# ---- a loop split across stages -------------------------------------------------


class _Breaks(cst.CSTVisitor):
    """``break`` statements that belong to one loop body (not to loops nested in it)."""

    def __init__(self) -> None:
        super().__init__()
        self.breaks: list[cst.Break] = []

    def visit_For(self, node: cst.For) -> bool:
        return False

    def visit_While(self, node: cst.While) -> bool:
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_Break(self, node: cst.Break) -> None:
        self.breaks.append(node)


def loop_breaks(body: cst.CSTNode) -> list[cst.Break]:
    """The ``break`` statements of one loop body (not of loops nested in it)."""
    finder = _Breaks()
    body.visit(finder)
    return finder.breaks


def piece_iter(iter_: cst.BaseExpression, start: int, stop: Optional[int]) -> cst.BaseExpression:
    """``self.h`` -> ``[*self.h][start:stop]``; ``enumerate(self.h, s)`` ->
    ``enumerate([*self.h][start:stop], s + start)``; a prefix
    ``self.h[:n]`` -> ``[*self.h[:n]][start:stop]``. A list of the modules,
    not ``self.h[start:stop]``: slicing an ``nn.ModuleList`` builds a new
    ModuleList (a Module's ``__init__`` and an ``add_module`` per layer,
    about 9 us warm) on every call of the stage; and a list display, not
    ``list(...)``, which a local or argument named ``list`` would shadow."""

    def sliced(seq: cst.BaseExpression) -> cst.Subscript:
        lower = cst.Integer(str(start)) if start else None
        upper = cst.Integer(str(stop)) if stop is not None else None
        listed = cst.List(elements=[cst.StarredElement(value=seq)])
        return cst.Subscript(
            value=listed, slice=[cst.SubscriptElement(slice=cst.Slice(lower=lower, upper=upper))]
        )

    if not isinstance(iter_, cst.Call):
        return sliced(iter_)
    args = list(iter_.args)
    first = args[0].with_changes(value=sliced(args[0].value))
    base = int(cst.ensure_type(args[1].value, cst.Integer).evaluated_value) if len(args) > 1 else 0
    if base + start == 0:
        rest: list[cst.Arg] = []
    elif len(args) > 1:
        rest = [args[1].with_changes(value=cst.Integer(str(base + start)))]
    else:
        rest = [cst.Arg(cst.Integer(str(base + start)))]
    if rest:
        first = first.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    else:
        first = first.with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return iter_.with_changes(args=[first, *rest])
