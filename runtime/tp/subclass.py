"""What :mod:`annot.runtime.tp.convert` needs to take a layer subclass that
overrides ``forward``: which classes define it (:func:`forward_definers`),
whether a forward only post-processes ``super().forward(...)``
(:func:`reads_super`, read off its source), whether it equals the base
layer's on a small random probe (:func:`probe_equals_base`), and the parallel
layer class with that forward kept (:func:`composed_class`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["composed_class", "forward_definers", "probe_equals_base", "reads_super"]


def forward_definers(cls: type, base: type) -> list[type]:
    """The classes between ``cls`` and ``base`` (in MRO order) that define forward."""
    mro = cls.__mro__
    return [c for c in mro[: mro.index(base)] if "forward" in c.__dict__]


@functools.cache
def reads_super(definer: type) -> Optional[str]:
    """None when ``definer.forward`` post-processes zero-argument
    ``super().forward(...)``: its inputs go only into that call, and it reads
    ``self.weight`` / ``self.bias`` only for ``.dtype`` / ``.device``;
    otherwise the reason it does not."""
    fn = definer.__dict__["forward"]
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return "its source cannot be read"
    func = tree.body[0]
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or not func.args.args:
        return "it is not a plain method"
    me = func.args.args[0].arg
    inputs = {a.arg for a in func.args.args[1:] + func.args.kwonlyargs}
    inputs |= {a.arg for a in (func.args.vararg, func.args.kwarg) if a is not None}
    calls_super = False
    allowed: set[int] = set()
    passed: set[int] = set()  # nodes inside super().forward(...)'s arguments
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("dtype", "device")
            and isinstance(node.value, ast.Attribute)
        ):
            allowed.add(id(node.value))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "forward"
            and isinstance(node.func.value, ast.Call)
            and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "super"
            and not node.func.value.args
        ):
            calls_super = True
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                passed.update(id(n) for n in ast.walk(arg))
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and node.id in inputs and id(node) not in passed:
            return f"it reads its input {node.id} outside super().forward(...)"
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("weight", "bias")
            and isinstance(node.value, ast.Name)
            and node.value.id == me
            and id(node) not in allowed
        ):
            return f"it reads {me}.{node.attr} (line {node.lineno} of its forward)"
    return None if calls_super else "it does not call super().forward(...)"


def probe_equals_base(module: nn.Module, kind: str) -> Optional[str]:
    """None when the module's forward equals its base layer's on a small random
    probe with the module's own attributes; otherwise why not."""
    extra = [n for n in module._parameters if n not in ("weight", "bias")]
    extra += list(module._buffers) + list(module._modules)
    if extra:
        return f"it holds more than weight and bias ({', '.join(extra)})"
    with torch.device("cpu"):  # whatever device the model is being built on
        return _probe(module, kind)


def _probe(module: nn.Module, kind: str) -> Optional[str]:
    g = torch.Generator().manual_seed(0)
    probe = type(module).__new__(type(module))
    nn.Module.__init__(probe)
    probe.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
    has_bias = getattr(module, "bias", None) is not None
    if kind == "embedding":
        n, d = 7, 4
        # plain attributes: in __dict__, as nn.Embedding's are (nn.Module's
        # __setattr__ is typed for tensors and modules only)
        probe.__dict__.update(num_embeddings=n, embedding_dim=d, padding_idx=None)
        probe.weight = nn.Parameter(torch.randn(n, d, generator=g, dtype=torch.float64))
        x = torch.randint(0, n, (2, 5), generator=g)
        want = F.embedding(x, probe.weight)
    else:
        n_in, n_out = 5, 3
        shape = (n_out, n_in) if kind == "linear" else (n_in, n_out)
        probe.weight = nn.Parameter(torch.randn(shape, generator=g, dtype=torch.float64))
        bias = (
            nn.Parameter(torch.randn(n_out, generator=g, dtype=torch.float64)) if has_bias else None
        )
        if bias is None:
            probe.__dict__["bias"] = None  # where nn.Module's __setattr__ puts a None
        else:
            probe.bias = bias
        w: torch.Tensor
        if kind == "linear":
            probe.__dict__.update(in_features=n_in, out_features=n_out)
            w = probe.weight
        else:
            probe.__dict__.update(nx=n_in, nf=n_out)
            w = probe.weight.t()
        x = torch.randn(2, 4, n_in, generator=g, dtype=torch.float64)
        want = F.linear(x, w, bias)
    try:
        with torch.no_grad():
            got = probe(x)
    except Exception as err:  # noqa: BLE001 - any failure means "not provably the base layer"
        return f"its forward failed on a probe ({type(err).__name__}: {err})"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "its forward returns something other than the base layer's output"
    if not torch.allclose(got, want, rtol=1e-9, atol=1e-9):
        return "its forward computes something other than the base layer's output"
    return None


@functools.cache
def composed_class(parallel_cls: type, definer: type) -> type:
    """``parallel_cls`` with ``definer``'s forward, whose zero-argument
    ``super()`` resolves to ``parallel_cls``."""
    cls: type[Any] = type(
        f"{parallel_cls.__name__}_{definer.__name__}",
        (parallel_cls,),
        {"__module__": definer.__module__, "__doc__": definer.__doc__},
    )
    fn = definer.__dict__["forward"]
    cells = tuple(
        types.CellType(cls) if name == "__class__" else cell
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())
    )
    forward = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    forward.__kwdefaults__ = fn.__kwdefaults__
    forward.__qualname__ = f"{cls.__name__}.forward"
    cls.forward = forward
    return cls
