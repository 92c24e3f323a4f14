"""The planner's step 2: the segments of a class's ``forward``, as code that runs.

Splitting at every split point gives one stage method per segment.
:func:`exec_class` compiles the rewritten class in a copy of the model
module's namespace (to be bound to a shallow copy of the built model, so each
segment runs the model's real code on its real weights); :func:`stage_modules`
finds the modules behind a segment's ``self`` paths and :func:`stage_fn`
wraps a stage method in :mod:`annot.plan.cost`'s calling convention.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import linecache
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.nn as nn

from annot.core.errors import PartitionError
from annot.plan.points import module_at

__all__ = ["exec_class", "stage_fn", "stage_modules"]


class _Holder(nn.Module):
    """The parameters and buffers a segment reads directly from the root model
    (``self.pos_emb``), registered as the same objects."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            key = name.replace(".", "_")
            if isinstance(t, nn.Parameter):
                self.register_parameter(key, t)
            else:
                self.register_buffer(key, t)


def stage_modules(model: nn.Module, paths: Sequence[str]) -> tuple[nn.Module, ...]:
    """The modules (and direct tensors) behind a stage's ``self`` paths:
    ``"h[2:4]"`` -> blocks 2 and 3; methods and plain attributes are skipped."""
    mods: dict[int, nn.Module] = {}
    loose: dict[str, torch.Tensor] = {}
    for p in paths:
        base, _, sl = p.partition("[")
        obj = module_at(model, base)
        if sl:
            lo, hi = sl.rstrip("]").split(":")
            if not isinstance(obj, (nn.ModuleList, nn.Sequential)):
                continue
            for m in list(obj)[int(lo or 0) : int(hi) if hi else None]:
                mods.setdefault(id(m), m)
        elif isinstance(obj, nn.Module):
            mods.setdefault(id(obj), obj)
        elif isinstance(obj, torch.Tensor):
            loose[p] = obj
    out = list(mods.values())
    if loose:
        out.append(_Holder(loose))
    return tuple(out)


def exec_class(text: str, qualname: str, cls: type, label: str) -> type:
    """The class ``qualname`` of the rewritten ``text``, executed in a copy of
    ``cls``'s module namespace (the module's other code does not run again)."""
    import sys

    tree = ast.parse(text)
    body: list[ast.stmt] = tree.body
    node: Optional[ast.ClassDef] = None
    for part in qualname.split("."):
        node = next((s for s in body if isinstance(s, ast.ClassDef) and s.name == part), None)
        if node is None:
            raise PartitionError(f"class {qualname} is missing from the rewritten source")
        body = node.body
    assert node is not None
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    filename = f"<annot plan {label} {digest}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    original = sys.modules.get(cls.__module__)
    ns: dict[str, Any] = dict(vars(original)) if original is not None else {}
    ns["__builtins__"] = __builtins__
    code = compile(ast.Module(body=[node], type_ignores=[]), filename, "exec")
    exec(code, ns)
    return ns[node.name]


def stage_fn(stage: Callable[..., Any], first: bool, kwargs: bool) -> Callable[..., Any]:
    """A segment callable in annot.plan.cost's convention: the first one takes the
    sample (spread when a tuple), each next one the dict the stage before returned.
    ``__wrapped__`` is the stage method, so the profile cache keys on its code."""
    spread = first and not kwargs

    def run(*args: Any) -> Any:
        return stage(*args) if spread else stage(**args[0])

    return functools.update_wrapper(run, stage, assigned=(), updated=())  # __wrapped__ only
