"""Sharded values: which expressions hold one rank's slice of the vocab.

A *sharded value* is the output of a non-gathered ``Col()`` (each rank holds
its 1/tp slice of the last dim), followed through simple and tuple-unpacking
assignments, ``.view/.reshape/.float/.contiguous/.flatten/.to``, slicing,
tuple building and indexing (:meth:`ShardedValues.eval`). A value's sharding
(:data:`Shard`) is a :class:`Sharded` tensor, a tuple of shardings, None (not
provably sharded) or :data:`CYCLE` (defined only in terms of itself so far);
:func:`meet` is what holds on two paths. A reshape that may not keep the last
dim is remembered (``Sharded.view``) so that a loss can refuse it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import libcst as cst

from annot.rewriters.tp.reaching import ReachingAssignments
from annot.rewriters.tp.syntax import self_path

__all__ = ["CYCLE", "Env", "Shard", "Sharded", "ShardedValues", "contained", "meet", "settle"]

# Tensor methods that keep "this is a vocab-sharded logits tensor" true.
_KEEPS_SHARDING = frozenset(
    {"view", "reshape", "float", "double", "half", "bfloat16", "contiguous", "flatten", "to"}
)


class ShardedValues(ReachingAssignments):
    """The sharding of an expression in the method being planned."""

    def eval(self, expr: cst.BaseExpression, env: Env, stack: set[int]) -> Shard:
        """The sharding of ``expr``: a :class:`Sharded` tensor, a tuple of
        shardings (a tuple value), None (not provably sharded) or ``CYCLE``.

        Followed: ``self.<source>(...)``, simple and tuple-unpacking assignments,
        ``.view/.reshape/.float/.contiguous/.flatten/.to`` and slicing, tuple
        building, indexing and ``+``. ``stack`` holds the assignments being
        followed (``x = x.float()`` is a cycle, decided by x's other definitions).
        """
        if isinstance(expr, cst.Call):
            func = expr.func
            path = self_path(func, env.self_name)
            if path is not None:
                return env.sources.get(path)
            if isinstance(func, cst.Attribute) and func.attr.value in _KEEPS_SHARDING:
                inner = self.eval(func.value, env, stack)
                if isinstance(inner, Sharded):
                    if inner.view is None and not self._keeps_last_dim(expr, env, stack):
                        return Sharded(inner.cls, inner.hint, inner.origin, expr)
                    return inner
                return CYCLE if inner is CYCLE else None
            return None
        if isinstance(expr, cst.Subscript):
            inner = self.eval(expr.value, env, stack)
            if isinstance(inner, tuple):
                return _index(inner, expr)
            return inner if isinstance(inner, Sharded) or inner is CYCLE else None
        if isinstance(expr, cst.Tuple):
            items: list[Shard] = []
            for el in expr.elements:
                v = self.eval(el.value, env, stack)
                if isinstance(el, cst.StarredElement):
                    if not isinstance(v, tuple):
                        return None
                    items.extend(v)
                else:
                    items.append(v)
            return tuple(items)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            left = self.eval(expr.left, env, stack)
            right = self.eval(expr.right, env, stack)
            if isinstance(left, tuple) and isinstance(right, tuple):
                return left + right
            return None
        if isinstance(expr, cst.IfExp):
            return meet(self.eval(expr.body, env, stack), self.eval(expr.orelse, env, stack))
        if isinstance(expr, cst.Name):
            return self._eval_name(expr, env, stack)
        return None

    def _eval_name(self, expr: cst.Name, env: Env, stack: set[int]) -> Shard:
        """A name is sharded when every assignment that may reach it is."""
        refs = self.reaching(expr)
        if not refs:
            return None
        out: Shard = CYCLE
        for ref in refs:
            if id(ref.node) in stack:
                continue
            stack.add(id(ref.node))
            try:
                value = self._eval_target(ref.target, env, stack)
            finally:
                stack.discard(id(ref.node))
            out = meet(out, value)
            if out is None:
                return None
        return out

    def _eval_target(self, node: cst.CSTNode, env: Env, stack: set[int]) -> Shard:
        """The sharding assigned to the name ``node`` (``x = v``, ``a, x = v``)."""
        value = self.assigned_value(node)
        if value is not None:
            return self.eval(value, env, stack)
        assert self.scopes is not None
        positions: list[tuple[int, int]] = []  # (index, length), innermost first
        cur = node
        while True:
            parent = self.scopes.parent(cur)
            if not (isinstance(parent, cst.Element) and parent.value is cur):
                break
            seq = self.scopes.parent(parent)
            if not isinstance(seq, (cst.Tuple, cst.List)) or any(
                isinstance(e, cst.StarredElement) for e in seq.elements
            ):
                return None
            index = next(i for i, e in enumerate(seq.elements) if e is parent)
            positions.append((index, len(seq.elements)))
            cur = seq
        if not positions:
            return None
        value = self.assigned_value(cur)
        if value is None:
            return None
        out = self.eval(value, env, stack)
        for index, length in reversed(positions):
            if out is CYCLE:
                return CYCLE
            if not isinstance(out, tuple) or len(out) != length:
                return None
            out = out[index]
        return out

    def _keeps_last_dim(self, call: cst.Call, env: Env, stack: set[int]) -> bool:
        """Does ``x.view(...)`` / ``x.reshape(...)`` / ``x.flatten(...)`` provably keep
        x's last dim? (``view(-1, x.size(-1))``, ``view(B, T, -1)``, ``flatten(0, 1)``;
        other methods of ``_KEEPS_SHARDING`` do not reshape.)"""
        assert isinstance(call.func, cst.Attribute)
        method = call.func.attr.value
        args = list(call.args)
        if any(a.star for a in args):
            return False
        if method == "flatten":
            end = next((a.value for a in args if a.keyword and a.keyword.value == "end_dim"), None)
            positional = [a.value for a in args if a.keyword is None]
            if end is None and len(positional) >= 2:
                end = positional[1]
            end_dim = _int_literal(end) if end is not None else -1
            return end_dim is not None and end_dim != -1
        if method not in ("view", "reshape"):
            return True
        dims = [a.value for a in args]
        if len(dims) == 1 and isinstance(dims[0], (cst.Tuple, cst.List)):
            elements = dims[0].elements
            if any(isinstance(e, cst.StarredElement) for e in elements):
                return False
            dims = [e.value for e in elements]
        if len(dims) < 2:
            return False
        last = dims[-1]
        if _int_literal(last) == -1:
            return True
        receiver = _last_dim_of(last)
        if receiver is None:
            return False
        r = self.eval(receiver, env, stack)
        return isinstance(r, Sharded) or r is CYCLE


@dataclass(frozen=True)
class Sharded:
    """A tensor split over the tp ranks along its last dim: the output of the
    non-gathered Col() ``hint`` of class ``cls`` (at ``origin``, "Head.decoder").
    ``view`` is a reshape on the way that may not keep that last dim."""

    cls: str
    hint: str
    origin: str
    view: Optional[cst.Call] = field(default=None, compare=False)


class _Cycle:
    """A name defined only in terms of itself (so far): no information."""

    def __repr__(self) -> str:
        return "CYCLE"


CYCLE = _Cycle()
# None: not provably sharded; a tuple: a tuple value, per element
Shard = Union[None, Sharded, _Cycle, tuple]


@dataclass
class Env:
    self_name: str
    sources: dict[tuple[str, ...], Shard]
    loss_attrs: dict[str, cst.Call]


def meet(a: Shard, b: Shard) -> Shard:
    """What holds on both paths."""
    if a is CYCLE:
        return b
    if b is CYCLE:
        return a
    if isinstance(a, Sharded) and isinstance(b, Sharded):
        return a
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(meet(x, y) for x, y in zip(a, b))
    return None


def settle(s: Shard) -> Shard:
    if isinstance(s, tuple):
        return tuple(settle(x) for x in s)
    return None if s is CYCLE else s


def contained(s: Shard) -> Optional[Sharded]:
    """The first sharded tensor in ``s`` (itself or a tuple element)."""
    if isinstance(s, Sharded):
        return s
    if isinstance(s, tuple):
        return next((x for x in map(contained, s) if x is not None), None)
    return None


def _index(items: tuple, sub: cst.Subscript) -> Shard:
    """``t[1]`` / ``t[1:]`` of a tuple value with literal bounds."""
    if len(sub.slice) != 1:
        return None
    sl = sub.slice[0].slice
    if isinstance(sl, cst.Index):
        i = _int_literal(sl.value)
        if i is None or not -len(items) <= i < len(items):
            return None
        return items[i]
    if isinstance(sl, cst.Slice) and sl.step is None:
        bounds = [None if b is None else _int_literal(b) for b in (sl.lower, sl.upper)]
        if any(b is None and e is not None for b, e in zip(bounds, (sl.lower, sl.upper))):
            return None
        return items[bounds[0] : bounds[1]]
    return None


def _int_literal(expr: cst.BaseExpression) -> Optional[int]:
    if isinstance(expr, cst.Integer):
        return int(expr.evaluated_value)
    if (
        isinstance(expr, cst.UnaryOperation)
        and isinstance(expr.operator, cst.Minus)
        and isinstance(expr.expression, cst.Integer)
    ):
        return -int(expr.expression.evaluated_value)
    return None


def _last_dim_of(expr: cst.BaseExpression) -> Optional[cst.BaseExpression]:
    """``x`` for ``x.size(-1)``, ``x.size(dim=-1)``, ``x.shape[-1]``, ``x.size()[-1]``."""
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        if expr.func.attr.value == "size" and len(expr.args) == 1:
            arg = expr.args[0]
            by_dim = arg.keyword is None or arg.keyword.value == "dim"
            if not arg.star and by_dim and _int_literal(arg.value) == -1:
                return expr.func.value
        return None
    if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
        sl = expr.slice[0].slice
        if not (isinstance(sl, cst.Index) and _int_literal(sl.value) == -1):
            return None
        v = expr.value
        if isinstance(v, cst.Attribute) and v.attr.value == "shape":
            return v.value
        if (
            isinstance(v, cst.Call)
            and isinstance(v.func, cst.Attribute)
            and v.func.attr.value == "size"
            and not v.args
        ):
            return v.func.value
    return None
