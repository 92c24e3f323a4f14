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

import dataclasses
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.nn as nn

from annot.core.hints import path_matches
from annot.core.specs import Col, Local, Row
from annot.hf.lora import is_lora_layer
from annot.rewriters.analysis.head_flow import Children, Flow, read_flow
from annot.rewriters.analysis.method_syntax import Method, parse_method

__all__ = ["Inferred", "infer_hints"]

#: weightless modules that act on each element (what an MLP may run between its Linears)
_ACTIVATION = re.compile(r"gelu|silu|swish|relu|mish|activation|dropout", re.IGNORECASE)
_GATED = re.compile(r"glu", re.IGNORECASE)  # SwiGLU, GeGLU: split the last dim in two
_NOT_ELEMENTWISE = {"Softmax", "Softmin", "LogSoftmax", "Softmax2d", "GLU", "MultiheadAttention"}


@dataclass
class Inferred:
    """Hints by path pattern, and a line for each Linear left whole and why."""

    hints: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    classes: dict[str, str] = field(default_factory=dict)  # class -> file:line of its forward
    checked: list[str] = field(default_factory=list)  # modules checked on the first call
    # the modules whose forward shows a split (its Col and Row Linears both under it),
    # in model order: what the first-call check runs whole
    splits: list[str] = field(default_factory=list)

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
    ) and not _GATED.search(type(m).__name__)


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
    try:
        return parse_method(*found) if found is not None else None
    except Exception:  # noqa: BLE001 (a lambda, a syntax libcst does not read: not followed)
        return None


@functools.cache
def _read(cls: Any, kids: Children, seed_input: bool = False) -> tuple[Optional[Flow], str]:
    """``(flow, file:line)`` of ``cls.forward`` with these children (the
    methods it calls read where called); None where its source cannot be read.
    ``seed_input``: read with the first argument sharded."""
    found = _source(cls.forward)
    if found is None:
        return None, ""
    source, path, first = found
    methods = functools.partial(_method, cls)
    try:
        flow = read_flow(source, kids, path, first, methods=methods, seed_input=seed_input)
    except Exception as exc:  # noqa: BLE001 (a reading that fails leaves every Linear whole)
        flow = Flow(notes=[f"forward not read ({type(exc).__name__}): every Linear stays whole"])
    return flow, f"{path}:{first}"


class _Reading:
    """Every module's forward read once, children first: a child's summary
    (it returns its columns' sharded output; its first argument reaches one
    Linear) is part of what its parent's reading is told."""

    def __init__(self) -> None:
        self.flows: dict[int, tuple[Optional[Flow], str]] = {}
        self.kids: dict[int, Children] = {}

    def flow(self, m: nn.Module) -> tuple[Optional[Flow], str]:
        if id(m) not in self.flows:
            self.flows[id(m)] = (None, "")  # (a module inside itself reads as nothing)
            cls: Any = type(m)
            if not cls.__module__.startswith("torch.nn.") and cls.forward is not nn.Module.forward:
                kids = self.children(m)
                if kids.linears or kids.sequences or kids.outputs or kids.row_inputs:
                    self.flows[id(m)] = _read(cls, kids)
        return self.flows[id(m)]

    def children(self, m: nn.Module) -> Children:
        if id(m) in self.kids:
            return self.kids[id(m)]
        base = _children(m)
        self.kids[id(m)] = base
        outputs, rows = [], []
        known = base.linears | base.sequences | base.elementwise
        for name, c in m.named_children():
            if name in known or isinstance(c, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
                continue
            flow = self.flow(c)[0]
            if flow is not None and flow.exports:
                outputs.append((name, flow.exports, flow.export_state, flow.export_local))
            cls: Any = type(c)
            if cls.__module__.startswith("torch.nn.") or cls.forward is nn.Module.forward:
                continue
            kids = self.children(c)
            if kids.linears:
                seeded = _read(cls, kids, seed_input=True)[0]
                if seeded is not None and seeded.row_input is not None:
                    rows.append((name, seeded.row_input))
        self.kids[id(m)] = dataclasses.replace(base, outputs=tuple(outputs), row_inputs=tuple(rows))
        return self.kids[id(m)]


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
    reading = _Reading()
    named = dict(model.named_modules())
    for path, m in named.items():
        if isinstance(m, nn.Sequential):
            mlp = _sequential(path, m)
            exact.update(mlp)
            out.splits += [path] if mlp else []
            continue
        flow, where = reading.flow(m)
        if flow is None:
            continue
        name = type(m).__qualname__
        if flow.specs and name not in out.classes:
            out.classes[name] = where
        for attr, spec in flow.specs.items():
            exact[_join(path, attr)] = spec
        if any(isinstance(s, Row) for s in flow.specs.values()):
            out.splits.append(path)
        if flow.local and any(isinstance(s, (Col, Row)) for s in flow.specs.values()):
            exact[path] = Local(*flow.local)
        for child, names in flow.child_local.items():
            exact[_join(path, child)] = Local(*names)
        notes = list(flow.notes)
        parent, _, me = path.rpartition(".")
        taken = reading.flow(named[parent])[0] if path else None
        for col, _ in flow.exports:  # split only where the caller takes them back
            if taken is None or f"{me}.{col}" not in taken.specs:
                notes.append(
                    f"self.{col}: left whole: its output is returned, and no caller "
                    "gives it to a Linear"
                )
        for note in notes:
            line = f"{name} ({where}): {note}"
            if line not in out.notes:
                out.notes.append(line)
    out.hints = _patterns(exact, set(named))
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
