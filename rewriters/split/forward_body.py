"""What the stage splitter reads off ``forward``'s body, besides the boundaries.

:func:`forward_statements`: forward's top-level statements less its
docstring. :class:`ForwardScope`: the constructs of forward's own scope a
split cannot keep (``yield``, ``global``, ``nonlocal``) and its ``return``
statements (:func:`returns_in`: those of some statements). :class:`Closures`:
nested functions and lambdas, whose free names must not be rebound by a later
stage. :func:`first_name`: where to point an error about a name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import libcst as cst

__all__ = ["Closures", "ForwardScope", "first_name", "forward_statements", "returns_in"]


class ForwardScope(cst.CSTVisitor):
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

    def _leave(self, original_node: cst.CSTNode) -> None:  # libcst's name for it
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


def returns_in(nodes: Sequence[cst.CSTNode]) -> list[cst.Return]:
    scope = ForwardScope()
    for n in nodes:
        n.visit(scope)
    return scope.returns


class Closures(cst.CSTVisitor):
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


def first_name(nodes: Sequence[cst.CSTNode], names: set[str]) -> Optional[cst.Name]:
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
    return list(cst.ensure_type(body, cst.IndentedBlock).body)


def forward_statements(body: cst.BaseSuite) -> list[cst.BaseStatement]:
    """Forward's top-level statements, less its docstring."""
    stmts = _statements(body)
    if stmts and _is_docstring(stmts[0]):
        stmts = stmts[1:]
    return stmts
