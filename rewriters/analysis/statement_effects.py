"""The :class:`~annot.rewriters.analysis.liveness.Effects` of libcst code: what running a
statement or evaluating an expression does to the local names of its function.
:func:`statement_effects` summarises one statement for
:func:`annot.rewriters.analysis.liveness.crossings`; :func:`function_crossings` runs the
two over a whole function body. Conditionals (``if``, ``try`` handlers,
``match`` cases, ``and`` / ``or``, ``x if c else y``) are a ``branch``, loops a
``repeat`` (they may run zero times).

Scopes follow Python: comprehension targets and lambda / nested ``def``
parameters are local to them, their free names count as reads where they
are defined (a walrus in a comprehension binds in the function), and a name
never assigned in the function (``torch``, ``F``, builtins) is never
defined, so it never crosses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import libcst as cst

from annot.rewriters.analysis.liveness import (
    DELETED,
    EMPTY,
    MAYBE_BOUND,
    Crossing,
    Effects,
    bind,
    branch,
    crossings,
    merge,
    ordered,
    read,
    repeat,
    sequence,
    unbind,
)

__all__ = [
    "block_effects",
    "expression_effects",
    "free_names",
    "function_crossings",
    "param_names",
    "statement_effects",
    "target_effects",
]

# ---- expressions ------------------------------------------------------------

_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)


def expression_effects(node: cst.CSTNode) -> Effects:
    """Reads (and walrus binds) of an expression, in evaluation order."""
    if isinstance(node, cst.Name):
        return read(node.value)
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
            branch(expression_effects(node.body), expression_effects(node.orelse)),
        )
    if isinstance(node, cst.BooleanOperation):
        return sequence(
            expression_effects(node.left), branch(expression_effects(node.right), EMPTY)
        )
    if isinstance(node, cst.Comparison):
        parts = [expression_effects(node.left)]
        for i, target in enumerate(node.comparisons):
            eff = expression_effects(target.comparator)
            parts.append(eff if i == 0 else branch(eff, EMPTY))
        return sequence(*parts)
    return sequence(*(expression_effects(c) for c in node.children))


def target_effects(node: cst.CSTNode, *, delete: bool = False) -> Effects:
    """Binding (or ``del``) of an assignment target: names are bound, the
    bases of ``a.b`` / ``a[i]`` targets are read."""
    if isinstance(node, cst.Name):
        return unbind(node.value) if delete else bind(node.value)
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
    return ordered((n for n in body.reads if n not in local and n not in glob), nonlocal_)


def _lambda_effects(node: cst.Lambda) -> Effects:
    defaults = [expression_effects(p.default) for p in _all_params(node.params) if p.default]
    return sequence(*defaults, Effects(reads=free_names(node)))


def _comprehension_effects(node: cst.BaseComp) -> Effects:
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
        parts += [branch(expression_effects(c.test), EMPTY) for c in comp.ifs]
        comp = comp.inner_for_in
    if isinstance(node, cst.DictComp):
        parts += [expression_effects(node.key), expression_effects(node.value)]
    elif isinstance(node, cst.BaseSimpleComp):  # list, set, generator
        parts.append(expression_effects(node.elt))
    inner = sequence(*parts)
    walrus = inner.assigned - targets  # PEP 572: binds in the enclosing function
    return sequence(
        expression_effects(first.iter),
        Effects(
            reads=tuple(n for n in inner.reads if n not in targets),
            status={n: MAYBE_BOUND for n in walrus},
            assigned=frozenset(walrus),
        ),
    )


# ---- statements ---------------------------------------------------------------

Block = Union[cst.BaseSuite, Sequence[cst.CSTNode]]


def block_effects(block: Block) -> Effects:
    """Effects of a suite (``IndentedBlock`` / one-line suite) or a list of statements."""
    stmts = block.body if isinstance(block, cst.BaseSuite) else block
    return sequence(*(statement_effects(s) for s in stmts))


def _else(node: Union[cst.If, cst.Else, None]) -> Effects:
    if node is None:
        return EMPTY
    if isinstance(node, cst.If):
        return statement_effects(node)
    return block_effects(node.body)


def _declared(body: cst.BaseSuite, kind: type[Union[cst.Global, cst.Nonlocal]]) -> dict[str, None]:
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
    status = {n: MAYBE_BOUND for n in nonlocal_}
    parts.append(Effects(reads=free_names(node), status=status, assigned=frozenset(nonlocal_)))
    parts.append(bind(node.name.value))
    return sequence(*parts)


def _class_effects(node: cst.ClassDef) -> Effects:
    parts = [expression_effects(d.decorator) for d in node.decorators]
    parts += [expression_effects(a.value) for a in (*node.bases, *node.keywords)]
    body = block_effects(node.body)
    parts.append(Effects(reads=body.reads))  # conservative: class-body reads
    parts.append(bind(node.name.value))
    return sequence(*parts)


def _import_effects(node: Union[cst.Import, cst.ImportFrom]) -> Effects:
    if isinstance(node.names, cst.ImportStar):
        return EMPTY
    binds = []
    for alias in node.names:
        if alias.asname is not None:
            binds.append(target_effects(alias.asname.name))
        elif isinstance(alias.name, cst.Name):
            binds.append(bind(alias.name.value))
        else:  # import a.b.c binds a
            base: cst.BaseExpression = alias.name
            while isinstance(base, cst.Attribute):
                base = base.value
            assert isinstance(base, cst.Name), "import a.b.c binds the name a"
            binds.append(bind(base.value))
    return sequence(*binds)


def _try_effects(node: Union[cst.Try, cst.TryStar]) -> Effects:
    body = block_effects(node.body)
    normal = sequence(body, _else(node.orelse))
    # a handler starts after any prefix of the body ran
    partial = Effects(body.reads, merge({}, body.status), False, body.jumps, body.assigned)
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
            parts.append(Effects(status={name.value: DELETED}, assigned=frozenset((name.value,))))
        handlers.append(sequence(*parts))
    eff = branch(normal, *handlers)
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
        return branch(*(_pattern_effects(p.pattern) for p in node.patterns))
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
        expression_effects(node.subject), branch(*cases, *([] if irrefutable else [EMPTY]))
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
        msg = branch(expression_effects(node.msg), EMPTY) if node.msg is not None else EMPTY
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
            branch(block_effects(node.body), _else(node.orelse)),
        )
    if isinstance(node, cst.For):
        body = repeat(sequence(target_effects(node.target), block_effects(node.body)))
        return sequence(expression_effects(node.iter), body, branch(_else(node.orelse), EMPTY))
    if isinstance(node, cst.While):
        test = expression_effects(node.test)
        body = repeat(sequence(block_effects(node.body), test))
        return sequence(test, body, branch(_else(node.orelse), EMPTY))
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


# ---- a whole function ---------------------------------------------------------


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
