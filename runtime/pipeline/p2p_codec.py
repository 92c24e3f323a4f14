"""The codec of :mod:`annot.runtime.pipeline.p2p`: a pytree of tensors and plain values
as a JSON-able structure plus its list of tensors, and back.

:func:`flatten` refuses, naming its path, the first value that cannot cross a
pipeline boundary; :func:`unflatten` validates a structure that may come from
the network and finds namedtuple and dataclass types among the modules
already imported (it never imports anything). :data:`DTYPES` are the dtypes
that cross.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import sys
from collections.abc import Callable
from typing import Any, Optional, cast

import numpy as np
import torch

from annot.core.errors import PipelineError

__all__ = [
    "DTYPES",
    "Malformed",
    "flatten",
    "matcher",
    "rebuilder",
    "simple_signature",
    "tensors_requiring_grad",
    "unflatten",
]

_DTYPE_NAMES = (
    "float64 float32 float16 bfloat16 complex128 complex64 complex32 bool"
    " int8 int16 int32 int64 uint8 uint16 uint32 uint64"
    " float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu"
)
# Byte-addressable dtypes only (no quantized, bit or sub-byte shells).
DTYPES = {n: getattr(torch, n) for n in _DTYPE_NAMES.split() if hasattr(torch, n)}
_SUPPORTED = (
    "tensors, None, bool, int, float, str, torch.dtype, torch.device, torch.Size, slices"
    " of ints, Ellipsis, and tuples, lists, dicts (str or int keys), namedtuples and dataclasses of those"
)


# -- flatten / unflatten ----------------------------------------------------


def _type_name(x: Any) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _type_ref(cls: type) -> Optional[str]:
    """``module:qualname`` if the class can be found again by that name."""
    return (
        f"{cls.__module__}:{cls.__qualname__}"
        if _lookup(cls.__module__, cls.__qualname__) is cls
        else None
    )


def _lookup(module: str, qualname: str) -> Any:
    """Find an already imported class by name (never imports anything)."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or part.startswith("<"):
            return None
        obj = getattr(obj, part, None)
    return obj


def _hint(x: Any) -> str:
    if isinstance(x, (set, frozenset)):
        return " Sort it into a list or tuple."
    if isinstance(x, np.ndarray) or type(x).__module__ == "numpy":
        return " Convert it with torch.from_numpy(...) or .item()."
    if isinstance(x, torch.Tensor):
        return " Send a plain dense tensor (.to_dense(), .full_tensor(), .to_local())."
    if callable(x):
        return " Code never crosses a process boundary: compute it on the stage that uses it."
    return " Convert it to those types before the boundary, or keep it on one stage."


def _unsupported(x: Any, path: str, why: str = "") -> PipelineError:
    why = why or f"a pipeline boundary carries only {_SUPPORTED}."
    return PipelineError(f"cannot send {path} of type {_type_name(x)}: {why}{_hint(x)}")


def flatten(obj: Any, *, root: str = "obj") -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` into a JSON-able structure and its tensors (depth first,
    dicts in insertion order, dataclass fields in declaration order): the
    inverse of :func:`unflatten`. Raises PipelineError naming the path of the
    first value that cannot cross a pipeline boundary (e.g. ``obj['cache'][1]``)."""
    tensors: list[torch.Tensor] = []
    tree = _flatten(obj, (root,), tensors, set())
    return tree, tensors


def _path(path: tuple) -> str:
    """A path of :func:`_flatten` as text (``obj['cache'][1]``), built only
    for an error message: ``(root,)``, ``(parent, "item", key)`` or
    ``(parent, "attr", name)``."""
    parts = []
    while len(path) == 3:
        path, how, key = path
        parts.append(f".{key}" if how == "attr" else f"[{key!r}]")
    return path[0] + "".join(reversed(parts))


_PLAIN = (bool, int, str, float)


# Not pytree: a JSON wire format, checked per value with its path (cycles, dtypes, classes).
def _flatten(x: Any, path: tuple, tensors: list, active: set) -> Any:
    kind = type(x)
    if x is None or kind in _PLAIN:
        return x
    if isinstance(x, torch.Tensor):
        if kind not in (torch.Tensor, torch.nn.Parameter) or x.layout != torch.strided:
            raise _unsupported(x, _path(path), "only plain dense (strided) tensors can be sent.")
        if x.dtype not in _SENDABLE_DTYPES:
            raise _unsupported(
                x, _path(path), f"dtype {x.dtype} cannot be sent (quantized or sub-byte)."
            )
        if x.is_meta:
            raise _unsupported(x, _path(path), "a meta tensor has no data to send.")
        tensors.append(x)
        return {"k": "T", "i": len(tensors) - 1}
    if kind in (tuple, list, dict, collections.OrderedDict):  # the common containers first
        return _container(x, kind, path, tensors, active)
    if isinstance(x, torch.dtype):
        return {"k": "dtype", "v": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"k": "device", "v": str(x)}
    if kind is torch.Size:
        return {"k": "size", "v": list(x)}
    if kind is slice and all(v is None or type(v) is int for v in (x.start, x.stop, x.step)):
        return {"k": "slice", "v": [x.start, x.stop, x.step]}
    if x is Ellipsis:
        return {"k": "ellipsis"}
    if id(x) in active:
        raise _unsupported(x, _path(path), "it contains itself (a reference cycle).")
    active.add(id(x))
    try:
        if isinstance(x, tuple) and hasattr(kind, "_fields"):
            ref = _type_ref(kind)
            if ref is None:
                raise _unsupported(
                    x,
                    _path(path),
                    "the receiver cannot find this namedtuple class by name; define it at module level.",
                )
            return {
                "k": "nt",
                "type": ref,
                "v": [
                    _flatten(v, (path, "attr", f), tensors, active)
                    for f, v in zip(cast(Any, x)._fields, x)
                ],
            }
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            ref = _type_ref(kind)
            if ref is None:
                raise _unsupported(
                    x,
                    _path(path),
                    "the receiver cannot find this dataclass by name; define it at module level.",
                )
            return {
                "k": "dc",
                "type": ref,
                "v": [
                    [f.name, _flatten(getattr(x, f.name), (path, "attr", f.name), tensors, active)]
                    for f in dataclasses.fields(x)
                ],
            }
    finally:
        active.discard(id(x))
    raise _unsupported(x, _path(path))


def _container(x: Any, kind: type, path: tuple, tensors: list, active: set) -> Any:
    """A tuple, list, dict or OrderedDict (exact types) for :func:`_flatten`."""
    if id(x) in active:
        raise _unsupported(x, _path(path), "it contains itself (a reference cycle).")
    active.add(id(x))
    try:
        if kind is tuple or kind is list:
            return {
                "k": "tuple" if kind is tuple else "list",
                "v": [_flatten(v, (path, "item", i), tensors, active) for i, v in enumerate(x)],
            }
        items = []
        for key, v in x.items():
            if type(key) not in (str, int):
                raise _unsupported(
                    key, f"key {key!r} of {_path(path)}", "dict keys must be str or int."
                )
            items.append([key, _flatten(v, (path, "item", key), tensors, active)])
        return {"k": "dict" if kind is dict else "odict", "v": items}
    finally:
        active.discard(id(x))


_SENDABLE_DTYPES = frozenset(DTYPES.values())


def _sendable(x: Any) -> bool:
    """A tensor :func:`flatten` takes as is (a dense, non-meta tensor of a
    sendable dtype, no subclass)."""
    return (
        type(x) in _TENSOR_TYPES
        and x.layout == torch.strided
        and x.dtype in _SENDABLE_DTYPES
        and not x.is_meta
    )


def simple_signature(obj: Any) -> Optional[tuple[tuple, list[torch.Tensor]]]:
    """For the common messages of a pipeline (tensors, None, bools, ints,
    floats and strs in tuples, lists and dicts with str keys, nested a few
    levels): a key that determines :func:`flatten`'s structure, its plain
    values and each tensor's dtype, shape and requires_grad, with the tensors
    in :func:`flatten`'s order. None for anything else (use :func:`flatten`).

    The key compares by exact type (``type(obj)``, str keys, None, a plain
    value with its type, a float by its bits), never by value equality alone,
    where ``True == 1 == 1.0`` would merge different structures: two objects
    with equal keys flatten to equal structures."""
    tensors: list[torch.Tensor] = []
    key = _simple_key(obj, tensors, 0)
    return None if key is None else (key, tensors)


_MAX_SIMPLE_DEPTH = 4


def _simple_key(x: Any, tensors: list, depth: int, keyed: bool = True) -> Optional[tuple]:
    """:func:`simple_signature`'s walk: append the tensors to ``tensors`` and
    return the key, or None where ``x`` is not simple. ``keyed=False`` walks
    the same way but builds no key (``()`` for a simple value):
    :func:`tensors_requiring_grad` needs only the tensors."""
    if x is None:
        return ()
    kind = type(x)
    if kind is bool or kind is int or kind is str:  # the type too: True == 1 == 1.0
        return (kind, x) if keyed else ()
    if kind is float:  # by its bits: -0.0 == 0.0, and every NaN is "NaN" in JSON
        return (kind, x.hex()) if keyed else ()
    if _sendable(x):
        tensors.append(x)
        return (x.dtype, tuple(x.shape), x.requires_grad) if keyed else ()
    if kind in (tuple, list):
        values, names = x, None
    elif kind is dict and all(type(k) is str for k in x):
        values, names = x.values(), (tuple(x) if keyed else None)
    else:
        return None
    if depth == _MAX_SIMPLE_DEPTH:
        return None
    keys = []
    for v in values:
        k = _simple_key(v, tensors, depth + 1, keyed)
        if k is None:
            return None
        if keyed:
            keys.append(k)
    return (kind, names, tuple(keys)) if keyed else ()


def matcher(key: tuple) -> Callable[[Any], Optional[list[torch.Tensor]]]:
    """A function of ``obj`` that returns its tensors (in :func:`flatten`'s
    order) when ``simple_signature(obj)`` would have ``key``, else None: the
    sender of a channel with steady shapes checks each message against the
    previous one's key this way, without building a key each time."""
    check = _matcher(key)

    def match(obj: Any) -> Optional[list[torch.Tensor]]:
        tensors: list[torch.Tensor] = []
        return tensors if check(obj, tensors) else None

    return match


def _matcher(key: tuple) -> Callable[[Any, list], bool]:
    """``check(x, tensors)``: whether ``x`` has ``key`` (one node of
    :func:`_simple_key`'s), appending its tensors."""
    if key == ():
        return lambda x, tensors: x is None
    head = key[0]
    if isinstance(head, torch.dtype):  # a tensor: (dtype, shape, requires_grad)
        dtype, shape, requires_grad = key

        def tensor(x: Any, tensors: list) -> bool:
            if not (
                type(x) in _TENSOR_TYPES
                and x.dtype is dtype
                and x.shape == shape
                and x.requires_grad is requires_grad
                and x.layout is torch.strided
                and not x.is_meta
            ):
                return False
            tensors.append(x)
            return True

        return tensor
    if head is float:  # by its bits, as the key
        bits = key[1]
        return lambda x, tensors: type(x) is float and x.hex() == bits
    if head in (bool, int, str):
        value = key[1]
        return lambda x, tensors: type(x) is head and x == value
    kind, names, children = key
    parts = [_matcher(k) for k in children]
    n = len(parts)
    if kind is dict:

        def mapping(x: Any, tensors: list) -> bool:
            return (
                type(x) is dict
                and len(x) == n
                and tuple(x) == names
                and all(type(k) is str for k in x)  # (a str subclass key compares equal)
                and all(p(v, tensors) for p, v in zip(parts, x.values()))
            )

        return mapping

    def sequence(x: Any, tensors: list) -> bool:
        return type(x) is kind and len(x) == n and all(p(v, tensors) for p, v in zip(parts, x))

    return sequence


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class Malformed(Exception):
    """A received structure is malformed (turned into a PipelineError)."""


def unflatten(tree: Any, tensors: list, *, device: Optional[torch.device] = None) -> Any:
    """Rebuild the object from :func:`flatten`'s output. ``torch.device`` leaves
    become ``device`` (default: torch's default device): a device never crosses
    as-is. Validates the structure (it may come from the network)."""
    device = torch.get_default_device() if device is None else torch.device(device)
    used = [0] * len(tensors)
    try:
        obj = _unflatten(tree, tensors, device, used)
    except RecursionError:
        raise PipelineError("the structure is nested too deeply to rebuild") from None
    except Malformed as bad:
        raise PipelineError(f"malformed structure: {bad}") from None
    if any(n != 1 for n in used):
        raise PipelineError(f"malformed structure: tensor uses {used} (each must appear once)")
    return obj


def _items(node: dict) -> list:
    v = node.get("v")
    if not isinstance(v, list):
        raise Malformed(f"{node.get('k')!r} node without a list of values")
    return v


def _resolve_type(node: dict, want: str) -> type:
    ref = node.get("type")
    if not isinstance(ref, str) or ref.count(":") != 1:
        raise Malformed(f"bad type reference {ref!r}")
    module, qualname = ref.split(":")
    cls = _lookup(module, qualname)
    ok = isinstance(cls, type) and (
        (want == "nt" and issubclass(cls, tuple) and hasattr(cls, "_fields"))
        or (want == "dc" and dataclasses.is_dataclass(cls))
    )
    if not ok:
        raise Malformed(
            f"class {ref} is not a loaded {'namedtuple' if want == 'nt' else 'dataclass'} on"
            f" this rank; import {module} on every rank before the pipeline runs"
        )
    return cls


def _unflatten(node: Any, tensors: list, device: torch.device, used: list) -> Any:
    if node is None or type(node) in (bool, int, float, str):
        return node
    if type(node) is not dict:
        raise Malformed(f"unexpected {type(node).__name__} node")
    kind = node.get("k")

    def rec(n: Any) -> Any:
        return _unflatten(n, tensors, device, used)

    if kind == "T":
        i = node.get("i")
        if type(i) is not int or not 0 <= i < len(tensors):
            raise Malformed(f"tensor index {i!r} out of range (0..{len(tensors) - 1})")
        used[i] += 1
        return tensors[i]
    if kind == "dtype":
        name = node.get("v")
        dt = DTYPES.get(name) if isinstance(name, str) else None
        if dt is None:
            raise Malformed(f"unknown dtype {node.get('v')!r}")
        return dt
    if kind == "device":
        return device
    if kind == "size":
        v = _items(node)
        if not all(type(d) is int for d in v):
            raise Malformed("torch.Size with non-int entries")
        return torch.Size(v)
    if kind == "slice":
        v = _items(node)
        if len(v) != 3 or not all(d is None or type(d) is int for d in v):
            raise Malformed("slice with entries other than three ints or None")
        return slice(*v)
    if kind == "ellipsis":
        return Ellipsis
    if kind in ("tuple", "list"):
        values = [rec(v) for v in _items(node)]
        return tuple(values) if kind == "tuple" else values
    if kind in ("dict", "odict"):
        out = {} if kind == "dict" else collections.OrderedDict()
        for pair in _items(node):
            if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int)):
                raise Malformed("dict item is not a [str|int key, value] pair")
            out[pair[0]] = rec(pair[1])
        return out
    if kind == "nt":
        cls: Any = _resolve_type(node, "nt")
        values = [rec(v) for v in _items(node)]
        if len(values) != len(cls._fields):
            raise Malformed(
                f"{cls.__qualname__} has {len(cls._fields)} fields, received {len(values)}"
            )
        return cls._make(values)
    if kind == "dc":
        dc: Any = _resolve_type(node, "dc")
        fields = {f.name: f for f in dataclasses.fields(dc)}
        given: dict[str, Any] = {}
        for pair in _items(node):
            if not (isinstance(pair, list) and len(pair) == 2 and pair[0] in fields):
                raise Malformed(f"{dc.__qualname__} has no field {pair!r:.60}")
            given[pair[0]] = rec(pair[1])
        if set(given) != set(fields):
            raise Malformed(
                f"{dc.__qualname__} fields {sorted(fields)} != received {sorted(given)}"
            )
        obj = dc(**{k: v for k, v in given.items() if fields[k].init})
        for k, v in given.items():
            if not fields[k].init:
                object.__setattr__(obj, k, v)
        return obj
    raise Malformed(f"unknown node kind {kind!r}")


def rebuilder(tree: Any) -> Optional[Callable[[list], Any]]:
    """A function that rebuilds ``unflatten(tree, tensors)`` from the tensors
    alone, for a ``tree`` that :func:`unflatten` already accepted (checked
    once, rebuilt many times: the receiver of a channel with steady shapes),
    when it holds only tensors, plain leaves, tuples, lists and dicts; None
    otherwise (call :func:`unflatten`)."""
    if type(tree) is dict and tree.get("k") == "T":
        return operator.itemgetter(tree["i"])
    return _rebuilder(tree, 0)


def _rebuilder(node: Any, depth: int) -> Optional[Callable[[list], Any]]:
    if node is None or type(node) in (bool, int, float, str):
        return lambda tensors: node
    if type(node) is not dict or depth > _MAX_SIMPLE_DEPTH:
        return None
    kind = node.get("k")
    if kind == "T":
        return operator.itemgetter(node["i"])
    if kind in ("tuple", "list"):
        parts = _all_rebuilders([v for v in node["v"]], depth)
        if parts is None:
            return None
        if kind == "tuple":
            return lambda tensors: tuple([p(tensors) for p in parts])
        return lambda tensors: [p(tensors) for p in parts]
    if kind == "dict":
        keys = [k for k, _ in node["v"]]
        values = _all_rebuilders([v for _, v in node["v"]], depth)
        if values is None:
            return None
        return lambda tensors: {k: p(tensors) for k, p in zip(keys, values)}
    return None


def _all_rebuilders(nodes: list, depth: int) -> Optional[list[Callable[[list], Any]]]:
    """A rebuilder for each of ``nodes`` one level down, or None if one has none."""
    parts = [_rebuilder(v, depth + 1) for v in nodes]
    found = [p for p in parts if p is not None]
    return found if len(found) == len(parts) else None


def tensors_requiring_grad(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` with ``requires_grad``, in :func:`flatten` order:
    the same order on the sending and the receiving stage, so gradients sent
    back as a list line up with the tensors that produced them."""
    tensors: list[torch.Tensor] = []
    if _simple_key(obj, tensors, 0, keyed=False) is None:  # not simple (tensors partial)
        tensors = flatten(obj)[1]
    return [t for t in tensors if t.requires_grad]
