"""Sharded outputs: which classes of the file return sharded values.

What each class's ``__init__`` builds (:meth:`ShardedOutputs.class_info`):
submodules that are classes of this file (``self.cls = Head(...)``, also
``nn.ModuleDict`` entries) and ``nn.CrossEntropyLoss`` instances. A class
whose ``forward`` returns a sharded value, as is or as a tuple element, on
every return (:meth:`ShardedOutputs.forward_output`) has a *sharded output*;
the calls of a class that give sharded values (:meth:`ShardedOutputs.sources`)
are its non-gathered ``Col()`` submodules and its submodules with a sharded
output, also reached through them (``self.cls.predictions(...)``). The loss
planner computes the outputs to a fixpoint over the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import libcst as cst

from annot.rewriters.tp.constructors import ConstructorEdits
from annot.rewriters.tp.sharded import CYCLE, Env, Shard, Sharded, ShardedValues, meet, settle
from annot.rewriters.tp.syntax import (
    assignments,
    first_param,
    methods_of,
    returns,
    self_path,
    unpack,
)

__all__ = ["CROSS_ENTROPY_LOSS", "ClassInfo", "ShardedOutputs"]

CROSS_ENTROPY_LOSS = frozenset(
    {"torch.nn.CrossEntropyLoss", "torch.nn.modules.loss.CrossEntropyLoss"}
)


class ShardedOutputs(ShardedValues, ConstructorEdits):
    """What the classes of the file build and which of them return sharded values."""

    def self_name(self, fn: cst.FunctionDef) -> Optional[str]:
        static = any(
            self.qualified(
                d.decorator, frozenset({"builtins.staticmethod", "builtins.classmethod"})
            )
            for d in fn.decorators
        )
        first = None if static else first_param(fn)
        return first.name.value if first is not None else None

    def class_info(
        self,
        cls: cst.ClassDef,
        cols: dict[tuple[str, ...], Sharded],
        by_name: dict[str, cst.ClassDef],
    ) -> ClassInfo:
        """What ``__init__`` builds: submodules that are classes of this file
        (``self.cls = Head(...)``, also ModuleDict entries) and
        ``nn.CrossEntropyLoss`` instances (``self.loss_fct = CrossEntropyLoss()``)."""
        methods = methods_of(cls)
        info = ClassInfo(cls, cls.name.value, methods, cols)
        init = next((f for f in methods if f.name.value == "__init__"), None)
        self_name = self.self_name(init) if init is not None else None
        if init is None or self_name is None:
            return info
        values: dict[tuple[str, ...], list[Optional[cst.BaseExpression]]] = {}
        for stmt in assignments(init.body):
            targets = (
                [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
            )
            for target in targets:
                for el in unpack(target):
                    path = self_path(el, self_name)
                    if path is not None and len(path) == 1:
                        clean = el is target and len(targets) == 1
                        values.setdefault(path, []).append(stmt.value if clean else None)
                path = self_path(target, self_name)
                if path is not None and len(path) == 1 and stmt.value is not None:
                    for key, entry in self.module_dict_entries(stmt.value):
                        values.setdefault((path[0], key), []).append(entry)
        for path, vals in values.items():
            built = {
                v.func.value
                if isinstance(v, cst.Call)
                and isinstance(v.func, cst.Name)
                and v.func.value in by_name
                else None
                for v in vals
            }
            child = built.pop() if len(built) == 1 else None
            if child is not None:
                info.children[path] = child
            v = vals[0]
            if (
                len(path) == 1
                and len(vals) == 1
                and isinstance(v, cst.Call)
                and self.qualified(v.func, CROSS_ENTROPY_LOSS)
            ):
                info.loss_attrs[path[0]] = v
        return info

    def sources(
        self,
        info: ClassInfo,
        infos: dict[str, ClassInfo],
        outputs: dict[str, Shard],
        depth: int = 0,
    ) -> dict[tuple[str, ...], Shard]:
        """``self.<path>(...)`` calls of ``info``'s class that give sharded values:
        its own non-gathered Col() submodules and submodules with a sharded output
        (also reached through them: ``self.cls.predictions(...)``)."""
        sources: dict[tuple[str, ...], Shard] = dict(info.cols)
        for path, child in info.children.items():
            if outputs.get(child) is not None:
                sources[path] = outputs[child]
            if depth < 8:
                inner = self.sources(infos[child], infos, outputs, depth + 1)
                for sub, s in inner.items():
                    sources.setdefault(path + sub, s)
        return sources

    def forward_output(
        self, info: ClassInfo, infos: dict[str, ClassInfo], outputs: dict[str, Shard]
    ) -> Shard:
        """The sharding of what ``forward`` returns (None unless every return agrees)."""
        fn = next((f for f in info.methods if f.name.value == "forward"), None)
        self_name = self.self_name(fn) if fn is not None else None
        if fn is None or self_name is None:
            return None
        env = Env(self_name, self.sources(info, infos, outputs), info.loss_attrs)
        self.at = (info.node, fn)
        out: Shard = CYCLE
        if id(fn) not in self.returns:
            self.returns[id(fn)] = list(returns(fn.body))
        for ret in self.returns[id(fn)]:
            value = self.eval(ret.value, env, set()) if ret.value is not None else None
            out = meet(out, value)
        return settle(out)


@dataclass
class ClassInfo:
    node: cst.ClassDef
    name: str
    methods: list[cst.FunctionDef]
    cols: dict[tuple[str, ...], Sharded]
    children: dict[tuple[str, ...], str] = field(default_factory=dict)  # path -> class name
    loss_attrs: dict[str, cst.Call] = field(default_factory=dict)  # attr -> CrossEntropyLoss(...)
