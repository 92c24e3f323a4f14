"""Which local names are live, and which are defined, between statements.

The stage splitter cuts ``forward`` into stage methods; what one stage must
hand to the next is exactly the set of names that are *defined* before the
cut and *live* after it (read later before being unconditionally
reassigned). This module computes both over libcst statements, with no
knowledge of stages::

    units = [statement_effects(s) for s in func.body.body]
    for cut in crossings(units, params=("idx", "targets")):
        cut.names            # crossing values, in order of first use after the cut
        cut.maybe_unbound    # the ones assigned on some paths only

Each statement is summarised as an :class:`Effects`: its upward-exposed
reads (in source order) and, per name it touches, the set of ways the name
may end up (``B`` bound, ``D`` deleted, ``U`` untouched). Branches merge
those sets, so a name assigned in one branch only is *maybe* defined;
loops add ``U`` (they may run zero times); ``return`` / ``raise`` paths are
dropped from what follows, ``break`` / ``continue`` paths are carried to the
end of their loop. The analysis is conservative: it may report a value that
is not needed, never drop one that is.

Scopes follow Python: comprehension targets and lambda / nested ``def``
parameters are local to them, their free names count as reads where they
are defined (a walrus in a comprehension binds in the function), and a name
never assigned in the function (``torch``, ``F``, builtins) is never
defined, so it never crosses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

import libcst as cst

__all__ = [
    "EMPTY",
    "Crossing",
    "Effects",
    "block_effects",
    "crossings",
    "expression_effects",
    "free_names",
    "function_crossings",
    "live_sets",
    "loop_piece_effects",
    "param_names",
    "sequence",
    "statement_effects",
    "target_effects",
]

Status = Mapping[str, frozenset]
_U = frozenset("U")
_B = frozenset("B")
_D = frozenset("D")
_BU = frozenset("BU")


def _ordered(*parts: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for part in parts for n in part))


def _compose(first: Status, second: Status) -> dict[str, frozenset]:
    """Status after running ``first`` then ``second``."""
    out = dict(first)
    for name, s in second.items():
        out[name] = (s - _U) | first.get(name, _U) if "U" in s else s
    return out


def _merge(*alternatives: Status) -> dict[str, frozenset]:
    """Status after one of ``alternatives`` ran (a name one of them leaves alone is ``U`` there)."""
    names = _ordered(*(a.keys() for a in alternatives))
    return {n: frozenset().union(*(a.get(n, _U) for a in alternatives)) for n in names}


@dataclass(frozen=True, eq=False)
class Effects:
    """What running a piece of code does to the local names of its function.

    ``reads``: names read before this code (re)binds them, in source order.
    ``status``: for each name the code binds or deletes, the outcomes
    possible on the paths that reach its end: ``B`` (bound), ``D`` (deleted),
    ``U`` (left as it was). ``terminates``: no path reaches the end (every
    path returns, raises, breaks or continues). ``jumps``: the status on the
    paths that leave by ``break`` / ``continue`` (None when there are none).
    ``assigned``: every name bound or deleted anywhere (the code's locals).
    """

    reads: tuple[str, ...] = ()
    status: Status = field(default_factory=dict)
    terminates: bool = False
    jumps: Optional[Status] = None
    assigned: frozenset = frozenset()

    @property
    def binds(self) -> frozenset:
        """Names bound on every path that reaches the end."""
        return frozenset(n for n, s in self.status.items() if s == _B)

    @property
    def may_binds(self) -> frozenset:
        """Names bound on some path that reaches the end."""
        return frozenset(n for n, s in self.status.items() if "B" in s)

    @property
    def kills(self) -> frozenset:
        """Names whose earlier value is gone at the end (rebound or deleted on every path)."""
        return frozenset(n for n, s in self.status.items() if "U" not in s)


EMPTY = Effects()


def sequence(*parts: Effects) -> Effects:
    """The effects of running ``parts`` one after another."""
    out = EMPTY
    for b in parts:
        out = _then(out, b)
    return out


def _then(a: Effects, b: Effects) -> Effects:
    if a.terminates:  # b is unreachable; its names are still locals of the scope
        return Effects(a.reads, a.status, True, a.jumps, a.assigned | b.assigned)
    jumps = a.jumps
    if b.jumps is not None:
        later = _compose(a.status, b.jumps)
        jumps = later if jumps is None else _merge(jumps, later)
    kills = a.kills
    return Effects(
        _ordered(a.reads, (n for n in b.reads if n not in kills)),
        _compose(a.status, b.status),
        b.terminates,
        jumps,
        a.assigned | b.assigned,
    )


def _branch(*alternatives: Effects) -> Effects:
    """Exactly one of ``alternatives`` runs."""
    live = [a for a in alternatives if not a.terminates]
    jumps = [a.jumps for a in alternatives if a.jumps is not None]
    return Effects(
        _ordered(*(a.reads for a in alternatives)),
        _merge(*(a.status for a in live)) if live else {},
        not live,
        _merge(*jumps) if jumps else None,
        frozenset().union(*(a.assigned for a in alternatives)),
    )


def _iteration(body: Effects) -> Effects:
    """One loop iteration: it ends normally or by ``break`` / ``continue``."""
    ends = [] if body.terminates else [body.status]
    if body.jumps is not None:
        ends.append(body.jumps)
    return Effects(body.reads, _merge(*ends) if ends else {}, False, None, body.assigned)


def _repeat(body: Effects) -> Effects:
    """Zero or more iterations of ``body``."""
    it = _iteration(body)
    return Effects(it.reads, _merge({}, it.status), False, None, it.assigned)


def loop_piece_effects(
    iter_reads: Effects, target: Effects, body: Effects, orelse: Optional[Effects] = None
) -> Effects:
    """One or more iterations of a ``for`` loop (a piece of a split loop,
    which always runs at least once), then ``orelse`` if given."""
    once = _iteration(sequence(target, body))
    twice = _then(once, once)
    eff = Effects(once.reads, _merge(once.status, twice.status), False, None, once.assigned)
    return sequence(iter_reads, eff, orelse or EMPTY)


def _read(name: str) -> Effects:
    return Effects(reads=(name,))


def _bind(name: str, maybe: bool = False) -> Effects:
    return Effects(status={name: _BU if maybe else _B}, assigned=frozenset((name,)))


def _unbind(name: str) -> Effects:
    return Effects(reads=(name,), status={name: _D}, assigned=frozenset((name,)))


# ---- expressions ------------------------------------------------------------

_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)


def expression_effects(node: cst.CSTNode) -> Effects:
    """Reads (and walrus binds) of an expression, in evaluation order."""
    if isinstance(node, cst.Name):
        return _read(node.value)
    if isinstance(node, cst.Attribute):
        return expression_effects(node.value)
    if isinstance(node, cst.Arg):
        return expression_effects(node.value)
    if isinstance(node, cst.NamedExpr):
        return sequence(expression_effects(node.value), target_effects(node.target))
    if isinstance(node, cst.Lambda):
        return _lambda_effects(node)
    if isinstance(node, _COMPREHENSIONS):
        return _comprehension_effects(node)
    if isinstance(node, cst.IfExp):
        return sequence(
            expression_effects(node.test),
            _branch(expression_effects(node.body), expression_effects(node.orelse)),
        )
    if isinstance(node, cst.BooleanOperation):
        return sequence(
            expression_effects(node.left), _branch(expression_effects(node.right), EMPTY)
        )
    if isinstance(node, cst.Comparison):
        parts = [expression_effects(node.left)]
        for i, target in enumerate(node.comparisons):
            eff = expression_effects(target.comparator)
            parts.append(eff if i == 0 else _branch(eff, EMPTY))
        return sequence(*parts)
    return sequence(*(expression_effects(c) for c in node.children))


def target_effects(node: cst.CSTNode, *, delete: bool = False) -> Effects:
    """Binding (or ``del``) of an assignment target: names are bound, the
    bases of ``a.b`` / ``a[i]`` targets are read."""
    if isinstance(node, cst.Name):
        return _unbind(node.value) if delete else _bind(node.value)
    if isinstance(node, (cst.Tuple, cst.List)):
        return sequence(*(target_effects(el.value, delete=delete) for el in node.elements))
    if isinstance(node, cst.StarredElement):
        return target_effects(node.value, delete=delete)
    return expression_effects(node)  # Attribute / Subscript: reads only


def param_names(params: cst.Parameters) -> tuple[str, ...]:
    """Every parameter name, in signature order (``*args`` / ``**kw`` included)."""
    out = [p.name.value for p in params.posonly_params]
    out += [p.name.value for p in params.params]
    if isinstance(params.star_arg, cst.Param):
        out.append(params.star_arg.name.value)
    out += [p.name.value for p in params.kwonly_params]
    if params.star_kwarg is not None:
        out.append(params.star_kwarg.name.value)
    return tuple(out)


def _all_params(params: cst.Parameters) -> list[cst.Param]:
    out = [*params.posonly_params, *params.params]
    if isinstance(params.star_arg, cst.Param):
        out.append(params.star_arg)
    out += [*params.kwonly_params]
    if params.star_kwarg is not None:
        out.append(params.star_kwarg)
    return out


def free_names(node: Union[cst.FunctionDef, cst.Lambda]) -> tuple[str, ...]:
    """Names a nested function or lambda reads from its enclosing scope when
    it runs (``nonlocal`` names included), in source order."""
    if isinstance(node, cst.Lambda):
        body = expression_effects(node.body)
        local = set(param_names(node.params)) | body.assigned
        return tuple(n for n in body.reads if n not in local)
    body = block_effects(node.body)
    glob = _declared(node.body, cst.Global)
    nonlocal_ = _declared(node.body, cst.Nonlocal)
    local = (set(param_names(node.params)) | body.assigned) - nonlocal_.keys()
    return _ordered((n for n in body.reads if n not in local and n not in glob), nonlocal_)


def _lambda_effects(node: cst.Lambda) -> Effects:
    defaults = [expression_effects(p.default) for p in _all_params(node.params) if p.default]
    return sequence(*defaults, Effects(reads=free_names(node)))


def _comprehension_effects(node: cst.CSTNode) -> Effects:
    first = node.for_in
    parts: list[Effects] = []
    targets: set[str] = set()
    comp: Optional[cst.CompFor] = first
    while comp is not None:
        if comp is not first:
            parts.append(expression_effects(comp.iter))
        tgt = target_effects(comp.target)
        targets |= tgt.assigned
        parts.append(tgt)
        parts += [_branch(expression_effects(c.test), EMPTY) for c in comp.ifs]
        comp = comp.inner_for_in
    if isinstance(node, cst.DictComp):
        parts += [expression_effects(node.key), expression_effects(node.value)]
    else:
        parts.append(expression_effects(node.elt))
    inner = sequence(*parts)
    walrus = inner.assigned - targets  # PEP 572: binds in the enclosing function
    return sequence(
        expression_effects(first.iter),
        Effects(
            reads=tuple(n for n in inner.reads if n not in targets),
            status={n: _BU for n in walrus},
            assigned=frozenset(walrus),
        ),
    )


# ---- statements ---------------------------------------------------------------

Block = Union[cst.BaseSuite, Sequence[cst.CSTNode]]


def block_effects(block: Block) -> Effects:
    """Effects of a suite (``IndentedBlock`` / one-line suite) or a list of statements."""
    stmts = block.body if isinstance(block, cst.BaseSuite) else block
    return sequence(*(statement_effects(s) for s in stmts))


def _else(node: Optional[cst.CSTNode]) -> Effects:
    if node is None:
        return EMPTY
    if isinstance(node, cst.If):
        return statement_effects(node)
    return block_effects(node.body)


def _declared(body: cst.BaseSuite, kind: type) -> dict[str, None]:
    """Names declared ``global`` / ``nonlocal`` in a function body (not nested
    scopes), in source order (a dict used as an ordered set)."""
    found: dict[str, None] = {}

    class _Find(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return False

        def visit_ClassDef(self, node: cst.ClassDef) -> bool:
            return False

        def visit_Lambda(self, node: cst.Lambda) -> bool:
            return False

        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, kind):
                found.update(dict.fromkeys(n.name.value for n in node.names))
            return super().on_visit(node)

    body.visit(_Find())
    return found


def _function_effects(node: cst.FunctionDef) -> Effects:
    parts = [expression_effects(d.decorator) for d in node.decorators]
    for p in _all_params(node.params):
        if p.default is not None:
            parts.append(expression_effects(p.default))
        if p.annotation is not None:
            parts.append(expression_effects(p.annotation.annotation))
    if node.returns is not None:
        parts.append(expression_effects(node.returns.annotation))
    # a nonlocal name is assigned in the enclosing frame whenever the closure runs
    nonlocal_ = _declared(node.body, cst.Nonlocal)
    status = {n: _BU for n in nonlocal_}
    parts.append(Effects(reads=free_names(node), status=status, assigned=frozenset(nonlocal_)))
    parts.append(_bind(node.name.value))
    return sequence(*parts)


def _class_effects(node: cst.ClassDef) -> Effects:
    parts = [expression_effects(d.decorator) for d in node.decorators]
    parts += [expression_effects(a.value) for a in (*node.bases, *node.keywords)]
    body = block_effects(node.body)
    parts.append(Effects(reads=body.reads))  # conservative: class-body reads
    parts.append(_bind(node.name.value))
    return sequence(*parts)


def _import_effects(node: Union[cst.Import, cst.ImportFrom]) -> Effects:
    if isinstance(node.names, cst.ImportStar):
        return EMPTY
    binds = []
    for alias in node.names:
        if alias.asname is not None:
            binds.append(target_effects(alias.asname.name))
        elif isinstance(alias.name, cst.Name):
            binds.append(_bind(alias.name.value))
        else:  # import a.b.c binds a
            base: cst.BaseExpression = alias.name
            while isinstance(base, cst.Attribute):
                base = base.value
            binds.append(_bind(base.value))  # type: ignore[union-attr]
    return sequence(*binds)


def _try_effects(node: Union[cst.Try, cst.TryStar]) -> Effects:
    body = block_effects(node.body)
    normal = sequence(body, _else(node.orelse))
    # a handler starts after any prefix of the body ran
    partial = Effects(body.reads, _merge({}, body.status), False, body.jumps, body.assigned)
    handlers = []
    for h in node.handlers:
        parts = [partial]
        if h.type is not None:
            parts.append(expression_effects(h.type))
        name = h.name.name if h.name is not None else None
        if name is not None:
            parts.append(target_effects(name))
        parts.append(block_effects(h.body))
        if isinstance(name, cst.Name):  # `except E as e` deletes e at the end
            parts.append(Effects(status={name.value: _D}, assigned=frozenset((name.value,))))
        handlers.append(sequence(*parts))
    eff = _branch(normal, *handlers)
    if node.finalbody is not None:
        eff = sequence(eff, block_effects(node.finalbody.body))
    return eff


def _pattern_effects(node: cst.CSTNode) -> Effects:
    if isinstance(node, cst.MatchAs):
        inner = _pattern_effects(node.pattern) if node.pattern is not None else EMPTY
        return sequence(inner, target_effects(node.name) if node.name is not None else EMPTY)
    if isinstance(node, cst.MatchStar):
        return target_effects(node.name) if node.name is not None else EMPTY
    if isinstance(node, cst.MatchValue):
        return expression_effects(node.value)
    if isinstance(node, cst.MatchMapping):
        parts = []
        for el in node.elements:
            parts += [expression_effects(el.key), _pattern_effects(el.pattern)]
        if node.rest is not None:
            parts.append(target_effects(node.rest))
        return sequence(*parts)
    if isinstance(node, cst.MatchClass):
        parts = [expression_effects(node.cls)]
        parts += [_pattern_effects(p.value) for p in node.patterns]
        parts += [_pattern_effects(k.pattern) for k in node.kwds]
        return sequence(*parts)
    if isinstance(node, cst.MatchSequence):
        return sequence(
            *(
                _pattern_effects(p.value if isinstance(p, cst.MatchSequenceElement) else p)
                for p in node.patterns
            )
        )
    if isinstance(node, cst.MatchOr):
        return _branch(*(_pattern_effects(p.pattern) for p in node.patterns))
    return EMPTY  # MatchSingleton


def _match_effects(node: cst.Match) -> Effects:
    cases = []
    for case in node.cases:
        parts = [_pattern_effects(case.pattern)]
        if case.guard is not None:
            parts.append(expression_effects(case.guard))
        parts.append(block_effects(case.body))
        cases.append(sequence(*parts))
    last = node.cases[-1] if node.cases else None
    irrefutable = (  # `case _:` / `case name:` always matches
        last is not None
        and last.guard is None
        and isinstance(last.pattern, cst.MatchAs)
        and last.pattern.pattern is None
    )
    return sequence(
        expression_effects(node.subject), _branch(*cases, *([] if irrefutable else [EMPTY]))
    )


def _small_effects(node: cst.BaseSmallStatement) -> Effects:
    if isinstance(node, cst.Expr):
        return expression_effects(node.value)
    if isinstance(node, cst.Assign):
        return sequence(
            expression_effects(node.value), *(target_effects(t.target) for t in node.targets)
        )
    if isinstance(node, cst.AnnAssign):
        if node.value is None:  # `x: int` makes x local without binding it
            names = target_effects(node.target).assigned
            return Effects(assigned=names)
        return sequence(expression_effects(node.value), target_effects(node.target))
    if isinstance(node, cst.AugAssign):
        return sequence(
            expression_effects(node.target),
            expression_effects(node.value),
            target_effects(node.target),
        )
    if isinstance(node, cst.Return):
        eff = expression_effects(node.value) if node.value is not None else EMPTY
        return Effects(eff.reads, eff.status, True, None, eff.assigned)
    if isinstance(node, cst.Raise):
        parts = [expression_effects(x) for x in (node.exc, node.cause and node.cause.item) if x]
        eff = sequence(*parts)
        return Effects(eff.reads, eff.status, True, None, eff.assigned)
    if isinstance(node, cst.Assert):
        msg = _branch(expression_effects(node.msg), EMPTY) if node.msg is not None else EMPTY
        return sequence(expression_effects(node.test), msg)
    if isinstance(node, cst.Del):
        return target_effects(node.target, delete=True)
    if isinstance(node, (cst.Break, cst.Continue)):
        return Effects(terminates=True, jumps={})
    if isinstance(node, (cst.Import, cst.ImportFrom)):
        return _import_effects(node)
    return EMPTY  # Pass, Global, Nonlocal


def statement_effects(node: cst.CSTNode) -> Effects:
    """Effects of one statement (simple line, compound statement or small statement)."""
    if isinstance(node, (cst.SimpleStatementLine, cst.SimpleStatementSuite, cst.IndentedBlock)):
        return sequence(*(statement_effects(s) for s in node.body))
    if isinstance(node, cst.BaseSmallStatement):
        return _small_effects(node)
    if isinstance(node, cst.If):
        return sequence(
            expression_effects(node.test),
            _branch(block_effects(node.body), _else(node.orelse)),
        )
    if isinstance(node, cst.For):
        body = _repeat(sequence(target_effects(node.target), block_effects(node.body)))
        return sequence(expression_effects(node.iter), body, _branch(_else(node.orelse), EMPTY))
    if isinstance(node, cst.While):
        test = expression_effects(node.test)
        body = _repeat(sequence(block_effects(node.body), test))
        return sequence(test, body, _branch(_else(node.orelse), EMPTY))
    if isinstance(node, cst.With):
        parts = []
        for item in node.items:
            parts.append(expression_effects(item.item))
            if item.asname is not None:
                parts.append(target_effects(item.asname.name))
        return sequence(*parts, block_effects(node.body))
    if isinstance(node, (cst.Try, cst.TryStar)):
        return _try_effects(node)
    if isinstance(node, cst.FunctionDef):
        return _function_effects(node)
    if isinstance(node, cst.ClassDef):
        return _class_effects(node)
    if isinstance(node, cst.Match):
        return _match_effects(node)
    raise TypeError(f"liveness: unsupported statement {type(node).__name__}")


# ---- crossings ----------------------------------------------------------------


@dataclass(frozen=True)
class Crossing:
    """The values that cross one cut between statements.

    ``names``: defined before the cut and read after it, in order of first
    use after the cut. ``maybe_unbound``: those assigned on some paths only
    (the code before the cut may leave them unassigned).
    """

    names: tuple[str, ...]
    maybe_unbound: frozenset = frozenset()


def live_sets(units: Sequence[Effects], live_out: Iterable[str] = ()) -> list[tuple[str, ...]]:
    """The names live before each unit and after the last (``len(units) + 1`` entries)."""
    live: list[tuple[str, ...]] = [()] * (len(units) + 1)
    live[-1] = _ordered(live_out)
    for i in range(len(units) - 1, -1, -1):
        u = units[i]
        after = () if u.terminates else tuple(n for n in live[i + 1] if n not in u.kills)
        live[i] = _ordered(u.reads, after)
    return live


def crossings(
    units: Sequence[Effects], params: Iterable[str], live_out: Iterable[str] = ()
) -> list[Crossing]:
    """What crosses each cut of ``units`` (before the first, between each
    pair, after the last): ``len(units) + 1`` :class:`Crossing`.

    ``params`` are the names bound on entry (the function's parameters; leave
    out ``self`` so it never crosses). ``live_out`` are names read after the
    last unit (none for a whole function body).
    """
    live = live_sets(units, live_out)
    must = set(params)
    may = set(must)
    out = []
    for i in range(len(units) + 1):
        names = tuple(n for n in live[i] if n in may)
        out.append(Crossing(names, frozenset(n for n in names if n not in must)))
        if i == len(units) or units[i].terminates:
            continue
        for n, s in units[i].status.items():
            if "D" in s or ("U" not in s and "B" not in s):
                must.discard(n)
            elif "U" not in s:
                must.add(n)
            if "B" in s:
                may.add(n)
            elif "U" not in s:
                may.discard(n)
    return out


def function_crossings(func: Union[cst.FunctionDef, str]) -> list[Crossing]:
    """:func:`crossings` at every cut between the top-level statements of a
    function (``self`` excluded), for inspection and tests::

        function_crossings("def f(a, b):\\n    c = a\\n    return c + b\\n")
        # [Crossing(('a', 'b')), Crossing(('c', 'b')), Crossing(())]
    """
    if isinstance(func, str):
        func = cst.ensure_type(cst.parse_statement(func), cst.FunctionDef)
    params = [p for p in param_names(func.params) if p != "self"]
    body = func.body.body
    return crossings([statement_effects(s) for s in body], params)
