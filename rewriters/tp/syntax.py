"""libcst helpers the tensor-parallel planners share (:mod:`annot.rewriters.tp.rewrite`).

A class's methods and a method's first parameter, ``self.a.b`` read as a path,
a call with keyword arguments appended in the call's own comma style, and
walks over one function body: its statements, assignments, returns and calls
in source order, not descending into nested functions or classes unless asked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional, Union

import libcst as cst

from annot.rewriters.source.diagnostics import children, is_a

__all__ = [
    "assignments",
    "calls",
    "first_param",
    "methods_of",
    "returns",
    "self_path",
    "unpack",
    "walk",
    "with_args",
]


def methods_of(cls: cst.ClassDef) -> list[cst.FunctionDef]:
    if not isinstance(cls.body, cst.IndentedBlock):
        return []
    return [s for s in cls.body.body if isinstance(s, cst.FunctionDef)]


def first_param(fn: cst.FunctionDef) -> Optional[cst.Param]:
    params = list(fn.params.posonly_params) + list(fn.params.params)
    return params[0] if params else None


def self_path(expr: cst.BaseExpression, self_name: str) -> Optional[tuple[str, ...]]:
    """``self.a.b`` -> ("a", "b"); None for anything not rooted at ``self``."""
    parts: list[str] = []
    while isinstance(expr, cst.Attribute):
        parts.append(expr.attr.value)
        expr = expr.value
    if isinstance(expr, cst.Name) and expr.value == self_name and parts:
        return tuple(reversed(parts))
    return None


def with_args(call: cst.Call, func: cst.BaseExpression, extra: list[cst.Arg]) -> cst.Call:
    """``call`` with ``func`` swapped in and keyword args ``extra`` appended,
    following the call's own comma style (one per line stays one per line)."""
    args = list(call.args)
    if not args:
        return call.with_changes(func=func, args=extra)
    last = args[-1]
    sep = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    if len(args) >= 2 and isinstance(args[-2].comma, cst.Comma):
        sep = args[-2].comma
    elif isinstance(last.comma, cst.Comma) and not isinstance(
        last.comma.whitespace_after, cst.SimpleWhitespace
    ):
        sep = last.comma  # single argument written on its own line
    # a trailing comma and the space before ")" move to the end
    tail, tail_ws = last.comma, last.whitespace_after_arg
    args[-1] = last.with_changes(comma=sep, whitespace_after_arg=cst.SimpleWhitespace(""))
    new = [a.with_changes(comma=sep) for a in extra[:-1]]
    new.append(extra[-1].with_changes(comma=tail, whitespace_after_arg=tail_ws))
    return call.with_changes(func=func, args=args + new)


def _descendants(node: cst.CSTNode, prune: tuple[type, ...] = ()) -> Iterable[cst.CSTNode]:
    """The nodes under ``node`` in source order (preorder), leaving out
    those of a type in ``prune`` and everything under them."""
    stack = children(node)[::-1]
    while stack:
        child = stack.pop()
        if type(child) in prune:
            continue
        yield child
        stack.extend(children(child)[::-1])


def calls(node: cst.CSTNode) -> Iterable[cst.Call]:
    """The calls under ``node``, outer first, not descending into nested classes."""
    return [n for n in _descendants(node, (cst.ClassDef,)) if type(n) is cst.Call]


_SUITES = (
    cst.IndentedBlock,
    cst.SimpleStatementLine,
    cst.SimpleStatementSuite,
    cst.Else,
    cst.ExceptHandler,
    cst.ExceptStarHandler,
    cst.Finally,
    cst.MatchCase,
)


_STATEMENT = (cst.BaseSmallStatement, cst.BaseCompoundStatement)
_DEFINITION = (cst.FunctionDef, cst.ClassDef)
_IN_BODIES = (*_SUITES, *_STATEMENT)


def _statements(node: cst.CSTNode, nested: bool = False) -> Iterable[cst.CSTNode]:
    """The statements under ``node`` (a function body), small ones too, in
    source order; those of nested functions and classes only when ``nested``.
    (Expressions hold no statement: they are not walked.)"""
    stack = children(node)[::-1]
    while stack:
        child = stack.pop()
        if is_a(child, _STATEMENT):
            yield child
            if is_a(child, (cst.BaseSmallStatement,)) or (not nested and is_a(child, _DEFINITION)):
                continue
        elif not is_a(child, _SUITES):
            continue
        stack.extend(c for c in children(child)[::-1] if is_a(c, _IN_BODIES))


def returns(node: cst.CSTNode) -> Iterable[cst.Return]:
    """The return statements of one function body (not of nested functions)."""
    return [n for n in _statements(node) if type(n) is cst.Return]


def walk(node: cst.CSTNode) -> Iterable[cst.CSTNode]:
    """Every statement under ``node``, nested functions included."""
    return _statements(node, nested=True)


def assignments(node: cst.CSTNode) -> Iterable[Union[cst.Assign, cst.AnnAssign]]:
    """The assignments of one function body, in source order, not descending
    into nested functions or classes."""
    return [n for n in _statements(node) if type(n) is cst.Assign or type(n) is cst.AnnAssign]


def unpack(target: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The simple targets of ``a, (b, c) = ...`` (or ``[target]``)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        out: list[cst.BaseExpression] = []
        for el in target.elements:
            out += unpack(el.value)
        return out
    return [target]
