"""How the flow reader (:mod:`annot.rewriters.analysis.head_flow`) reads the
calls that give a tensor its shape: a reshape into heads or back
(``view``, ``reshape``, einops' ``rearrange``), a split into equal parts
(``split``, ``chunk``), and the sizes they read, which ``Local`` must divide
(``self.n_head``, both sizes of a local's ``if``, a forward local ``C``),
never twice (``n_head * self.head_dim`` with ``n_head`` divided)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import libcst as cst

from annot.rewriters.analysis.flow_values import CLEAN, COLUMNS, HEADS, MERGED, Split, Val, Value
from annot.rewriters.analysis.method_syntax import self_path

__all__ = ["ShapeReads"]


class ShapeReads:
    """The shape-reading half of the flow reader (a mixin: the reader holds the
    bindings, the records and ``fail``)."""

    self_name: str
    kids: Any
    env: dict
    defs: dict
    local_src: dict
    local: dict
    chunks: dict
    shapes: dict
    depth: int

    def fail(self, v: Value, why: str, node: cst.CSTNode) -> None:
        raise NotImplementedError

    def size_name(self, node: cst.BaseExpression, v: Val, what: str) -> None:
        """Record the name ``node`` reads as a per-rank size (or fail ``v``)."""
        if isinstance(node, cst.UnaryOperation) and isinstance(node.expression, cst.Integer):
            return  # -1: the size follows the data
        if isinstance(node, cst.Integer):
            self.fail(v, f"a literal {what} ({node.value})", node)
            return
        if self.divided(node):
            return  # heads * head_dim, the head count already divided
        names = self.size_keys(node)
        for name in names or ():
            self.local[name] = self.local.get(name, frozenset()) | v.src
        if not names:
            self.fail(v, f"a {what} it cannot name", node)

    def divided(self, node: cst.BaseExpression, seen: frozenset = frozenset()) -> bool:
        """Whether ``node`` already reads a size ``Local`` divides (``n_head *
        self.head_dim``; a local bound to that, in either branch of an ``if``)."""
        if any(k in self.local for k in self.size_keys(node) or ()):
            return True
        if isinstance(node, cst.Name) and node.value in self.defs and node.value not in seen:
            return self.divided(self.defs[node.value], seen | {node.value})
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Multiply):
            return self.divided(node.left, seen) or self.divided(node.right, seen)
        if isinstance(node, cst.IfExp):
            return self.divided(node.body, seen) or self.divided(node.orelse, seen)
        return False

    def size_keys(self, node: cst.BaseExpression, seen: frozenset = frozenset()) -> Optional[list]:
        """The names ``Local`` takes for what ``node`` reads: a self path
        (``"n_head"``, ``"config.num_heads"``), the self paths a local copies (in
        either branch of an ``if``: ``self.config.n_head if c else self.n_head``),
        or a forward local (``"C"``); None for what it cannot name."""
        path = self_path(node, self.self_name)
        if path is not None:
            return None if path in self.kids.params else [path]
        if not isinstance(node, cst.Name) or node.value not in self.env:
            return None
        if node.value in self.local_src:
            return [self.local_src[node.value]]
        value = self.defs.get(node.value)
        if isinstance(value, cst.IfExp) and node.value not in seen:
            seen = seen | {node.value}
            body, orelse = self.size_keys(value.body, seen), self.size_keys(value.orelse, seen)
            if body and orelse:
                return body + [k for k in orelse if k not in body]
        return [node.value] if self.depth == 0 else None  # a method's local: not forward's

    def split(self, v: Val, args: Sequence[cst.Arg], node: cst.Call, name: str) -> Value:
        if not args:
            self.fail(v, f"{name}() without a size", node)
            return v
        size = args[0].value
        if name == "chunk" and isinstance(size, cst.Integer):
            self.chunks.update({s: int(size.value) for s in v.src})
            return tuple(v for _ in range(int(size.value)))
        if isinstance(size, (cst.List, cst.Tuple)):
            self.fail(v, "a split into unequal parts", node)
            return v
        self.size_name(size, v, "split size")
        return Split(v)

    def reshape(self, v: Val, node: cst.Call) -> Value:
        dims = self.dims(node.args)
        if dims is None:
            self.fail(v, "a reshape it cannot read", node)
            return v
        if v.state == COLUMNS:  # into heads: (..., heads, head_dim)
            if len(dims) < 3:
                self.fail(v, "a reshape of a column output that splits no heads", node)
                return v
            self.size_name(dims[-2], v, "head count")
            if len(dims) > 3 and isinstance(dims[-3], cst.Integer) and int(dims[-3].value) > 1:
                self.chunks.update({s: int(dims[-3].value) for s in v.src})  # (.., 3, heads, d)
            return Val(HEADS, v.src)
        if v.state == HEADS:  # merged back: (..., heads * head_dim)
            self.size_name(dims[-1], v, "width")
            return Val(MERGED, v.src)
        self.fail(v, "a reshape of a merged value", node)
        return v

    def dims(self, args: Sequence[cst.Arg]) -> Optional[list[cst.BaseExpression]]:
        """The shape a view or reshape is given, one expression a dim (a starred
        name bound to a literal tuple is read through; None where unknown)."""
        out: list[cst.BaseExpression] = []
        for a in args:
            value = a.value
            if isinstance(value, (cst.Tuple, cst.List)) and len(args) == 1:
                out.extend(e.value for e in value.elements)
            elif isinstance(value, cst.Name) and (a.star == "*" or len(args) == 1):
                shape = self.shapes.get(value.value)
                if shape is None and len(args) == 1:
                    return None
                out.extend(shape or [cst.Name("_unknown")])
            else:
                out.append(value)
        return out

    def rearrange(self, v: Val, node: cst.Call) -> Value:
        pattern = node.args[1].value if len(node.args) > 1 else None
        text = str(pattern.evaluated_value) if isinstance(pattern, cst.SimpleString) else None
        if text is None or "->" not in text:
            self.fail(v, "a rearrange it cannot read", node)
            return v
        left, right = text.split("->")
        if v.state == COLUMNS and "(" in left:
            first = left[left.index("(") + 1 :].split()[0]
            size = next(
                (a.value for a in node.args[2:] if a.keyword and a.keyword.value == first), None
            )
            if size is None:
                self.fail(v, f"a rearrange without {first}=", node)
                return v
            self.size_name(size, v, "head count")
            return Val(HEADS, v.src)
        if v.state == HEADS and "(" in right:
            return Val(MERGED, v.src)
        if v.state == CLEAN:
            return Val()
        self.fail(v, "a rearrange it cannot follow", node)
        return v
