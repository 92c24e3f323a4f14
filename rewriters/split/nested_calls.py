"""A boundary below a call: the statement that calls a nested forward, cut in pieces.

Real models keep their blocks below the root's ``forward``:
``LlamaForCausalLM.forward`` runs ``outputs = self.model(...)`` and
``LlamaModel.forward`` loops over ``self.layers``; timm's ``forward`` calls the
helper ``self.forward_features(x)``, which calls an ``nn.Sequential`` whole.
A boundary such as ``"model.layers.2"`` is then placed by following the call
chain: the statement that calls ``self.model`` is cut into pieces, one per
stage of the callee, and the callee is split in its own right::

    _annot_model = self.model._annot_stage_0(input_ids=input_ids, **kwargs)
    # --- stage boundary: model.layers.2
    outputs = self.model._annot_stage_1(**_annot_model)

A :class:`Callee` says what is called: a submodule whose class (defined in the
same file) has its ``forward`` split, a helper method of the same class split
the same way (``self._annot_forward_features_stage_0(x)``), or an
``nn.Sequential`` called whole, cut between its elements by slicing
(``self.blocks[:2](x)``, ``self.blocks[2:](_annot_blocks)``).

:func:`callee_of` finds the class of ``self.<path>`` from the ``__init__``
assignments of the class and of its bases in the file; :func:`call_pieces`
checks the statement and writes its pieces. What cannot be cut this way is
refused with the reason (a :class:`ValueError` the splitter turns into a
``RewriteError`` at ``file:line:col``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import libcst as cst

from annot.rewriters.split.boundaries import qualified

__all__ = ["Callee", "call_pieces", "callee_of", "stage_prefix"]

_SEQUENTIAL = {"torch.nn.Sequential", "torch.nn.modules.container.Sequential"}


def stage_prefix(method: str) -> str:
    """The names of a method's stage methods: ``_annot_stage_k`` for forward,
    ``_annot_<method>_stage_k`` for a helper method."""
    return "_annot_stage_" if method == "forward" else f"_annot_{method}_stage_"


@dataclass(frozen=True, eq=False)
class Callee:
    """What a cut statement calls. ``kind``: ``module`` (``self.<path>``, of
    class ``cls``, whose forward is split), ``method`` (the helper method
    ``path`` of the same class ``cls``) or ``sequential`` (an
    ``nn.Sequential`` called whole; ``cls`` None)."""

    kind: str
    path: str
    cls: Optional[cst.ClassDef]

    @property
    def method(self) -> str:
        return self.path if self.kind == "method" else "forward"

    def stage(self, self_name: str, k: int, start: int, stop: Optional[int]) -> cst.BaseExpression:
        """The expression that runs this callee's part ``k`` (elements
        ``start:stop`` of a sequential)."""
        owner = f"{self_name}.{self.path}"
        if self.kind == "sequential":
            lo = str(start) if start else ""
            hi = str(stop) if stop is not None else ""
            return cst.parse_expression(f"{owner}[{lo}:{hi}]")
        if self.kind == "method":
            return cst.parse_expression(f"{self_name}.{stage_prefix(self.path)}{k}")
        return cst.parse_expression(f"{owner}.{stage_prefix('forward')}{k}")


# ---- the class of self.<path> ------------------------------------------------------


def _classes(module: cst.Module) -> dict[str, cst.ClassDef]:
    return {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}


class _Assigned(cst.CSTVisitor):
    """``self.<name> = <value>`` statements of one ``__init__``."""

    def __init__(self, self_name: str, name: str) -> None:
        super().__init__()
        self.self_name = self_name
        self.name = name
        self.values: list[cst.BaseExpression] = []

    def _target(self, target: cst.BaseExpression, value: Optional[cst.BaseExpression]) -> None:
        if (
            value is not None
            and isinstance(target, cst.Attribute)
            and isinstance(target.value, cst.Name)
            and target.value.value == self.self_name
            and target.attr.value == self.name
        ):
            self.values.append(value)

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._target(t.target, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._target(node.target, node.value)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False  # nested functions are another scope


def _init_values(cls: cst.ClassDef, name: str) -> list[cst.BaseExpression]:
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
            params = [*stmt.params.posonly_params, *stmt.params.params]
            if not params:
                return []
            finder = _Assigned(params[0].name.value, name)
            stmt.body.visit(finder)
            return finder.values
    return []


def _bases(cls: cst.ClassDef, classes: Mapping[str, cst.ClassDef]) -> list[cst.ClassDef]:
    return [
        classes[b.value.value]
        for b in cls.bases
        if b.keyword is None and isinstance(b.value, cst.Name) and b.value.value in classes
    ]


def _lineage(cls: cst.ClassDef, classes: Mapping[str, cst.ClassDef]):
    """``cls``, then its bases defined in this file, breadth first, each once."""
    todo, seen = [cls], set()
    while todo:
        c = todo.pop(0)
        if id(c) not in seen:
            seen.add(id(c))
            yield c
            todo += _bases(c, classes)


def _is_sequential(qnames: Mapping, func: cst.BaseExpression, classes, seen=()) -> bool:
    if {q.name for q in qualified(qnames, func)} & _SEQUENTIAL:
        return True
    if isinstance(func, cst.Name) and func.value in classes and func.value not in seen:
        cls = classes[func.value]  # class Blocks(nn.Sequential) without its own forward
        own = any(
            isinstance(s, cst.FunctionDef) and s.name.value == "forward" for s in cls.body.body
        )
        return not own and any(
            _is_sequential(qnames, b.value, classes, (*seen, func.value)) for b in cls.bases
        )
    return False


def _attribute_class(
    module: cst.Module, qnames: Mapping, cls: cst.ClassDef, name: str
) -> Union[cst.ClassDef, str]:
    """The class ``self.<name>`` is built from in ``cls.__init__`` (or a base's),
    ``"sequential"``, or raise ValueError saying why it cannot be followed."""
    classes = _classes(module)
    for c in _lineage(cls, classes):
        values = _init_values(c, name)
        if values:
            built = {_built_by(module, qnames, v, classes) for v in values}
            if len(built) == 1:
                (only,) = built
                if only is not None:
                    return only
            shown = ", ".join(cst.Module([]).code_for_node(v).split("(")[0] for v in values)
            raise ValueError(
                f"self.{name} is built by `{shown}` in {c.name.value}.__init__, which is not a "
                "class of this file (nor one nn.Sequential): annot rewrite follows a call only "
                "into a class whose source it has"
            )
    raise ValueError(
        f"{cls.name.value}.__init__ (and its bases in this file) never assigns self.{name}, "
        "so annot rewrite cannot tell which forward it runs"
    )


def _built_by(module, qnames, value, classes) -> Union[cst.ClassDef, str, None]:
    if not isinstance(value, cst.Call):
        return None
    if _is_sequential(qnames, value.func, classes):
        return "sequential"
    if isinstance(value.func, cst.Name) and value.func.value in classes:
        return classes[value.func.value]
    return None


def callee_of(module: cst.Module, qnames: Mapping, cls: cst.ClassDef, path: str) -> Callee:
    """The callee ``self.<path>`` (a dotted path followed attribute by attribute
    through the classes' ``__init__``), or raise ValueError with the reason."""
    current: Union[cst.ClassDef, str] = cls
    for name in path.split("."):
        if not isinstance(current, cst.ClassDef):
            raise ValueError(f"self.{path}: an nn.Sequential has no attribute {name!r}")
        current = _attribute_class(module, qnames, current, name)
    if isinstance(current, str):
        return Callee("sequential", path, None)
    return Callee("module", path, _defines(module, current, "forward"))


def _defines(module: cst.Module, cls: cst.ClassDef, method: str) -> cst.ClassDef:
    """The class whose body defines ``method`` for ``cls``: itself, else the
    first base in this file that does (x-transformers' ``Decoder`` runs
    ``AttentionLayers.forward``); ``cls`` when none does (refused later)."""
    for c in _lineage(cls, _classes(module)):
        if any(isinstance(s, cst.FunctionDef) and s.name.value == method for s in c.body.body):
            return c
    return cls


# ---- the cut statement ---------------------------------------------------------------


_ON_PATH = (
    cst.Call,
    cst.Arg,
    cst.Attribute,
    cst.Subscript,
    cst.SubscriptElement,
    cst.Index,
    cst.BinaryOperation,
    cst.UnaryOperation,
    cst.Tuple,
    cst.List,
    cst.Element,
    cst.StarredElement,
)


class _Effects(cst.CSTVisitor):
    """Whether an expression may run code or bind names (a call, ``:=``,
    ``await``, ``yield``): what must not move from after a callee's first part
    to before it."""

    def __init__(self) -> None:
        super().__init__()
        self.found = False

    def visit_Call(self, node) -> bool:
        self.found = True
        return False

    visit_NamedExpr = visit_Await = visit_Yield = visit_Call


def _plain(node: cst.CSTNode) -> bool:
    """A value no callee can change: a local name or a literal."""
    return isinstance(node, (cst.Name, cst.Integer, cst.Float, cst.SimpleString))


def _moves_nothing(value: cst.CSTNode, call: cst.Call) -> bool:
    """Whether ``call`` sits in ``value`` such that nothing the callee's first
    part could change is evaluated before it: each node on the way down is an
    operation, a call, an argument, an attribute, a subscript or a display,
    and what it evaluates before the way down is a local name, a literal or
    the called method (``self.head(self.features(x))[0]``, ``h * self.f(x)``:
    yes; ``f(x) + self.f(x)``, ``self.scale * self.f(x)``, ``a if c else
    self.f(x)``, a comprehension: no)."""
    if value is call:
        return True
    if not isinstance(value, _ON_PATH):
        return False
    for child in value.children:
        if _moves_nothing(child, call):
            return True
        if not isinstance(child, cst.BaseExpression):
            continue  # parentheses, commas, operators
        if isinstance(value, cst.Arg) and child is value.keyword:
            continue
        effects = _Effects()
        child.visit(effects)
        method = isinstance(value, cst.Call) and child is value.func  # self.head(...)'s lookup
        if effects.found or not (method or _plain(child)):
            return False  # evaluated before the call: it would move after the callee's part
    return False


def _small(stmt: cst.BaseStatement, call: cst.Call) -> Optional[cst.BaseSmallStatement]:
    """The statement's one small statement when the callee's first parts can
    run before it: an assignment, expression or return whose value reaches
    ``call`` with only plain reads evaluated before it (see
    :func:`_moves_nothing`); else None."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if not isinstance(small, (cst.Assign, cst.AnnAssign, cst.Expr, cst.Return)):
        return None
    if small.value is None or not _moves_nothing(small.value, call):
        return None
    return small


class _Replace(cst.CSTTransformer):
    def __init__(self, old: cst.CSTNode, new: cst.CSTNode) -> None:
        super().__init__()
        self.old, self.new = old, new

    def on_leave(self, original, updated):
        return self.new if original is self.old else updated


def call_pieces(
    stmt: cst.BaseStatement,
    call: cst.Call,
    callee: Callee,
    self_name: str,
    boundaries: Sequence[str],
    taken: frozenset = frozenset(),
) -> list[cst.SimpleStatementLine]:
    """The pieces of ``stmt`` (which calls ``callee`` through ``call``), one per
    part of the callee cut at ``boundaries`` (paths relative to it; for a
    sequential, the elements where its parts begin). ``taken``: names the
    method uses, which the temporary holding the callee's state must not be.
    Raises ValueError with the reason when the statement cannot be cut."""
    if not isinstance(stmt, cst.SimpleStatementLine) or _small(stmt, call) is None:
        raise ValueError(
            f"the call of self.{callee.path} is evaluated after other calls of its statement "
            "(or under a condition, in a comprehension or in a compound statement), which "
            f"would then run after part of self.{callee.path}; assign its result to a name "
            f"in a statement of its own first: `out = self.{callee.path}(...)`"
        )
    sequential = callee.kind == "sequential"
    if sequential and (
        len(call.args) != 1 or call.args[0].keyword is not None or call.args[0].star
    ):
        raise ValueError(
            f"self.{callee.path} is an nn.Sequential, which takes one positional input"
        )
    temp = "_annot_" + callee.path.replace(".", "_")
    while temp in taken:  # a name of the user's
        temp += "_"
    carried = cst.Arg(cst.Name(temp), star="" if sequential else "**")
    n = len(boundaries) + 1
    starts = [0, *(int(b) for b in boundaries)] if sequential else [0] * n  # part k's first element
    pieces: list[cst.SimpleStatementLine] = []
    for k in range(n):
        run = cst.Call(
            func=callee.stage(self_name, k, starts[k], starts[k + 1] if k < n - 1 else None),
            args=list(call.args) if k == 0 else [carried],
        )
        if k == 0:
            run = run.with_changes(whitespace_before_args=call.whitespace_before_args)
        if k == n - 1:  # the statement itself, the call's last part in its place
            piece = cst.ensure_type(stmt.visit(_Replace(call, run)), cst.SimpleStatementLine)
        else:
            assign = cst.Assign(targets=[cst.AssignTarget(cst.Name(temp))], value=run)
            piece = cst.SimpleStatementLine(body=[assign])
        pieces.append(piece.with_changes(leading_lines=stmt.leading_lines if k == 0 else ()))
    return pieces
