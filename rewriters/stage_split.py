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

What crosses a boundary is computed by :mod:`annot.rewriters.liveness`: the names
defined before it and read after it, in order of first use after it.
Whatever cannot be split safely is refused with a :class:`RewriteError` at
``file:line:col`` that says how to fix it, never turned into wrong code.

:func:`split_decorated` applies every ``@stage`` class of a file (its
``split=[...]`` read literally) and replaces the decorator with a comment,
so running it again changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import libcst as cst
from libcst.metadata import MetadataWrapper, QualifiedNameProvider

from annot.errors import RewriteError
from annot.rewriters.diagnostics import Locator, node_source, parse_source
from annot.rewriters.hint_reader import (
    BOUNDARY_NAMES,
    STAGE_NAMES,
    find_hints,
    format_hint,
    has_qualified_name,
)
from annot.rewriters.liveness import (
    Crossing,
    Effects,
    block_effects,
    crossings,
    expression_effects,
    free_names,
    live_sets,
    loop_piece_effects,
    param_names,
    statement_effects,
    target_effects,
)

__all__ = ["StagePlan", "StageSplit", "split_decorated", "split_stages"]

STAGE_PREFIX = "_annot_stage_"


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage of ``forward``.

    ``inputs``: parameter names of the stage method (stage 0: forward's own
    signature, without ``self``). ``outputs``: the keys of the dict it
    returns, i.e. the next stage's inputs (None for the last stage, which
    returns forward's value). ``modules``: the ``self`` attribute paths the
    stage reads, as written (``"transformer.wte"``, ``"config"``), with loop
    slices as ``"transformer.h[0:2]"`` / ``"transformer.h[2:]"``.
    ``source``: the stage method's source.
    """

    index: int
    method: str
    inputs: tuple[str, ...]
    outputs: Optional[tuple[str, ...]]
    modules: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class StageSplit:
    """The result of :func:`split_stages`.

    ``source``: the whole module with the class rewritten. ``output_arity``:
    ``n`` if every ``return`` of forward returns a tuple literal of ``n``
    items, else None. ``boundaries``: where each stage after the first
    begins, in forward order (the paths given, and ``boundary()@LINE`` for
    ``annot.boundary()`` markers).
    """

    source: str
    stages: tuple[StagePlan, ...]
    output_arity: Optional[int]
    boundaries: tuple[str, ...] = ()


def _qualified(qnames: Mapping, node: cst.CSTNode) -> set:
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


class _SelfPaths(cst.CSTVisitor):
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
        base = self_path(node.value, self.self_name, ints=False)
        sl = _int_slice(node)
        if base is not None and sl is not None:
            self.found[base + sl] = None
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


def loop_target(iter_: cst.BaseExpression, self_name: str) -> Optional[tuple[str, Optional[int]]]:
    """``self.h`` -> ("h", 0); ``enumerate(self.h, 1)`` -> ("h", 1); else None."""
    path = self_path(iter_, self_name)
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
        path = self_path(iter_.args[0].value, self_name)
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
        paths = _SelfPaths(self.self_name)
        iter_.visit(paths)
        for p in paths.found:
            self._add("loop-other", re.sub(r"\[.*$", "", p), iter_)

    def visit_Call(self, node: cst.Call) -> None:
        if has_qualified_name(_qualified(self.qnames, node.func), BOUNDARY_NAMES):
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

    def _comprehension(self, node: cst.CSTNode) -> bool:
        self.ctx.append("a comprehension")
        comp = node.for_in
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
            elif path.startswith(use.path + ".") and rest.isdigit():
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


class _Scope(cst.CSTVisitor):
    """Constructs of forward's own scope that a split cannot keep:
    ``yield``, ``global``, ``nonlocal`` (also in nested functions), and
    ``return`` statements (collected, checked per stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.bad: list[tuple[cst.CSTNode, str]] = []
        self.returns: list[cst.Return] = []

    def _enter(self, node: cst.CSTNode) -> None:
        self.depth += 1

    def _leave(self, node: cst.CSTNode) -> None:
        self.depth -= 1

    visit_FunctionDef = visit_Lambda = visit_ClassDef = _enter
    leave_FunctionDef = leave_Lambda = leave_ClassDef = _leave

    def visit_Yield(self, node: cst.Yield) -> None:
        if self.depth == 0:
            self.bad.append(
                (
                    node,
                    "forward contains `yield`: a generator forward cannot be split into "
                    "pipeline stages; return the values instead",
                )
            )

    def visit_Global(self, node: cst.Global) -> None:
        if self.depth == 0:
            self.bad.append((node, _declaration_reason("global")))

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        self.bad.append((node, _declaration_reason("nonlocal")))

    def visit_Return(self, node: cst.Return) -> None:
        if self.depth == 0:
            self.returns.append(node)


def _declaration_reason(kw: str) -> str:
    return (
        f"`{kw}` statement in forward: pipeline stages are separate methods that pass "
        f"values to each other as arguments, so a `{kw}` name cannot be followed across "
        "a boundary; use a local variable (returned or passed along) or an attribute of self"
    )


def _returns_in(nodes: Sequence[cst.CSTNode]) -> list[cst.Return]:
    scope = _Scope()
    for n in nodes:
        n.visit(scope)
    return scope.returns


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


class _Closures(cst.CSTVisitor):
    """Nested functions and lambdas of forward's own scope."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[Union[cst.FunctionDef, cst.Lambda]] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.found.append(node)
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        self.found.append(node)
        return False


def _first_name(nodes: Sequence[cst.CSTNode], names: set[str]) -> Optional[cst.Name]:
    found: list[cst.Name] = []

    class _Find(cst.CSTVisitor):
        def visit_Name(self, node: cst.Name) -> None:
            if node.value in names and not found:
                found.append(node)

        def visit_Attribute(self, node: cst.Attribute) -> bool:
            node.value.visit(self)
            return False

    for n in nodes:
        n.visit(_Find())
    return found[0] if found else None


# ---- the plan -------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Cut:
    """A stage begins before item ``item`` (``element == 0``) or at element
    ``element`` of the loop that item ``item`` is."""

    item: int
    element: int
    label: str
    node: Optional[cst.CSTNode]  # where to point an error about this boundary


@dataclass(frozen=True, eq=False)
class _Unit:
    """A piece of forward's code that lies wholly in one stage: a top-level
    statement, or the iterations ``start:stop`` of a split loop."""

    node: cst.BaseStatement
    item: int
    effects: Effects
    start: Optional[int] = None  # None: a whole statement
    stop: Optional[int] = None


@dataclass(frozen=True, eq=False)
class _Plan:
    """Stage ``k`` runs ``units[ranges[k][0]:ranges[k][1]]`` and, unless it is
    the last, hands ``crossings[k]`` to stage ``k + 1``, which begins at
    ``cuts[k]``. ``moved``: comments of removed ``boundary()`` lines, by the
    item they now precede. ``returns``: forward's own ``return`` statements."""

    units: list[_Unit]
    ranges: list[tuple[int, int]]
    crossings: list[Crossing]
    cuts: list[_Cut]
    moved: dict[int, list[cst.EmptyLine]]
    returns: list[cst.Return]


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def _statements(body: cst.BaseSuite) -> list[cst.BaseStatement]:
    if isinstance(body, cst.SimpleStatementSuite):  # def forward(self, x): return x
        return [cst.SimpleStatementLine(body=body.body)]
    return list(body.body)


def _piece_iter(iter_: cst.BaseExpression, start: int, stop: Optional[int]) -> cst.BaseExpression:
    """``self.h`` -> ``self.h[start:stop]``; ``enumerate(self.h, s)`` ->
    ``enumerate(self.h[start:stop], s + start)``."""

    def sliced(seq: cst.BaseExpression) -> cst.Subscript:
        lower = cst.Integer(str(start)) if start else None
        upper = cst.Integer(str(stop)) if stop is not None else None
        return cst.Subscript(
            value=seq, slice=[cst.SubscriptElement(slice=cst.Slice(lower=lower, upper=upper))]
        )

    if not isinstance(iter_, cst.Call):
        return sliced(iter_)
    args = list(iter_.args)
    first = args[0].with_changes(value=sliced(args[0].value))
    base = int(args[1].value.evaluated_value) if len(args) > 1 else 0
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


class _Splitter:
    """Plans the stages of one class's forward (analysis only; no output)."""

    def __init__(self, wrapper: MetadataWrapper, cls: cst.ClassDef, path: str) -> None:
        self.cls = cls
        self.path = path
        self.locate = Locator(wrapper, path)
        self.qnames = wrapper.resolve(QualifiedNameProvider)
        self.forward = self._find_forward()
        positional = [*self.forward.params.posonly_params, *self.forward.params.params]
        if not positional:
            raise self.error(
                self.forward, "forward takes no `self` parameter; annot splits methods"
            )
        self.self_name = positional[0].name.value
        self.methods = {
            f.name.value: f
            for f in cls.body.body
            if isinstance(f, cst.FunctionDef)
            and f.name.value != "forward"
            and not f.name.value.startswith(STAGE_PREFIX)
            and not f.decorators  # plain methods only (no static/class methods, properties)
        }
        params = param_names(self.forward.params)
        self.params = tuple(p for p in params if p != self.self_name)
        self.uses: list[Use] = []  # filled by _items_and_markers

    def error(self, node: Optional[cst.CSTNode], reason: str) -> RewriteError:
        return self.locate.error(node if node is not None else self.forward, reason)

    def line(self, node: cst.CSTNode) -> int:
        return self.locate.line(node)

    def _find_forward(self) -> cst.FunctionDef:
        for stmt in self.cls.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                if stmt.asynchronous is not None:
                    raise self.locate.error(
                        stmt,
                        "`async def forward` cannot be split into pipeline stages; "
                        "make forward a plain method",
                    )
                return stmt
        raise self.locate.error(
            self.cls,
            f"class {self.cls.name.value} has no forward method in its body; @stage goes on "
            "the class whose forward is split (a forward inherited from a base class is not "
            "rewritten: put @stage on the base class)",
        )

    # -- step 1: where each boundary is ---------------------------------------------

    def _items_and_markers(self) -> tuple[list[cst.BaseStatement], list[_Cut], dict]:
        """Forward's top-level statements less its docstring and ``boundary()``
        lines (``items``), a cut for each of those lines, and their comments."""
        stmts = _statements(self.forward.body)
        if stmts and _is_docstring(stmts[0]):
            stmts = stmts[1:]
        items: list[cst.BaseStatement] = []
        markers: list[_Cut] = []
        moved: dict[int, list[cst.EmptyLine]] = {}  # comments of removed markers
        pending: list[cst.EmptyLine] = []
        for stmt in stmts:
            collector = Uses(self.self_name, len(items), self.qnames)
            stmt.visit(collector)
            marks = [u for u in collector.uses if u.kind == "marker"]
            lone = (
                isinstance(stmt, cst.SimpleStatementLine)
                and len(stmt.body) == 1
                and isinstance(stmt.body[0], cst.Expr)
                and len(marks) == 1
                and stmt.body[0].value is marks[0].node
            )
            for m in marks:
                if not lone:
                    where = f"inside {m.context}" if m.context else "inside another statement"
                    raise self.error(
                        m.node,
                        f"annot.boundary() {where}: a stage can only begin between top-level "
                        "statements of forward, so boundary() must be a statement on its own "
                        "line in forward's body (not in a branch, loop, with, try or expression)",
                    )
                if m.node.args:
                    raise self.error(m.node, "annot.boundary() takes no arguments")
            if lone:
                label = f"boundary()@{self.line(stmt)}"
                markers.append(_Cut(len(items), 0, label, stmt))
                pending += list(stmt.leading_lines)
                if stmt.trailing_whitespace.comment is not None:  # boundary()  # why
                    pending.append(cst.EmptyLine(comment=stmt.trailing_whitespace.comment))
                continue
            self.uses += collector.uses
            if pending:
                moved[len(items)] = pending
                pending = []
            items.append(stmt)
        return items, markers, moved

    def _resolve(self, path: str, node: Optional[cst.CSTNode]) -> _Cut:
        """Where the stage named by boundary ``path`` begins (its first use in forward)."""
        found = place_boundary(self.uses, path)
        if found is not None:
            use, element = found.use, found.element
            if found.problem == "loop-other":
                raise self.error(
                    use.node,
                    f"boundary {path!r}: forward loops over `{node_source(use.node)}`; "
                    "annot can cut a loop only when it iterates the module list "
                    f"itself: write `for block in self.{use.path}:` or `for i, block "
                    f"in enumerate(self.{use.path}):` (annot slices it per stage)",
                )
            if found.problem == "nested":
                what = "called" if use.kind == "call" else "looped over"
                raise self.error(
                    use.node,
                    f"boundary {path!r}: self.{use.path} is first {what} inside {use.context}; "
                    "a stage can only begin before a top-level statement of forward. Split "
                    "at a module called at the top level of forward, or put "
                    "`annot.boundary()` on its own line before the enclosing statement",
                )
            if found.problem == "start":
                raise self.error(
                    use.node,
                    f"boundary {path!r}: the loop over self.{use.path} uses enumerate() with a "
                    "start that is not an int literal; annot shifts the start of each stage's "
                    f"slice, so write `enumerate(self.{use.path})` or `enumerate(self.{use.path}, "
                    "1)`",
                )
            return _Cut(use.item, element, path, node)
        called = []
        for u in self.uses:
            if u.kind == "call":
                called.append(u.path)
            elif u.kind == "loop":
                called.append(f"{u.path} (looped over)")
        listing = ", ".join(dict.fromkeys(called)) or "nothing"
        raise self.error(
            node,
            f"boundary {path!r}: forward never calls self.{path}. A boundary names a "
            "submodule called by a top-level statement of forward, an element of a module "
            "list forward loops over (e.g. 'h.2'), or use annot.boundary() in forward. "
            f"forward of {self.cls.name.value} calls: {listing}",
        )

    def _cuts(
        self,
        boundaries: Sequence[tuple[str, Optional[cst.CSTNode]]],
        items: list[cst.BaseStatement],
        markers: list[_Cut],
    ) -> list[_Cut]:
        """All cuts in forward order; refuses disorder, duplicates, empty stages."""
        cuts: list[_Cut] = []
        seen: dict[str, _Cut] = {}
        for path, node in boundaries:
            if path in seen:
                raise self.error(node, f"boundary {path!r} is given twice; give each once")
            cut = self._resolve(path, node)
            seen[path] = cut
            if cuts:
                prev = cuts[-1]
                if (cut.item, cut.element) < (prev.item, prev.element):
                    order = sorted(cuts + [cut], key=lambda c: (c.item, c.element))
                    raise self.error(
                        node,
                        f"boundaries out of forward order: {path!r} (line "
                        f"{self.line(items[cut.item])}) runs before {prev.label!r} (line "
                        f"{self.line(items[prev.item])}); list them in the order forward runs "
                        f"them: {[c.label for c in order]}",
                    )
            cuts.append(cut)
        allcuts = sorted(cuts + markers, key=lambda c: (c.item, c.element))
        for a, b in zip(allcuts, allcuts[1:]):
            if (a.item, a.element) == (b.item, b.element):
                line = self.line(items[a.item]) if a.item < len(items) else 0
                raise self.error(
                    b.node,
                    f"boundaries {a.label!r} and {b.label!r} both begin a stage before line "
                    f"{line}, which would leave a stage empty; drop one of them",
                )
        if allcuts and (allcuts[0].item, allcuts[0].element) == (0, 0):
            c = allcuts[0]
            raise self.error(
                c.node,
                f"boundary {c.label!r} begins a stage before the first statement of forward, "
                "leaving stage 0 empty; drop it (stage 0 then runs up to the next boundary)",
            )
        if allcuts and allcuts[-1].item >= len(items):
            c = allcuts[-1]
            raise self.error(
                c.node,
                f"boundary {c.label!r} is after the last statement of forward, leaving the "
                "last stage empty; remove it",
            )
        return allcuts

    # -- step 2: units and what crosses ----------------------------------------------

    def _units(
        self, items: list[cst.BaseStatement], cuts: list[_Cut]
    ) -> tuple[list[_Unit], list[int]]:
        """Items as units (split loops as one unit per piece) and the unit
        index where each stage after the first begins."""
        units: list[_Unit] = []
        starts: list[int] = []  # unit index where each stage after the first begins
        for i, stmt in enumerate(items):
            elements = [c.element for c in cuts if c.item == i and c.element > 0]
            if any(c.item == i and c.element == 0 for c in cuts):
                starts.append(len(units))
            if not elements:
                units.append(_Unit(stmt, i, statement_effects(stmt)))
                continue
            self._check_split_loop(stmt)
            bounds = [0, *elements, None]
            for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
                if k:
                    starts.append(len(units))
                last = b is None
                piece = stmt.with_changes(
                    iter=_piece_iter(stmt.iter, a, b), orelse=stmt.orelse if last else None
                )
                eff = loop_piece_effects(
                    expression_effects(piece.iter),
                    target_effects(stmt.target),
                    block_effects(stmt.body),
                    block_effects(stmt.orelse.body) if last and stmt.orelse else None,
                )
                units.append(_Unit(piece, i, eff, a, b))
        return units, starts

    def _check_split_loop(self, loop: cst.For) -> None:
        breaks = loop_breaks(loop.body)
        if breaks:
            raise self.error(
                breaks[0],
                "`break` in a loop that is split into stages: a later stage would still run "
                "its part of the loop. Split the loop only if it always runs to the end, or "
                "place the boundary outside this loop",
            )
        if loop.asynchronous is not None:
            raise self.error(loop, "an `async for` loop cannot be split into stages")

    def plan(self, boundaries: Sequence[tuple[str, Optional[cst.CSTNode]]]) -> _Plan:
        """Check forward, place the boundaries and compute what crosses each."""
        scope = _Scope()
        self.forward.body.visit(scope)
        if scope.bad:
            node, reason = scope.bad[0]
            raise self.error(node, reason)
        items, markers, moved = self._items_and_markers()
        cuts = self._cuts(boundaries, items, markers)
        units, starts = self._units(items, cuts)
        effects = [u.effects for u in units]
        cross = crossings(effects, self.params)
        live = live_sets(effects)
        ranges = list(zip([0, *starts], [*starts, len(units)]))
        stage_of = {u: s for s, (a, b) in enumerate(ranges) for u in range(a, b)}

        # a split loop's variable must not be read after the loop
        for i, stmt in enumerate(items):
            pieces = [k for k, u in enumerate(units) if u.item == i and u.start is not None]
            if not pieces:
                continue
            names = target_effects(stmt.target).assigned
            after = set(live[pieces[-1] + 1]) & names
            if after:
                later = [u.node for u in units[pieces[-1] + 1 :]]
                use = _first_name(later, after)
                v = sorted(after)[0] if use is None else use.value
                raise self.error(
                    use,
                    f"loop variable {v!r} of the loop over `{node_source(stmt.iter)}` is read "
                    "after the loop, but that loop is split across stages, so its last value "
                    "stays in another stage. Copy it inside the loop body (e.g. "
                    f"`last = {v}`) and read that after the loop",
                )

        # only the last stage may return
        for k, (a, b) in enumerate(ranges[:-1]):
            rets = _returns_in([units[u].node for u in range(a, b)])
            if rets:
                nxt = cuts[k]
                raise self.error(
                    rets[0],
                    f"`return` in stage {k} of {len(ranges)}, before the boundary "
                    f"{nxt.label!r}: only the last stage may return (a later stage would run "
                    "anyway). Move the early return after the last boundary, or set a "
                    "variable and return it at the end of forward",
                )

        # a closure reads its defining stage's frame; refuse names a later stage rebinds
        for u, unit in enumerate(units):
            finder = _Closures()
            unit.node.visit(finder)
            later = set().union(
                *(units[v].effects.assigned for v in range(len(units)) if stage_of[v] > stage_of[u])
            )
            for fn in finder.found:
                bad = [n for n in free_names(fn) if n in later]
                if bad:
                    raise self.error(
                        fn,
                        f"this {'lambda' if isinstance(fn, cst.Lambda) else 'nested function'} "
                        f"in stage {stage_of[u]} reads {bad[0]!r}, which a later stage assigns; "
                        "after the split it would still see the old value. Pass it as an "
                        "argument, or define the function after the last boundary",
                    )
        return _Plan(units, ranges, [cross[s] for s in starts], cuts, moved, scope.returns)


# ---- building the stage methods -------------------------------------------------


def _strip_blank(lines: Sequence[cst.EmptyLine]) -> list[cst.EmptyLine]:
    lines = list(lines)
    while lines and lines[0].comment is None:
        lines.pop(0)
    return lines


def _return_dict(names: Sequence[str], maybe: frozenset) -> cst.SimpleStatementLine:
    items = ", ".join(f'"{n}": locals().get("{n}")' if n in maybe else f'"{n}": {n}' for n in names)
    stmt = cst.ensure_type(cst.parse_statement(f"return {{{items}}}\n"), cst.SimpleStatementLine)
    if maybe:
        listed = ", ".join(n for n in names if n in maybe)
        comment = cst.EmptyLine(
            comment=cst.Comment(
                f"# annot: {listed} may be unassigned here (assigned on some paths only); "
                "None is sent then"
            )
        )
        stmt = stmt.with_changes(leading_lines=[comment])
    return stmt


def _output_arity(returns: Sequence[cst.Return]) -> Optional[int]:
    arities = set()
    for r in returns:
        if not isinstance(r.value, cst.Tuple) or any(
            isinstance(e, cst.StarredElement) for e in r.value.elements
        ):
            return None
        arities.add(len(r.value.elements))
    return arities.pop() if len(arities) == 1 else None


def _with_methods(found: Mapping[str, None], methods: Mapping[str, cst.FunctionDef]):
    """``found`` plus what the class's own methods that it calls read from
    ``self`` (``self.head(x)`` uses ``lm_head`` when ``head`` does), transitively."""
    out = dict(found)
    todo = [p for p in found if p in methods]
    seen: set[str] = set()
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        fn = methods[name]
        positional = [*fn.params.posonly_params, *fn.params.params]
        if not positional:
            continue
        inner = _SelfPaths(positional[0].name.value)
        fn.body.visit(inner)
        for p in inner.found:
            out.setdefault(p, None)
            if p in methods:
                todo.append(p)
    return tuple(out)


def _build_stages(sp: _Splitter, plan: _Plan) -> list[tuple[cst.FunctionDef, StagePlan]]:
    fwd = sp.forward
    units = plan.units
    ranges = plan.ranges
    out = []
    for k, (a, b) in enumerate(ranges):
        body: list[cst.BaseStatement] = []
        for u in range(a, b):
            node = units[u].node
            extra = plan.moved.get(units[u].item) if units[u].start in (None, 0) else None
            if extra:
                node = node.with_changes(leading_lines=[*extra, *node.leading_lines])
            body.append(node)
        body[0] = body[0].with_changes(leading_lines=_strip_blank(body[0].leading_lines))
        last = k == len(ranges) - 1
        if k == 0:
            params = fwd.params
            inputs = sp.params
        else:
            inputs = plan.crossings[k - 1].names
            params = cst.Parameters(
                params=[cst.Param(cst.Name(n)) for n in (sp.self_name, *inputs)]
            )
        outputs = None
        if not last:
            cr = plan.crossings[k]
            outputs = cr.names
            body.append(_return_dict(cr.names, cr.maybe_unbound))
        func = cst.FunctionDef(
            name=cst.Name(f"{STAGE_PREFIX}{k}"),
            params=params,
            body=fwd.body.with_changes(body=body, header=cst.TrailingWhitespace(), footer=())
            if isinstance(fwd.body, cst.IndentedBlock)
            else cst.IndentedBlock(body=body),
            decorators=fwd.decorators,
            returns=fwd.returns if last else None,
            leading_lines=[cst.EmptyLine(indent=False)],
        )
        paths = _SelfPaths(sp.self_name)
        for stmt in body:
            stmt.visit(paths)
        modules = _with_methods(paths.found, sp.methods)
        src = cst.Module(body=[func.with_changes(leading_lines=())]).code
        out.append((func, StagePlan(k, func.name.value, tuple(inputs), outputs, modules, src)))
    return out


# ---- the transform --------------------------------------------------------------


class StageSplitTransformer(cst.CSTTransformer):
    """Rewrites one class: removes its ``@stage`` decorator (leaving a comment),
    drops stage methods of an earlier run and adds ``stages`` after forward."""

    def __init__(
        self,
        cls: cst.ClassDef,
        stages: Sequence[cst.FunctionDef],
        decorator_index: Optional[int],
        decorator_comment: Optional[str],
        header: str,
    ) -> None:
        super().__init__()
        self.cls = cls
        self.stages = stages
        self.decorator_index = decorator_index
        self.decorator_comment = decorator_comment
        self.header = header

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        if original is not self.cls:
            return updated
        first = self.stages[0].with_changes(
            leading_lines=[
                cst.EmptyLine(indent=False),
                cst.EmptyLine(comment=cst.Comment(self.header)),
            ]
        )
        new_body: list[cst.BaseStatement] = []
        for stmt in updated.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value.startswith(STAGE_PREFIX):
                continue
            new_body.append(stmt)
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                new_body += [first, *self.stages[1:]]
        updated = updated.with_changes(body=updated.body.with_changes(body=new_body))
        return self._drop_decorator(updated)

    def _drop_decorator(self, cls: cst.ClassDef) -> cst.ClassDef:
        if self.decorator_comment is None or self.decorator_index is None:
            return cls
        decorators = list(cls.decorators)
        i = self.decorator_index
        dec = decorators.pop(i)
        lines = [*dec.leading_lines, cst.EmptyLine(comment=cst.Comment(self.decorator_comment))]
        if dec.trailing_whitespace.comment is not None:  # `@stage(...)  # why`
            lines.append(cst.EmptyLine(comment=dec.trailing_whitespace.comment))
        if i < len(decorators):
            decorators[i] = decorators[i].with_changes(
                leading_lines=[*lines, *decorators[i].leading_lines]
            )
            return cls.with_changes(decorators=decorators)
        return cls.with_changes(
            decorators=decorators, lines_after_decorators=[*lines, *cls.lines_after_decorators]
        )


def _stage_decorator(cls: cst.ClassDef, qnames: Mapping) -> Optional[int]:
    for i, dec in enumerate(cls.decorators):
        expr = dec.decorator
        func = expr.func if isinstance(expr, cst.Call) else expr
        if has_qualified_name(_qualified(qnames, func), STAGE_NAMES):
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


def _split(
    wrapper: MetadataWrapper,
    cls: cst.ClassDef,
    boundaries: Sequence[tuple[str, Optional[cst.CSTNode]]],
    path: str,
) -> StageSplit:
    sp = _Splitter(wrapper, cls, path)
    plan = sp.plan(boundaries)
    built = _build_stages(sp, plan)
    labels = tuple(c.label for c in plan.cuts)
    n = len(built)
    header = (
        f"# annot: pipeline stages of forward (boundaries: {', '.join(labels)})"
        if labels
        else "# annot: pipeline stages of forward (one stage: no boundaries)"
    )
    qnames = sp.qnames
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
    transformer = StageSplitTransformer(cls, [f for f, _ in built], idx, comment, header)
    source = wrapper.module.visit(transformer).code
    return StageSplit(source, tuple(p for _, p in built), _output_arity(plan.returns), labels)


def split_stages(
    source: str, class_name: str, boundaries: Sequence[str], *, path: str = "<string>"
) -> StageSplit:
    """Split ``class_name``'s forward in ``source`` at ``boundaries`` (module
    paths where a new stage begins, in forward order; ``annot.boundary()``
    statements in forward are boundaries too). k boundaries give k + 1
    stages. Raises :class:`RewriteError` for what cannot be split safely.
    """
    wrapper = MetadataWrapper(parse_source(source, path))
    cls = _find_class(wrapper.module, class_name, path)
    return _split(wrapper, cls, [(b, None) for b in boundaries], path)


def split_decorated(
    source: str,
    *,
    path: str = "<string>",
    boundaries: Optional[Mapping[str, Sequence[str]]] = None,
) -> tuple[str, dict[str, StageSplit]]:
    """Apply every ``@stage`` class of ``source``: ``(new source, {class: split})``.

    Boundaries come from ``boundaries[class name]`` when given (how the
    runtime passes ``auto`` placements), else from the decorator's literal
    ``split=[...]`` (plus ``annot.boundary()`` markers). A file without
    ``@stage`` (e.g. one this already rewrote) is returned unchanged.
    """
    boundaries = dict(boundaries or {})
    wrapper = MetadataWrapper(parse_source(source, path))
    hints = find_hints(wrapper, "stage", path)
    results: dict[str, StageSplit] = {}
    # bottom-up, so the positions of classes still to do stay those of `source`
    for hint in reversed(hints):
        wrapper = MetadataWrapper(parse_source(source, path))
        cls = [h for h in find_hints(wrapper, "stage", path) if h.name == hint.name][-1]
        if hint.name in boundaries:
            given: list[tuple[str, Optional[cst.CSTNode]]] = [
                (b, None) for b in boundaries[hint.name]
            ]
        elif cls.spec.auto:
            raise Locator(wrapper, path).error(
                cls.decorator,
                f"@stage(auto=True) on {hint.name}: automatic boundaries are chosen from the "
                "built model; use annot.parallelize, or pass boundaries={"
                f"{hint.name!r}: [...]}} here",
            )
        else:
            given = [(b, n) for b, n in zip(cls.spec.split, _split_nodes(cls.decorator))]
        result = _split(wrapper, cls.node, given, path)
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
