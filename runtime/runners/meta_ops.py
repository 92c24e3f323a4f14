"""Ops on the meta device for the pipeline replay (:mod:`annot.runtime.runners.replay`).

A stage replaying the earlier stages' part of forward runs their ops on meta
tensors (shapes only, no FLOPs). :class:`MetaOps` runs each op with a meta
operand on meta once per signature of its operands and afterwards makes the
result from the recorded shapes; :func:`on_meta` moves an op's operands to
meta. :func:`flat`, :func:`signature`, :func:`recipe` and :func:`remake` are
the structure specs and result recipes that this op cache and the replay's
module cache (``shadow_call``) share; :func:`pack` and :func:`unpack` carry a
recipe across a pipeline boundary (the owner's log of its modules' outputs).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Container
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

__all__ = [
    "MetaOps",
    "on_meta",
    "has_meta",
    "signature",
    "flat",
    "pack",
    "recipe",
    "remake",
    "unpack",
]

_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}


def on_meta(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The op's tensor operands on meta; a move (``.to(device)``, ``.cpu()``)
    keeps its dtype and stays on meta."""
    args, kwargs = tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t,
        (args, kwargs),
    )
    if func in _MOVES:

        def keep(a: Any) -> Any:
            if isinstance(a, torch.device) or (
                isinstance(a, (str, int)) and not isinstance(a, bool)
            ):
                return "meta"
            return a

        args = (args[0], *(keep(a) for a in args[1:])) if func is torch.Tensor.to else args[:1]
        kwargs = {k: ("meta" if k == "device" else v) for k, v in kwargs.items()}
        if func is not torch.Tensor.to:
            kwargs = {}
    return args, kwargs


_PLAIN = (type(None), bool, int, float, str)
# values an op's key or result may hold as they are (hashable, no tensor inside)
_VALUES = (*_PLAIN, torch.dtype, torch.device, torch.Size, torch.memory_format, torch.layout)


def signature(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype)
    # typed: True, 1 and 1.0 are equal keys but not equal arguments (x * 2 vs x * 2.0)
    return (type(leaf), leaf) if isinstance(leaf, _PLAIN) else type(leaf)


_TAGS: dict[type, str] = {tuple: "t", list: "l", dict: "d"}


# Not pytree: tree_flatten costs about 3.5 times as much per op on this hot path.
def flat(x: Any, leaves: list) -> Any:
    """A structure spec of ``x`` over tuples, lists and plain dicts (tagged
    ``"t"``, ``"l"``, ``"d"``: plain data), its other values appended to
    ``leaves`` (cheaper than a pytree for the hot path)."""
    t = type(x)
    if t is tuple or t is list:
        return (_TAGS[t], tuple(flat(v, leaves) for v in x))
    if t is dict:
        return ("d", tuple((k, flat(v, leaves)) for k, v in x.items()))
    leaves.append(x)
    return None


def _unflat(spec: Any, leaves: Any) -> Any:
    if spec is None:
        return next(leaves)
    tag, items = spec
    if tag == "d":
        return {k: _unflat(v, leaves) for k, v in items}
    values = (_unflat(v, leaves) for v in items)
    return tuple(values) if tag == "t" else list(values)


def recipe(
    out: Any, inputs: dict[int, int], state: Container[int] = frozenset()
) -> Optional[tuple]:
    """How to make ``out`` again for inputs of the same shapes: each tensor in
    it is input ``i`` (``inputs``: id -> position), an earlier output, or a new
    meta tensor of its shape, dtype and strides; None if ``out`` holds other
    objects, or module state (a parameter, or a tensor whose id is in
    ``state``), which a fresh tensor cannot stand for."""
    outs: list = []
    spec = flat(out, outs)
    seen: dict[int, int] = {}
    recipe: list[tuple[str, Any]] = []
    for j, x in enumerate(outs):
        if isinstance(x, torch.Tensor):
            if isinstance(x, torch.nn.Parameter) or id(x) in state:
                return None
            if id(x) in inputs:
                recipe.append(("in", inputs[id(x)]))
            elif id(x) in seen:
                recipe.append(("out", seen[id(x)]))
            else:
                recipe.append(("new", (tuple(x.shape), tuple(x.stride()), x.dtype)))
            seen.setdefault(id(x), j)
        elif isinstance(x, _VALUES):
            recipe.append(("plain", x))
        else:
            return None
    return tuple(recipe), spec


def pack(hit: tuple) -> Optional[str]:
    """A :func:`recipe` as one JSON string, to cross a pipeline boundary in the
    log of module outputs (one string is cheap for the wire codec, a nested
    structure is not); None if it holds a value JSON cannot carry (a memory
    format, a dict key other than str or int)."""
    recipe, spec = hit
    items = []
    for kind, a in recipe:
        if kind == "new":
            a = [list(a[0]), list(a[1]), _DTYPE_NAME[a[2]]]
        elif kind == "plain":
            if isinstance(a, torch.dtype):
                kind, a = "dtype", _DTYPE_NAME[a]
            elif isinstance(a, torch.Size):
                kind, a = "size", list(a)
            elif isinstance(a, torch.device):
                kind, a = "device", str(a)
            elif not isinstance(a, _PLAIN):
                return None
        items.append([kind, a])
    try:
        return json.dumps([items, _spec_lists(spec)], separators=(",", ":"))
    except TypeError:  # a dict key JSON cannot carry
        return None


def _spec_lists(spec: Any) -> Any:
    if spec is None:
        return None
    tag, items = spec
    if tag == "d":
        if not all(type(k) in (str, int) for k, _ in items):
            raise TypeError("dict key")
        return [tag, [[k, _spec_lists(v)] for k, v in items]]
    return [tag, [_spec_lists(v) for v in items]]


def _spec_tuples(spec: Any) -> Any:
    if spec is None:
        return None
    tag, items = spec
    if tag == "d":
        return (tag, tuple((k, _spec_tuples(v)) for k, v in items))
    return (tag, tuple(_spec_tuples(v) for v in items))


@functools.lru_cache(maxsize=4096)
def unpack(text: str) -> tuple:
    """The recipe :func:`pack` made (cached by the string: a module logs the
    same one every microbatch)."""
    items, spec = json.loads(text)
    recipe = []
    for kind, a in items:
        if kind == "new":
            a = (tuple(a[0]), tuple(a[1]), getattr(torch, a[2]))
        elif kind == "dtype":
            kind, a = "plain", getattr(torch, a)
        elif kind == "size":
            kind, a = "plain", torch.Size(a)
        elif kind == "device":
            kind, a = "plain", torch.device(a)
        recipe.append((kind, a))
    return tuple(recipe), _spec_tuples(spec)


_DTYPE_NAME = {
    getattr(torch, n): n
    for n in dir(torch)
    if isinstance(getattr(torch, n, None), torch.dtype) and not n.startswith("_")
}


def remake(hit: tuple, leaves: list) -> Any:
    recipe, spec = hit
    built: list = []
    with torch._C.DisableTorchFunction():
        for kind, a in recipe:
            if kind == "new":
                built.append(torch.empty_strided(a[0], a[1], dtype=a[2], device="meta"))
            elif kind == "in":
                built.append(leaves[a])
            elif kind == "out":
                built.append(built[a])
            else:
                built.append(a)
    return _unflat(spec, iter(built))


def _op_key(func, args: tuple, kwargs: dict) -> tuple[Optional[tuple], list]:
    """The key of an op on meta operands for :class:`_ReplayMode`'s cache: the
    op, the structure of its arguments and each one's value (a tensor's shape,
    strides and dtype); None where an argument is something else, or for an op
    that changes its operand in place or writes to ``out=``."""
    leaves: list = []
    spec = flat((args, kwargs), leaves)
    name = getattr(func, "__name__", "_")
    if (name.endswith("_") and not name.endswith("__")) or "out" in kwargs:
        return None, leaves  # (resize_, unsqueeze_, ... change the operand's shape)
    sig: list[tuple] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append((x.shape, x.stride(), x.dtype, x.is_meta))
        elif isinstance(x, _VALUES) or x is Ellipsis:
            sig.append((type(x), x))  # typed: True, 1 and 1.0 are equal keys
        elif isinstance(x, slice) and all(isinstance(v, _PLAIN) for v in (x.start, x.stop, x.step)):
            sig.append((slice, *((type(v), v) for v in (x.start, x.stop, x.step))))
        else:
            return None, leaves
    return (func, spec, tuple(sig)), leaves


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def has_meta(args: tuple, kwargs: dict) -> bool:
    """Whether an op's operands hold a meta tensor (one level of lists/tuples,
    which is where torch ops take tensors)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if a.is_meta:
                return True
        elif isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, torch.Tensor) and t.is_meta:
                    return True
    return False


class MetaOps:
    """Ops with a meta operand, run on meta once per signature and then made
    from the recorded result's shapes: a replay passes through the same glue
    (masks, rotary tables, reshapes) every microbatch, and a meta kernel written
    in Python costs 0.1-0.5 ms where a fresh meta tensor costs a few us.

    The key is the op and each argument (a tensor's shape, strides, dtype and
    whether it is on meta; plain values as they are). Ops that change an
    operand's shape in place (``unsqueeze_``, ``resize_``), write to ``out=``,
    or take or return other objects run every time."""

    def __init__(self, size: int = 100_000):
        self.size = size
        self.entries: dict = {}

    def __call__(self, func, args: tuple, kwargs: dict) -> Any:
        key, leaves = _op_key(func, args, kwargs)
        if key is not None:
            hit = self.entries.get(key)
            if hit is not None:
                return remake(hit, leaves)
        args, kwargs = on_meta(func, args, kwargs)
        out = func(*args, **kwargs)
        if key is not None:
            # an output that is an operand already on meta is that operand again
            hit = recipe(out, {id(x): i for i, x in enumerate(leaves) if _is_meta(x)})
            if hit is not None:
                if len(self.entries) >= self.size:
                    self.entries.clear()  # shapes that change every step: start over
                self.entries[key] = hit
        return out
