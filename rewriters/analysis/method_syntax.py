"""The syntax the flow reader (:mod:`annot.rewriters.analysis.head_flow`)
works on: a method parsed with its positions and the shapes it spells out
(``hidden_shape = (*input_shape, -1, self.head_dim)``), and the small
readings of expressions it makes (``self.ff["up"]`` as the path ``"ff.up"``).

    m = parse_method(source, "model.py", first_line=40)
    m.fn, m.where(node), m.shapes["hidden_shape"]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Optional, Union

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

__all__ = [
    "Method",
    "comprehensions",
    "last_name",
    "literal_length",
    "params_of",
    "parse_method",
    "self_path",
    "subexpressions",
]


def last_name(func: cst.BaseExpression) -> Optional[str]:
    if isinstance(func, cst.Name):
        return func.value
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return None


def self_path(node: cst.BaseExpression, self_name: str) -> Optional[str]:
    """``self.a.b`` -> ``"a.b"``; ``self.ff["up"]`` / ``self.h[0]`` -> ``"ff.up"`` / ``"h.0"``."""
    parts: list[str] = []
    while True:
        if isinstance(node, cst.Attribute):
            parts.append(node.attr.value)
            node = node.value
        elif isinstance(node, cst.Subscript) and len(node.slice) == 1:
            key = node.slice[0].slice
            value = getattr(key, "value", None)
            if isinstance(value, cst.SimpleString):
                parts.append(str(value.evaluated_value))
            elif isinstance(value, cst.Integer):
                parts.append(value.value)
            else:
                return None
            node = node.value
        elif isinstance(node, cst.Name) and node.value == self_name and parts:
            return ".".join(reversed(parts))
        else:
            return None


@dataclass(frozen=True)
class Method:
    """One method's parsed source: the function, where its nodes are
    (``file:line:col``), and the names it binds to literal shapes."""

    fn: cst.FunctionDef
    where: Callable[[cst.CSTNode], str]
    shapes: dict


def parse_method(source: str, path: str = "<forward>", first_line: int = 1) -> Method:
    """``source``: one method's text, dedented; positions count from
    ``first_line`` of ``path``."""
    module = cst.parse_module(source)
    fn = next(s for s in module.body if isinstance(s, cst.FunctionDef))
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)

    def where(node: cst.CSTNode) -> str:
        pos = positions.get(node)
        if pos is None:
            return path
        return f"{path}:{pos.start.line + first_line - 1}:{pos.start.column + 1}"

    shapes = _LiteralShapes()
    fn.visit(shapes)
    return Method(fn, where, shapes.found)


def params_of(fn: cst.FunctionDef) -> list[cst.Param]:
    ps = fn.params
    return [*ps.posonly_params, *ps.params, *ps.kwonly_params]


def comprehensions(comp: Optional[cst.CompFor]) -> Iterable[cst.CompFor]:
    while comp is not None:
        yield comp
        comp = comp.inner_for_in


def literal_length(iter_: cst.BaseExpression) -> int:
    return len(iter_.elements) if isinstance(iter_, (cst.Tuple, cst.List)) else 0


def subexpressions(node: Union[cst.Comparison, cst.BooleanOperation]) -> list:
    if isinstance(node, cst.Comparison):
        return [node.left, *(c.comparator for c in node.comparisons)]
    return [node.left, node.right]


class _LiteralShapes(cst.CSTVisitor):
    """Names bound to a literal tuple (``hidden_shape = (*input_shape, -1, self.d)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, list] = {}

    def visit_Assign(self, node: cst.Assign) -> None:
        target = node.targets[0].target if len(node.targets) == 1 else None
        value = node.value
        lead: list = []
        if isinstance(value, cst.BinaryOperation) and isinstance(value.right, cst.Tuple):
            lead, value = [cst.Name("_batch")], value.right  # x.size()[:-1] + (heads, d)
        if isinstance(target, cst.Name) and isinstance(value, cst.Tuple):
            self.found[target.value] = lead + [
                cst.Name("_batch") if isinstance(e, cst.StarredElement) else e.value
                for e in value.elements
            ]
