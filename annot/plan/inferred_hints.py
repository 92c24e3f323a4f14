"""Hints for a model that says nothing about tp: read off its classes' forwards.

For every module of the model whose class defines ``forward`` in Python,
:func:`annot.rewriters.analysis.head_flow.read_flow` follows each Linear's
output through that forward (heads split and merged back, an MLP's two
Linears) and names the head counts and widths to divide. An ``nn.Sequential``
of ``Linear``, element-wise steps and ``Linear`` is an MLP by its structure.
What is found becomes the hints a user would write, by path pattern
(``"layers.*.attn.qkv": Col(chunks=3)``); what cannot be followed stays whole,
said in :attr:`Inferred.notes`. The build checks the result like any hints
(the pre-flight) and against the single-device module on its first call
(:mod:`annot.build.inferred_check`).

    found = infer_hints(model)          # model: built, on meta is enough
    found.hints                         # {"layers.*.attn.qkv": Col(chunks=3), ...}
    print(found.source())               # the dict, as Python to paste and keep
"""

from __future__ import annotations

import functools
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Optional

import libcst as cst
import torch.nn as nn

from annot.core.hints import path_matches
from annot.core.specs import Col, Local, Row
from annot.hf.lora import is_lora_layer
from annot.rewriters.analysis.head_flow import Children, Flow, read_flow
from annot.rewriters.analysis.method_syntax import Method, parse_method

__all__ = ["Inferred", "infer_hints"]

#: weightless modules that act on each element (what an MLP may run between its Linears)
_ACTIVATION = re.compile(r"gelu|silu|swish|relu|mish|activation|dropout", re.IGNORECASE)
_NOT_ELEMENTWISE = {"Softmax", "Softmin", "LogSoftmax", "Softmax2d", "GLU", "MultiheadAttention"}


@dataclass
class Inferred:
    """Hints by path pattern, and a line for each Linear left whole and why."""

    hints: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    classes: dict[str, str] = field(default_factory=dict)  # class -> file:line of its forward
    checked: list[str] = field(default_factory=list)  # modules checked on the first call

    def why_nothing(self) -> str:
        """For the refusal of a model nothing splits: what the reading found."""
        if not self.notes:
            return ""
        return ". Read from the sources, every Linear stays whole:\n  " + "\n  ".join(
            self.notes[:8]
        )

    def source(self) -> str:
        """The hints as the dict a user writes (``annot hints`` prints it)."""
        lines = ["from annot import Col, Local, Replicate, Row", "", "HINTS = {"]
        lines += [f"    {k!r}: {v!r}," for k, v in self.hints.items()]
        lines.append("}")
        return "\n".join(lines)


def _linear_like(m: nn.Module) -> bool:
    """``nn.Linear``, transformers' ``Conv1D``, or a PEFT LoRA layer around one
    (its hint goes to the layer and its adapters: :func:`annot.hf.lora.lora_hints`)."""
    base = getattr(m, "base_layer", None)
    if is_lora_layer(m) and isinstance(base, nn.Module):
        return _linear_like(base)
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def _elementwise(m: nn.Module) -> bool:
    """A weightless activation or dropout: torch's, transformers', or a model's
    own by its name (``BloomGelu``; the first-call check covers a misnomer)."""
    if next(m.parameters(), None) is not None or type(m).__name__ in _NOT_ELEMENTWISE:
        return False
    where = type(m).__module__
    return (
        where in ("torch.nn.modules.activation", "torch.nn.modules.dropout")
        or isinstance(m, nn.Identity)
        or where.startswith("transformers.activations")
        or _ACTIVATION.search(type(m).__name__) is not None
    )


def _sequence_row(m: nn.Module) -> bool:
    """An ``nn.Sequential`` whose first step is a Linear (a gated output)."""
    return isinstance(m, nn.Sequential) and len(m) > 0 and _linear_like(m[0])


def _children(m: nn.Module) -> Children:
    linears, elementwise, weighted, sequences = set(), set(), set(), set()
    items = []
    for name, c in m.named_children():
        if isinstance(c, (nn.ModuleDict, nn.ModuleList)):
            items += [(f"{name}.{k}", cc) for k, cc in c.named_children()]
        items.append((name, c))
    for name, c in items:
        if _linear_like(c):
            linears.add(name)
        elif _sequence_row(c):
            sequences.add(name)
        elif _elementwise(c):
            elementwise.add(name)
        elif next(c.parameters(), None) is not None:
            weighted.add(name)
    params = {k for k, p in m._parameters.items() if p is not None}
    return Children(
        frozenset(linears),
        frozenset(elementwise),
        frozenset(weighted | sequences),
        frozenset(params),
        frozenset(sequences),
    )


def _source(fn) -> Optional[tuple[str, str, int]]:
    """``(dedented source, file, first line)`` of a Python function, or None."""
    fn = inspect.unwrap(fn)  # a decorated method: its own source
    try:
        lines, first = inspect.getsourcelines(fn)
        path = inspect.getsourcefile(fn) or "<unknown>"
    except (OSError, TypeError):
        return None
    return textwrap.dedent("".join(lines)), path, first


@functools.cache
def _method(cls: Any, name: str) -> Optional[Method]:
    """``cls``'s own method ``name`` (not ``nn.Module``'s), parsed, or None."""
    fn = getattr(cls, name, None)
    if not inspect.isfunction(fn) or getattr(nn.Module, name, None) is fn:
        return None
    found = _source(fn)
    return parse_method(*found) if found is not None else None


@functools.cache
def _read(cls: Any, kids: Children) -> tuple[Optional[Flow], str]:
    """``(flow, file:line)`` of ``cls.forward`` with these children (the
    methods it calls read where called); None where its source cannot be read."""
    found = _source(cls.forward)
    if found is None:
        return None, ""
    source, path, first = found
    try:
        flow = read_flow(source, kids, path, first, methods=functools.partial(_method, cls))
    except (RecursionError, cst.ParserSyntaxError) as exc:  # a reading, never a crash
        flow = Flow(notes=[f"forward not read ({type(exc).__name__}): every Linear stays whole"])
    return flow, f"{path}:{first}"


def _sequential(path: str, m: nn.Sequential) -> dict[str, Any]:
    """``Linear, element-wise..., Linear, element-wise...``: an MLP by its structure."""
    steps = list(m)
    linear_at = [i for i, s in enumerate(steps) if _linear_like(s)]
    if len(linear_at) != 2 or not all(
        _elementwise(s) for i, s in enumerate(steps) if i not in linear_at
    ):
        return {}
    a, b = linear_at
    return {_join(path, str(a)): Col(), _join(path, str(b)): Row()}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def infer_hints(model: nn.Module) -> Inferred:
    """The tp hints ``model``'s sources show (see the module's docstring)."""
    exact: dict[str, Any] = {}
    out = Inferred()
    for path, m in model.named_modules():
        if isinstance(m, nn.Sequential):
            exact.update(_sequential(path, m))
            continue
        cls: Any = type(m)
        if cls.__module__.startswith("torch.nn.") or cls.forward is nn.Module.forward:
            continue
        kids = _children(m)
        if not kids.linears and not kids.sequences:
            continue
        flow, where = _read(cls, kids)
        if flow is None:
            continue
        name = type(m).__qualname__
        if flow.specs and name not in out.classes:
            out.classes[name] = where
        for attr, spec in flow.specs.items():
            exact[_join(path, attr)] = spec
        if flow.local and any(isinstance(s, (Col, Row)) for s in flow.specs.values()):
            exact[path] = Local(*flow.local)
        for note in flow.notes:
            line = f"{name} ({where}): {note}"
            if line not in out.notes:
                out.notes.append(line)
    out.hints = _patterns(exact, {p for p, _ in model.named_modules()})
    return out


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def _patterns(exact: dict[str, Any], paths: set[str]) -> dict[str, Any]:
    """``exact`` with block indices as ``*`` where one spec holds for every
    path the pattern matches (``layers.*.attn.qkv``); exact paths elsewhere."""
    groups: dict[str, list[str]] = {}
    for key in exact:
        groups.setdefault(_INDEX.sub("*", key), []).append(key)
    out: dict[str, Any] = {}
    every = paths | set(exact)
    for pattern, keys in groups.items():
        specs = {repr(exact[k]) for k in keys}
        matched = {p for p in every if path_matches(pattern, p)}
        if len(specs) == 1 and matched <= set(keys) and "*" in pattern and len(keys) > 1:
            out[pattern] = exact[keys[0]]
        else:
            out.update({k: exact[k] for k in keys})
    return out
