"""The code of a stage split: one method per pipeline stage, written from a
:class:`annot.rewriters.split.forward_stages.ForwardStages`, and the transform that puts them in
the class.

:func:`build_stages` copies each stage's statements as written (a split loop
as its slice), gives stage ``k > 0`` the names crossing into it as parameters
and ends every stage but the last with ``return {"name": name, ...}``; each
comes with its :class:`StageMethod`. :class:`StageSplitTransformer` adds the
methods after forward, drops those of an earlier run and replaces the
``@stage`` decorator with a comment. :func:`output_arity`: the tuple length
forward returns, when every ``return`` agrees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import libcst as cst

from annot.rewriters.split.boundaries import SelfPaths
from annot.rewriters.split.forward_stages import ForwardStages, Splitter

__all__ = ["MethodStages", "StageMethod", "StageSplitTransformer", "build_stages", "output_arity"]


@dataclass(frozen=True)
class StageMethod:
    """One pipeline stage of ``forward``.

    ``inputs``: parameter names of the stage method (stage 0: forward's own
    signature, without ``self``). ``outputs``: the keys of the dict it
    returns, i.e. the next stage's inputs (None for the last stage, which
    returns forward's value). ``modules``: the ``self`` attribute paths the
    stage reads, as written (``"transformer.wte"``, ``"config"``), with loop
    slices as ``"transformer.h[0:2]"`` / ``"transformer.h[2:]"``; in a
    nested split, what a callee's stage reads as ``"model/layers[1:3]"``
    (the use ``layers[1:3]`` relative to the submodule ``model``).
    ``source``: the stage method's source. ``untouched``: the inputs its
    code neither reads nor rebinds (a stage before the last only hands them
    on; stage 0: parameters of forward it leaves as the caller gave them).
    """

    index: int
    method: str
    inputs: tuple[str, ...]
    outputs: Optional[tuple[str, ...]]
    modules: tuple[str, ...]
    source: str
    untouched: tuple[str, ...] = ()


def _strip_blank(lines: Sequence[cst.EmptyLine]) -> list[cst.EmptyLine]:
    lines = list(lines)
    while lines and lines[0].comment is None:
        lines.pop(0)
    return lines


def _return_dict(names: Sequence[str], maybe: frozenset) -> cst.SimpleStatementLine:
    parts = [f'"{n}": locals().get("{n}")' if n in maybe else f'"{n}": {n}' for n in names]
    items = ", ".join(parts)
    if len(items) > 72:  # one item a line, as a formatter would
        items = "\n" + "".join(f"    {p},\n" for p in parts)
    stmt = cst.ensure_type(cst.parse_statement(f"return {{{items}}}\n"), cst.SimpleStatementLine)
    if maybe:
        listed = ", ".join(n for n in names if n in maybe)
        comment = cst.EmptyLine(
            comment=cst.Comment(
                f"# annot: {listed} may be unassigned here (assigned on some paths only); "
                "None is sent then"
            )
        )
        stmt = stmt.with_changes(leading_lines=[comment])
    return stmt


def output_arity(returns: Sequence[cst.Return]) -> Optional[int]:
    arities = set()
    for r in returns:
        if not isinstance(r.value, cst.Tuple) or any(
            isinstance(e, cst.StarredElement) for e in r.value.elements
        ):
            return None
        arities.add(len(r.value.elements))
    return arities.pop() if len(arities) == 1 else None


def _with_methods(found: Mapping[str, None], methods: Mapping[str, cst.FunctionDef]):
    """``found`` plus what the class's own methods that it calls read from
    ``self`` (``self.head(x)`` uses ``lm_head`` when ``head`` does), transitively."""
    out = dict(found)
    todo = [p for p in found if p in methods]
    seen: set[str] = set()
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        fn = methods[name]
        positional = [*fn.params.posonly_params, *fn.params.params]
        if not positional:
            continue
        inner = SelfPaths(positional[0].name.value)
        fn.body.visit(inner)
        for p in inner.found:
            out.setdefault(p, None)
            if p in methods:
                todo.append(p)
    return tuple(out)


def _leading_lines(stmt: cst.BaseStatement) -> Sequence[cst.EmptyLine]:
    """A statement's comments and blank lines above it: every statement (a
    simple line or a compound one) has them, though BaseStatement does not
    declare them."""
    assert isinstance(stmt, (cst.SimpleStatementLine, cst.BaseCompoundStatement))
    return stmt.leading_lines


def build_stages(
    sp: Splitter, plan: ForwardStages, *, decorators: bool = True
) -> list[tuple[cst.FunctionDef, StageMethod]]:
    """The stage methods of ``plan`` (named ``sp.prefix + k``), each with its
    :class:`StageMethod`. ``decorators``: give each the split method's
    decorators; else only the first stage has them (a nested forward's wrap
    the call as a whole: argument defaults such as HF's
    ``@merge_with_config_defaults`` apply to the call's arguments, which the
    first stage takes, and would pass later stages arguments they lack)."""
    fwd = sp.forward
    units = plan.units
    ranges = plan.ranges
    out = []
    for k, (a, b) in enumerate(ranges):
        body: list[cst.BaseStatement] = []
        for u in range(a, b):
            node = units[u].node
            extra = plan.moved.get(units[u].item) if units[u].start in (None, 0) else None
            if extra:
                node = node.with_changes(leading_lines=[*extra, *_leading_lines(node)])
            body.append(node)
        body[0] = body[0].with_changes(leading_lines=_strip_blank(_leading_lines(body[0])))
        last = k == len(ranges) - 1
        if k == 0:
            params = fwd.params
            inputs = sp.params
        else:
            inputs = plan.crossings[k - 1].names
            params = cst.Parameters(
                params=[cst.Param(cst.Name(n)) for n in (sp.self_name, *inputs)]
            )
        outputs = None
        if not last:
            cr = plan.crossings[k]
            outputs = cr.names
            body.append(_return_dict(cr.names, cr.maybe_unbound))
        func = cst.FunctionDef(
            name=cst.Name(f"{sp.prefix}{k}"),
            params=params,
            body=fwd.body.with_changes(body=body, header=cst.TrailingWhitespace(), footer=())
            if isinstance(fwd.body, cst.IndentedBlock)
            else cst.IndentedBlock(body=body),
            decorators=fwd.decorators if decorators or k == 0 else (),
            whitespace_before_params=fwd.whitespace_before_params
            if k == 0
            else cst.SimpleWhitespace(""),
            returns=fwd.returns if last else None,
            leading_lines=[cst.EmptyLine(indent=False)],
        )
        paths = SelfPaths(sp.self_name)
        for stmt in body:
            stmt.visit(paths)
        modules = _with_methods(paths.found, sp.methods)
        src = cst.Module(body=[func.with_changes(leading_lines=())]).code
        touched = {
            n for u in range(a, b) for n in (*units[u].effects.reads, *units[u].effects.assigned)
        }
        untouched = tuple(n for n in inputs if n not in touched)
        method = StageMethod(k, func.name.value, tuple(inputs), outputs, modules, src, untouched)
        out.append((func, method))
    return out


# ---- the transform --------------------------------------------------------------


@dataclass(frozen=True)
class MethodStages:
    """Stage methods to put after ``method`` of a class, under ``header``;
    earlier ones named ``prefix + k`` are dropped."""

    method: str
    prefix: str
    header: str
    stages: Sequence[cst.FunctionDef]


class StageSplitTransformer(cst.CSTTransformer):
    """Rewrites classes: adds each class's stage methods after the method they
    split (dropping those of an earlier run) and, on the root class, replaces
    the ``@stage`` decorator with a comment. ``inserts``: by class node."""

    def __init__(
        self,
        inserts: Sequence[tuple[cst.ClassDef, MethodStages]],
        root: cst.ClassDef,
        decorator_index: Optional[int],
        decorator_comment: Optional[str],
    ) -> None:
        super().__init__()
        self.inserts: dict[int, list[MethodStages]] = {}
        for cls, ms in inserts:
            self.inserts.setdefault(id(cls), []).append(ms)
        self.root = root
        self.decorator_index = decorator_index
        self.decorator_comment = decorator_comment

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        todo = {ms.method: ms for ms in self.inserts.get(id(original), ())}
        if not todo:
            return updated
        prefixes = tuple(ms.prefix for ms in todo.values())
        block = updated.body
        assert isinstance(block, cst.IndentedBlock)  # it holds the split method's def
        new_body: list[cst.BaseStatement] = []
        for stmt in block.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value.startswith(prefixes):
                continue
            new_body.append(stmt)
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value in todo:
                ms = todo[stmt.name.value]
                first = ms.stages[0].with_changes(
                    leading_lines=[
                        cst.EmptyLine(indent=False),
                        *(cst.EmptyLine(comment=cst.Comment(h)) for h in ms.header.splitlines()),
                    ]
                )
                new_body += [first, *ms.stages[1:]]
        updated = updated.with_changes(body=block.with_changes(body=new_body))
        return self._drop_decorator(updated) if original is self.root else updated

    def _drop_decorator(self, cls: cst.ClassDef) -> cst.ClassDef:
        if self.decorator_comment is None or self.decorator_index is None:
            return cls
        decorators = list(cls.decorators)
        i = self.decorator_index
        dec = decorators.pop(i)
        lines = [*dec.leading_lines, cst.EmptyLine(comment=cst.Comment(self.decorator_comment))]
        if dec.trailing_whitespace.comment is not None:  # `@stage(...)  # why`
            lines.append(cst.EmptyLine(comment=dec.trailing_whitespace.comment))
        if i < len(decorators):
            decorators[i] = decorators[i].with_changes(
                leading_lines=[*lines, *decorators[i].leading_lines]
            )
            return cls.with_changes(decorators=decorators)
        return cls.with_changes(
            decorators=decorators, lines_after_decorators=[*lines, *cls.lines_after_decorators]
        )
