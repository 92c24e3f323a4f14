"""The plan of a stage split: where each boundary cuts ``forward`` and what
crosses each cut (analysis only; :mod:`annot.rewriters.split.stage_methods` writes
the code).

:class:`Splitter` checks one class's forward, places the boundaries by
:func:`annot.rewriters.split.boundaries.place_boundary`, refuses what cannot be
split safely (a :class:`RewriteError` at ``file:line:col`` that says how to
fix it), cuts forward into units (top-level statements, and the pieces of a
loop split across stages) and computes with :mod:`annot.rewriters.analysis.liveness`
(over the effects of :mod:`annot.rewriters.analysis.statement_effects`) the names that
cross each boundary: a :class:`ForwardStages`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import libcst as cst
from libcst.metadata import MetadataWrapper, QualifiedNameProvider

from annot.core.errors import RewriteError
from annot.rewriters.analysis.liveness import (
    Crossing,
    Effects,
    crossings,
    live_sets,
    loop_piece_effects,
)
from annot.rewriters.analysis.statement_effects import (
    block_effects,
    expression_effects,
    free_names,
    param_names,
    statement_effects,
    target_effects,
)
from annot.rewriters.source.diagnostics import Locator, node_source
from annot.rewriters.split.boundaries import (
    Use,
    Uses,
    loop_breaks,
    piece_iter,
    place_boundary,
    uses_in,
)
from annot.rewriters.split.forward_body import (
    Closures,
    ForwardScope,
    first_name,
    forward_statements,
    returns_in,
)
from annot.rewriters.split.nested_calls import Callee, call_pieces, callee_of, stage_prefix

__all__ = ["STAGE_PREFIX", "Inner", "ForwardStages", "Splitter"]

STAGE_PREFIX = "_annot_stage_"


@dataclass(frozen=True, eq=False)
class _Cut:
    """A stage begins before item ``item`` (``element == 0``) or at element
    ``element`` of the loop that item ``item`` is."""

    item: int
    element: int
    label: str
    node: Optional[cst.CSTNode]  # where to point an error about this boundary
    below: Optional[tuple[Callee, str, cst.Call]] = None  # a cut inside the call of item


@dataclass(frozen=True, eq=False)
class Inner:
    """Boundaries below a call: item ``item`` calls ``callee``, which is split at
    ``boundaries`` (paths relative to it) into ``len(boundaries) + 1`` parts."""

    item: int
    callee: Callee
    boundaries: tuple[str, ...]
    node: cst.Call


def _names(fn: cst.FunctionDef) -> set[str]:
    """Every name a function's code mentions."""
    found: set[str] = set()

    class _All(cst.CSTVisitor):
        def visit_Name(self, node: cst.Name) -> None:
            found.add(node.value)

    fn.visit(_All())
    return found


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
class ForwardStages:
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
    inner: list[Inner]


class Splitter:
    """Plans the stages of one class's forward (analysis only; no output)."""

    def __init__(
        self,
        wrapper: MetadataWrapper,
        cls: cst.ClassDef,
        path: str,
        *,
        method: str = "forward",
        nested: bool = False,
    ) -> None:
        """Plan ``cls.<method>``. ``nested``: follow a boundary below a call of a
        submodule or helper method (:mod:`annot.rewriters.split.nested_calls`);
        without it such a boundary is refused (the runtime cuts those stages at
        run time instead)."""
        self.cls = cls
        self.path = path
        self.method = method
        self.prefix = stage_prefix(method)
        self.nested = nested
        self.module = wrapper.module
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
            and f.name.value != method
            and not f.name.value.startswith("_annot_")
            and not f.decorators  # plain methods only (no static/class methods, properties)
        }
        self.method_uses: dict[str, list[Use]] = {}  # a helper method's, once each
        params = param_names(self.forward.params)
        self.params = tuple(p for p in params if p != self.self_name)
        self.uses: list[Use] = []  # filled by _items_and_markers

    def error(self, node: Optional[cst.CSTNode], reason: str) -> RewriteError:
        return self.locate.error(node if node is not None else self.forward, reason)

    def line(self, node: cst.CSTNode) -> int:
        return self.locate.line(node)

    def _find_forward(self) -> cst.FunctionDef:
        for stmt in self.cls.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == self.method:
                if stmt.asynchronous is not None:
                    raise self.locate.error(
                        stmt,
                        "`async def forward` cannot be split into pipeline stages; "
                        "make forward a plain method",
                    )
                return stmt
        if self.method != "forward" or self.nested:
            raise self.locate.error(
                self.cls,
                f"class {self.cls.name.value} has no {self.method} method in its body (one "
                "inherited from a class in another file is not rewritten); place the "
                "boundary where its source is, or let annot cut the stages at run time: "
                "annot.parallelize(..., split=[...])",
            )
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
        stmts = forward_statements(self.forward.body)
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
                if cst.ensure_type(m.node, cst.Call).args:  # a marker's node is its call
                    raise self.error(m.node, "annot.boundary() takes no arguments")
            if lone:
                assert isinstance(stmt, cst.SimpleStatementLine)  # lone says so
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
        if self.nested:
            below = self._below_call(path, node)
            if below is not None:
                return below
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

    def _reaches(self, fn: cst.FunctionDef, path: str, seen: frozenset) -> bool:
        """Whether helper method ``fn`` calls or loops over ``path`` (or a module
        above it), directly or through another helper method."""
        positional = [*fn.params.posonly_params, *fn.params.params]
        if not positional or fn.name.value in seen:
            return False
        uses = self.method_uses.get(fn.name.value)
        if uses is None:
            stmts = forward_statements(fn.body)
            uses = self.method_uses[fn.name.value] = uses_in(
                stmts, positional[0].name.value, self.qnames
            )
        if place_boundary(uses, path) is not None:
            return True
        for u in uses:
            if u.kind == "call" and u.path in self.methods:
                if self._reaches(self.methods[u.path], path, seen | {fn.name.value}):
                    return True
            elif u.kind in ("call", "loop") and path.startswith(u.path + "."):
                return True
        return False

    def _below_call(self, path: str, node: Optional[cst.CSTNode]) -> Optional[_Cut]:
        """A boundary below a call of forward: inside a submodule's forward
        (``"model.layers.2"`` below ``self.model(...)``), a helper method's
        body, or an nn.Sequential called whole; None if no call leads there."""
        for use in self.uses:
            if use.kind == "loop" and path.startswith(use.path + "."):
                element, _, deeper = path[len(use.path) + 1 :].partition(".")
                if element.isascii() and element.isdigit() and deeper:
                    raise self.error(
                        use.node,
                        f"boundary {path!r} is inside element {element} of the loop over "
                        f"self.{use.path}; in source annot cuts a loop between its elements "
                        f"({use.path + '.' + element!r}). A boundary inside a block is cut at "
                        "run time: annot.parallelize(..., split=[...])",
                    )
            if use.kind != "call":
                continue
            if use.path in self.methods:
                if not self._reaches(self.methods[use.path], path, frozenset({self.method})):
                    continue
                callee, rest = Callee("method", use.path, self.cls), path
            elif path.startswith(use.path + "."):
                try:
                    callee = callee_of(self.module, self.qnames, self.cls, use.path)
                except ValueError as exc:
                    raise self.error(use.node, f"boundary {path!r}: {exc}") from None
                rest = path[len(use.path) + 1 :]
            else:
                continue
            if use.context is not None:
                raise self.error(
                    use.node,
                    f"boundary {path!r} lies below self.{use.path}(...), which is called inside "
                    f"{use.context}; a stage can only begin in a call made by a top-level "
                    f"statement of {self.method}",
                )
            return _Cut(
                use.item, 1, path, node, (callee, rest, cst.ensure_type(use.node, cst.Call))
            )
        return None

    def _number_below(self, cuts: list[_Cut]) -> tuple[list[_Cut], dict[int, Inner]]:
        """Number the cuts below each call: the ``j``-th boundary below a call
        begins part ``j + 1`` of the callee; and the calls cut below, by item.
        Refuses cuts below two calls of one statement, and for an
        nn.Sequential anything but its elements after the first, in order."""
        out: list[_Cut] = []
        inner: dict[int, Inner] = {}
        for cut in cuts:
            if cut.below is None:
                out.append(cut)
                continue
            callee, rest, call = cut.below
            have = inner.get(cut.item)
            if have is not None and have.callee.path != callee.path:
                raise self.error(
                    call,
                    f"boundary {cut.label!r} lies below self.{callee.path}(...) and another "
                    f"below self.{have.callee.path}(...), in the same statement; split the "
                    "statement in two",
                )
            rests = (*(have.boundaries if have else ()), rest)
            if callee.kind == "sequential":
                if not (rest.isascii() and rest.isdigit()):
                    raise self.error(
                        call,
                        f"boundary {cut.label!r}: self.{callee.path} is an nn.Sequential called "
                        f"whole; in source annot cuts it between its elements "
                        f"('{callee.path}.2'). A boundary inside an element is cut at run time: "
                        "annot.parallelize(..., split=[...])",
                    )
                if int(rest) == 0:
                    raise self.error(
                        call,
                        f"boundary {cut.label!r} is the first element of self.{callee.path}: "
                        f"name {callee.path!r} to begin the stage before the call",
                    )
                if list(map(int, rests)) != sorted(set(map(int, rests))):
                    raise self.error(
                        call,
                        f"boundaries below the nn.Sequential self.{callee.path} out of order or "
                        f"repeated: {list(rests)}; give its elements in increasing order",
                    )
            inner[cut.item] = Inner(cut.item, callee, rests, call)
            out.append(_Cut(cut.item, len(rests), cut.label, cut.node, cut.below))
        return out, inner

    def _cuts(
        self,
        boundaries: Sequence[tuple[str, Optional[cst.CSTNode]]],
        items: list[cst.BaseStatement],
        markers: list[_Cut],
    ) -> tuple[list[_Cut], dict[int, Inner]]:
        """All cuts in forward order, and the calls cut below (by item);
        refuses disorder, duplicates, empty stages."""
        resolved: list[_Cut] = []
        seen: dict[str, _Cut] = {}
        for path, node in boundaries:
            if path in seen:
                raise self.error(node, f"boundary {path!r} is given twice; give each once")
            seen[path] = self._resolve(path, node)
            resolved.append(seen[path])
        cuts: list[_Cut] = []
        numbered, inner = self._number_below(resolved)
        for cut in numbered:
            path, node = cut.label, cut.node
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
        return allcuts, inner

    # -- step 2: units and what crosses ----------------------------------------------

    def _units(
        self, items: list[cst.BaseStatement], cuts: list[_Cut], inner: dict[int, Inner]
    ) -> tuple[list[_Unit], list[int]]:
        """Items as units (split loops and cut calls as one unit per piece) and
        the unit index where each stage after the first begins."""
        units: list[_Unit] = []
        starts: list[int] = []  # unit index where each stage after the first begins
        names = frozenset(_names(self.forward)) if inner else frozenset()
        for i, stmt in enumerate(items):
            elements = [c.element for c in cuts if c.item == i and c.element > 0]
            if any(c.item == i and c.element == 0 for c in cuts):
                starts.append(len(units))
            if i in inner:
                below = inner[i]
                try:
                    pieces = call_pieces(
                        stmt, below.node, below.callee, self.self_name, below.boundaries, names
                    )
                except ValueError as exc:
                    raise self.error(
                        below.node, f"boundary {below.boundaries[0]!r}: {exc}"
                    ) from None
                for k, piece in enumerate(pieces):
                    if k:
                        starts.append(len(units))
                    units.append(_Unit(piece, i, statement_effects(piece)))
                continue
            if not elements:
                units.append(_Unit(stmt, i, statement_effects(stmt)))
                continue
            assert isinstance(stmt, cst.For)  # cut at an element: a loop's (_cuts)
            self._check_split_loop(stmt)
            stops: list[Optional[int]] = [*elements, None]
            for k, (a, b) in enumerate(zip([0, *elements], stops)):
                if k:
                    starts.append(len(units))
                last = b is None
                loop_piece = stmt.with_changes(
                    iter=piece_iter(stmt.iter, a, b), orelse=stmt.orelse if last else None
                )
                eff = loop_piece_effects(
                    expression_effects(loop_piece.iter),
                    target_effects(stmt.target),
                    block_effects(stmt.body),
                    block_effects(stmt.orelse.body) if last and stmt.orelse else None,
                )
                units.append(_Unit(loop_piece, i, eff, a, b))
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

    def plan(self, boundaries: Sequence[tuple[str, Optional[cst.CSTNode]]]) -> ForwardStages:
        """Check forward, place the boundaries and compute what crosses each."""
        scope = ForwardScope()
        self.forward.body.visit(scope)
        if scope.bad:
            node, reason = scope.bad[0]
            raise self.error(node, reason)
        items, markers, moved = self._items_and_markers()
        cuts, inner = self._cuts(boundaries, items, markers)
        units, starts = self._units(items, cuts, inner)
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
            assert isinstance(stmt, cst.For)  # split at an element: a loop
            names = target_effects(stmt.target).assigned
            after = set(live[pieces[-1] + 1]) & names
            if after:
                later_nodes = [u.node for u in units[pieces[-1] + 1 :]]
                use = first_name(later_nodes, after)
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
            rets = returns_in([units[u].node for u in range(a, b)])
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
            finder = Closures()
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
        return ForwardStages(
            units,
            ranges,
            [cross[s] for s in starts],
            cuts,
            moved,
            scope.returns,
            list(inner.values()),
        )
