"""Rewrite ``@shard``-annotated model source into its tensor-parallel form.

``rewrite_tensor_parallel(source, tp)`` returns the source every tp rank runs
(Megatron's layout). For each hinted class:

1. Its hints are read from the decorator as literals (:mod:`rewriters.hint_reader`),
   or taken from ``extra_hints`` for a class the user cannot decorate.
2. In ``__init__``, each spec'd attribute's constructor is swapped, keeping the
   user's arguments as written::

       self.c_attn = nn.Linear(d, 3 * d)   ->  ColumnParallelLinear(d, 3 * d, chunks=3, tp=2)
       self.c_proj = nn.Linear(d, d)       ->  RowParallelLinear(d, d, tp=2)
       self.wte = nn.Embedding(V, d)       ->  VocabParallelEmbedding(V, d, tp=2)
       self.w = nn.Parameter(t)            ->  shard_parameter(nn.Parameter(t), dim=0, tp=2)

   ``Replicate()`` leaves the attribute alone. A spec'd name may also be a key
   of an ``nn.ModuleDict(dict(wte=...))`` / ``nn.ModuleDict({"wte": ...})``
   assigned in ``__init__`` (nanoGPT's ``self.transformer``).
3. ``local=`` sizes are divided by tp where they are *read*, in every method
   but ``__init__`` (constructors keep full sizes; the parallel layers divide
   internally): ``self.n_head`` -> ``self.n_head // 2``, and a plain local
   variable of a method with a listed name (``B, T, C = x.size()``) has its
   reads become ``C // 2``. Parentheses are added only where precedence needs
   them. Method *parameters* with a listed name are left alone: a caller in
   the class already passes the divided value.
4. ``F.cross_entropy(logits...)`` inside a hinted class, whose input provably
   comes from a non-gathered ``Col()`` submodule of the same class (directly, or
   through simple assignments and ``.view/.reshape/.float/.contiguous/.flatten/
   .to`` and slicing), becomes ``vocab_parallel_cross_entropy(...)`` with the
   same arguments.

   Any other use of a non-gathered ``Col()`` output is left as it is: that
   value is the *sharded output* (Megatron's ``parallel_output``), each rank
   holding its slice of the last dim. nanoGPT's inference branch
   ``logits = self.lm_head(x[:, [-1], :])`` therefore returns per-rank vocab
   slices; gather them (or use ``Col(gather=True)``) where full logits are
   needed.
5. The ``@shard(...)`` decorator is replaced by a comment line
   ``# annot: @shard(...) applied for tp=2``, so rewriting the result again
   changes nothing. Classes hinted through ``extra_hints`` get the same
   comment, and a class that already carries it is not rewritten twice.
6. The imports of the parallel layers are added with libcst's
   ``AddImportsVisitor``; everything else (comments, blank lines, the file's
   encoding, BOM and line endings) is kept. A file without hints comes back
   unchanged, byte for byte.

What the rewriter cannot make correct it refuses with a :class:`RewriteError`
at ``file:line:col`` (nothing partial is returned): a spec'd name that
``__init__`` never assigns, a spec on a constructor it does not know, a spec
that does not fit the layer (``Vocab()`` on a Linear), an attribute assigned
with different calls, and a ``local=`` name written by ``+=`` or declared
``global``/``nonlocal`` in a method. Not seen: sizes read through
``getattr(self, "n_head")`` and ``Col()`` outputs that reach the loss through a
helper function.

The result keeps the user's line numbers except for the added import lines
(after the existing imports) and multi-line ``@shard(...)`` decorators, which
collapse to one comment line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Optional, Union

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, ContextAwareTransformer
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import (
    ExpressionContext,
    ExpressionContextProvider,
    MetadataWrapper,
    ParentNodeProvider,
    QualifiedNameProvider,
    ScopeProvider,
)

from annot.errors import HintError, MeshError
from annot.hints import ShardSpec
from annot.specs import Col, P, Replicate, Row, Vocab
from rewriters.diagnostics import Locator, node_source, parse_source
from rewriters.hint_reader import find_hints, format_hint, has_qualified_name

__all__ = ["TensorParallelTransformer", "rewrite_tensor_parallel"]

TP_LAYERS = "runtime.tp_layers"
VOCAB_LOSS = "runtime.vocab_loss"

LINEAR = frozenset({"torch.nn.Linear", "torch.nn.modules.linear.Linear"})
EMBEDDING = frozenset({"torch.nn.Embedding", "torch.nn.modules.sparse.Embedding"})
PARAMETER = frozenset({"torch.nn.Parameter", "torch.nn.parameter.Parameter"})
MODULE_DICT = frozenset({"torch.nn.ModuleDict", "torch.nn.modules.container.ModuleDict"})
CROSS_ENTROPY = frozenset({"torch.nn.functional.cross_entropy"})
# Tensor methods that keep "this is a vocab-sharded logits tensor" true.
_KEEPS_SHARDING = frozenset(
    {"view", "reshape", "float", "double", "half", "bfloat16", "contiguous", "flatten", "to"}
)
_MARKER = "# annot: @shard("

_KIND_NAMES = {"linear": "nn.Linear", "embedding": "nn.Embedding", "parameter": "nn.Parameter"}
_SUPPORTED = (
    "annot shards nn.Linear (Col(), Row()), nn.Embedding (Vocab()) and nn.Parameter "
    "(P(...)); Replicate() keeps any attribute whole"
)

Source = Union[str, bytes]
Edit = Callable[[cst.CSTNode], cst.CSTNode]
# (class node, its hints, the @shard decorator or None when from extra_hints)
Target = tuple[cst.ClassDef, ShardSpec, Optional[cst.Decorator]]


def rewrite_tensor_parallel(
    source: Source,
    tp: int,
    *,
    path: str = "<string>",
    extra_hints: Optional[dict[str, ShardSpec]] = None,
) -> Source:
    """The tensor-parallel (degree ``tp``) version of ``source``.

    ``source`` is text or bytes; the result has the same type (bytes keep the
    file's encoding, BOM and line endings). ``extra_hints`` maps class names
    to :class:`ShardSpec` for hints given outside the source: a class without
    a ``@shard`` decorator is rewritten exactly as if decorated, and for a
    decorated class the given spec replaces the decorator's (the caller merges
    the two, as ``annot.parallelize`` does). Names not defined in ``source``
    are ignored (a model may span several files). Raises :class:`RewriteError` at
    ``path:line:col`` for anything it cannot rewrite safely.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise MeshError(f"rewrite_tensor_parallel(tp={tp!r}): tp must be an int >= 1")
    extra = _check_extra_hints(extra_hints)
    bom = ""
    if isinstance(source, str) and source.startswith("\ufeff"):
        bom = "\ufeff"  # libcst drops a BOM from text; put it back
    wrapper = MetadataWrapper(parse_source(source, path), unsafe_skip_copy=True)
    locate = Locator(wrapper, path)
    targets = _targets(wrapper, locate, extra)
    if not targets:
        return source
    context = CodemodContext(filename=path)
    transformer = TensorParallelTransformer(context, tp, targets, locate)
    module = wrapper.visit(transformer)
    for mod, name in sorted(transformer.needed_imports):
        AddImportsVisitor.add_needed_import(context, mod, name)
    module = AddImportsVisitor(context).transform_module(module)
    if isinstance(source, bytes):
        return module.bytes
    return bom + module.code


def _check_extra_hints(extra_hints: object) -> dict[str, ShardSpec]:
    if extra_hints is None:
        return {}
    if not isinstance(extra_hints, dict) or not all(
        isinstance(k, str) and isinstance(v, ShardSpec) for k, v in extra_hints.items()
    ):
        raise HintError(
            f"extra_hints={extra_hints!r}: expected {{class name: ShardSpec}}, e.g. "
            '{"MLP": ShardSpec({"c_fc": Col(), "c_proj": Row()})}'
        )
    return extra_hints


def _has_marker(cls: cst.ClassDef) -> bool:
    lines = list(cls.leading_lines) + list(cls.lines_after_decorators)
    for dec in cls.decorators:
        lines += dec.leading_lines
    return any(ln.comment is not None and ln.comment.value.startswith(_MARKER) for ln in lines)


def _targets(
    wrapper: MetadataWrapper, locate: Locator, extra: dict[str, ShardSpec]
) -> list[Target]:
    found = {id(h.node): h for h in find_hints(wrapper, "shard", locate.path)}
    targets: list[Target] = []
    for cls in m.findall(wrapper.module, m.ClassDef()):
        assert isinstance(cls, cst.ClassDef)
        name = cls.name.value
        hint = found.get(id(cls))
        if hint is not None:
            assert isinstance(hint.spec, ShardSpec)
            # extra hints replace the decorator's (the caller merged them)
            targets.append((cls, extra.get(name, hint.spec), hint.decorator))
        elif name in extra and not _has_marker(cls):
            targets.append((cls, extra[name], None))
    return targets


def _methods(cls: cst.ClassDef) -> list[cst.FunctionDef]:
    if not isinstance(cls.body, cst.IndentedBlock):
        return []
    return [s for s in cls.body.body if isinstance(s, cst.FunctionDef)]


def _first_param(fn: cst.FunctionDef) -> Optional[cst.Param]:
    params = list(fn.params.posonly_params) + list(fn.params.params)
    return params[0] if params else None


def _self_path(expr: cst.BaseExpression, self_name: str) -> Optional[tuple[str, ...]]:
    """``self.a.b`` -> ("a", "b"); None for anything not rooted at ``self``."""
    parts: list[str] = []
    while isinstance(expr, cst.Attribute):
        parts.append(expr.attr.value)
        expr = expr.value
    if isinstance(expr, cst.Name) and expr.value == self_name and parts:
        return tuple(reversed(parts))
    return None


def _with_args(call: cst.Call, func: cst.BaseExpression, extra: list[cst.Arg]) -> cst.Call:
    """``call`` with ``func`` swapped in and keyword args ``extra`` appended,
    following the call's own comma style (one per line stays one per line)."""
    args = list(call.args)
    if not args:
        return call.with_changes(func=func, args=extra)
    last = args[-1]
    sep = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    if len(args) >= 2 and isinstance(args[-2].comma, cst.Comma):
        sep = args[-2].comma
    elif isinstance(last.comma, cst.Comma) and not isinstance(
        last.comma.whitespace_after, cst.SimpleWhitespace
    ):
        sep = last.comma  # single argument written on its own line
    # a trailing comma and the space before ")" move to the end
    tail, tail_ws = last.comma, last.whitespace_after_arg
    args[-1] = last.with_changes(comma=sep, whitespace_after_arg=cst.SimpleWhitespace(""))
    new = [a.with_changes(comma=sep) for a in extra[:-1]]
    new.append(extra[-1].with_changes(comma=tail, whitespace_after_arg=tail_ws))
    return call.with_changes(func=func, args=args + new)


def _kwarg(name: str, value: str) -> cst.Arg:
    return cst.Arg(
        keyword=cst.Name(name),
        value=cst.parse_expression(value),
        equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
        ),
    )


class TensorParallelTransformer(ContextAwareTransformer):
    """Applies tensor-parallel hints to the classes in ``targets``.

    Each hinted class is planned when it is visited (all checks happen then,
    so a refusal comes before any output) into edits keyed by the original
    node; ``on_leave`` applies them to the updated nodes. The imports the
    result needs are left in :attr:`needed_imports` for ``AddImportsVisitor``.
    """

    METADATA_DEPENDENCIES = (
        QualifiedNameProvider,
        ScopeProvider,
        ParentNodeProvider,
        ExpressionContextProvider,
    )

    def __init__(
        self, context: CodemodContext, tp: int, targets: Iterable[Target], locate: Locator
    ) -> None:
        super().__init__(context)
        self.tp = tp
        self.targets = {id(cls): (cls, spec, dec) for cls, spec, dec in targets}
        self.locate = locate
        self.needed_imports: set[tuple[str, str]] = set()
        self._edits: dict[int, Edit] = {}

    # ---- traversal ---------------------------------------------------------

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        target = self.targets.get(id(node))
        if target is not None:
            _, spec, decorator = target
            self._plan_class(node, spec, decorator)

    def on_leave(self, original_node, updated_node):
        updated = super().on_leave(original_node, updated_node)
        edit = self._edits.get(id(original_node))
        return edit(updated) if edit is not None else updated

    def _edit(self, node: cst.CSTNode, edit: Edit) -> None:
        prev = self._edits.get(id(node))
        self._edits[id(node)] = edit if prev is None else (lambda n: edit(prev(n)))

    def _qualified(self, node: cst.CSTNode, names: frozenset[str]) -> bool:
        return has_qualified_name(self.get_metadata(QualifiedNameProvider, node, set()), names)

    # ---- one class -----------------------------------------------------------

    def _plan_class(
        self, cls: cst.ClassDef, spec: ShardSpec, decorator: Optional[cst.Decorator]
    ) -> None:
        methods = _methods(cls)
        init = next((f for f in methods if f.name.value == "__init__"), None)
        col_paths: set[tuple[str, ...]] = set()
        if spec.specs:
            if init is None or _first_param(init) is None:
                raise self.locate.error(
                    cls.name,
                    f"class {cls.name.value} has hints for {', '.join(spec.specs)} but no "
                    "__init__(self, ...) that assigns them; annot rewrites the constructors "
                    "called in __init__",
                )
            col_paths = self._plan_init(cls, init, spec, decorator)
        for fn in methods:
            if fn is not init:
                self._plan_locals(cls, fn, spec.local)
            if col_paths:
                self._plan_loss(fn, col_paths)
        index = None
        if decorator is not None:
            index = next(i for i, d in enumerate(cls.decorators) if d is decorator)
        self._edit(cls, lambda n: self._mark_class(n, spec, index))

    def _mark_class(self, cls: cst.CSTNode, spec: ShardSpec, index: Optional[int]) -> cst.CSTNode:
        """Drop the ``@shard`` decorator (at ``index``) and leave a comment in its place."""
        assert isinstance(cls, cst.ClassDef)
        note = cst.EmptyLine(
            indent=True,
            comment=cst.Comment(f"# annot: {format_hint(spec)} applied for tp={self.tp}"),
        )
        if index is None:
            return cls.with_changes(leading_lines=[*cls.leading_lines, note])
        decorators = list(cls.decorators)
        removed = decorators.pop(index)
        moved = [*removed.leading_lines, note]
        if index < len(decorators):
            after = decorators[index]
            decorators[index] = after.with_changes(leading_lines=[*moved, *after.leading_lines])
            return cls.with_changes(decorators=decorators)
        return cls.with_changes(
            decorators=decorators, lines_after_decorators=[*moved, *cls.lines_after_decorators]
        )

    # ---- __init__: swap constructors -------------------------------------------

    def _plan_init(
        self,
        cls: cst.ClassDef,
        init: cst.FunctionDef,
        spec: ShardSpec,
        decorator: Optional[cst.Decorator],
    ) -> set[tuple[str, ...]]:
        """Plan the constructor swaps; return the paths of non-gathered Col()
        submodules (``("lm_head",)``, ``("transformer", "lm_head")``)."""
        first = _first_param(init)
        assert first is not None
        sites, assigned = self._init_sites(init, first.name.value, spec)
        col_paths: set[tuple[str, ...]] = set()
        for name, s in spec.specs.items():
            found = sites.get(name, [])
            if not found:
                where = self._hint_arg(decorator, name) or cls.name
                listing = ", ".join(f"self.{a}" for a in assigned) or "no attributes"
                raise self.locate.error(
                    where,
                    f"{name}={s!r}: {cls.name.value}.__init__ never assigns self.{name} (it "
                    f"assigns {listing}); a hint names an attribute that __init__ sets, "
                    f"e.g. self.{name} = nn.Linear(...)",
                )
            if isinstance(s, Replicate):
                continue
            ctors = [(path, value, *self._constructor(value)) for path, value in found]
            _, first_value, first_kind, first_label = ctors[0]
            for _, value, kind, label in ctors[1:]:
                if (kind or label) != (first_kind or first_label):
                    raise self.locate.error(
                        value,
                        f"{name}={s!r}: self.{name} is assigned twice in __init__ with "
                        f"different calls ({first_label}(...) on line "
                        f"{self.locate.line(first_value)}, {label}(...) here); annot cannot "
                        "tell which one to shard, so assign it once",
                    )
            for path, value, kind, label in ctors:
                self._check_fits(name, s, value, kind, label)
                assert isinstance(value, cst.Call)
                self._plan_constructor(s, value)
                if isinstance(s, Col) and not s.gather:
                    col_paths.add(path)
        return col_paths

    def _init_sites(
        self, init: cst.FunctionDef, self_name: str, spec: ShardSpec
    ) -> tuple[dict[str, list[tuple[tuple[str, ...], cst.BaseExpression]]], list[str]]:
        """Where ``__init__`` assigns each spec'd name: ``{name: [(path, value)]}``,
        and every attribute it assigns (for messages)."""
        sites: dict[str, list[tuple[tuple[str, ...], cst.BaseExpression]]] = {}
        assigned: list[str] = []
        for stmt in _assignments(init.body):
            if isinstance(stmt, cst.Assign):
                targets = [t.target for t in stmt.targets]
            else:
                targets = [stmt.target]
            value = stmt.value
            for target in targets:
                for el in _unpack(target):
                    path = _self_path(el, self_name)
                    if path is None or len(path) != 1:
                        continue
                    name = path[0]
                    if name not in assigned:
                        assigned.append(name)
                    if name not in spec.specs:
                        continue
                    if el is not target or len(targets) > 1 or value is None:
                        raise self.locate.error(
                            el,
                            f"{name}={spec.specs[name]!r}: self.{name} is assigned in a "
                            "chained or unpacking assignment; annot rewrites "
                            f"self.{name} = nn.Linear(...) on its own line, so write it that way",
                        )
                    sites.setdefault(name, []).append((path, value))
                    continue
                path = _self_path(target, self_name)
                if path is None or len(path) != 1 or value is None:
                    continue
                for key, entry in self._module_dict_entries(value):
                    shown = f"{path[0]}.{key}"
                    if shown not in assigned:
                        assigned.append(shown)
                    if key in spec.specs:
                        sites.setdefault(key, []).append(((path[0], key), entry))
        return sites, assigned

    def _module_dict_entries(
        self, value: cst.BaseExpression
    ) -> list[tuple[str, cst.BaseExpression]]:
        """``nn.ModuleDict(dict(wte=X))`` / ``nn.ModuleDict({"wte": X})`` -> [("wte", X)]."""
        if not isinstance(value, cst.Call) or not self._qualified(value.func, MODULE_DICT):
            return []
        if len(value.args) != 1 or value.args[0].keyword is not None or value.args[0].star:
            return []
        arg = value.args[0].value
        out = []
        if isinstance(arg, cst.Call) and self._qualified(arg.func, frozenset({"builtins.dict"})):
            for a in arg.args:
                if a.keyword is not None:
                    out.append((a.keyword.value, a.value))
        elif isinstance(arg, cst.Dict):
            for el in arg.elements:
                if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString):
                    key = el.key.evaluated_value
                    if isinstance(key, str):
                        out.append((key, el.value))
        return out

    def _hint_arg(self, decorator: Optional[cst.Decorator], name: str) -> Optional[cst.Arg]:
        if decorator is None or not isinstance(decorator.decorator, cst.Call):
            return None
        for arg in decorator.decorator.args:
            if arg.keyword is not None and arg.keyword.value == name:
                return arg
        return None

    def _constructor(self, value: cst.BaseExpression) -> tuple[Optional[str], str]:
        """(kind, label): kind is "linear" / "embedding" / "parameter" or None
        for a call annot does not know; label is the callee as written."""
        if not isinstance(value, cst.Call):
            return None, node_source(value)
        label = node_source(value.func)
        for kind, names in (("linear", LINEAR), ("embedding", EMBEDDING), ("parameter", PARAMETER)):
            if self._qualified(value.func, names):
                return kind, label
        return None, label

    def _check_fits(
        self, name: str, s: object, value: cst.BaseExpression, kind: Optional[str], label: str
    ) -> None:
        want = {Col: "linear", Row: "linear", Vocab: "embedding", P: "parameter"}[type(s)]
        if kind == want:
            return
        head = f"{name}={s!r}: "
        if kind is None:
            what = f"{label}(...)" if isinstance(value, cst.Call) else label
            reason = (
                f"self.{name} is {what}, which annot does not know how to shard; "
                f"{_SUPPORTED}. Build it with a supported layer, or hint it Replicate()"
            )
        elif isinstance(s, Vocab):
            reason = (
                f"Vocab() splits the rows of an nn.Embedding, but self.{name} is an "
                f"{_KIND_NAMES[kind]}; "
                + (
                    "use Col() (its output feeds vocab_parallel_cross_entropy) or Row()"
                    if kind == "linear"
                    else 'give the parameter a partition spec such as P("tp", None)'
                )
            )
        elif isinstance(s, P):
            use = "Col() or Row()" if kind == "linear" else "Vocab()"
            reason = (
                f"P(...) splits a raw nn.Parameter, but self.{name} is an "
                f"{_KIND_NAMES[kind]}; use {use}"
            )
        elif kind == "embedding":
            reason = (
                f"{s!r} splits an nn.Linear, but self.{name} is an nn.Embedding; "
                "use Vocab() to split its rows"
            )
        else:
            reason = (
                f"self.{name} is an nn.Parameter; give it a partition spec such as "
                'P("tp", None) (split dim 0) or P(None, "tp") (split dim 1)'
            )
        raise self.locate.error(value, head + reason)

    def _plan_constructor(self, s: object, call: cst.Call) -> None:
        tp = _kwarg("tp", str(self.tp))
        if isinstance(s, P):
            dim = s.split_dim
            if dim is None:
                return  # P(None, None): replicated
            self.needed_imports.add((TP_LAYERS, "shard_parameter"))
            self._edit(
                call,
                lambda n: cst.Call(
                    func=cst.Name("shard_parameter"),
                    args=[
                        cst.Arg(n, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                        _kwarg("dim", str(dim)).with_changes(
                            comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
                        ),
                        tp,
                    ],
                ),
            )
            return
        extra = []
        if isinstance(s, Col):
            layer = "ColumnParallelLinear"
            if s.chunks != 1:
                extra.append(_kwarg("chunks", str(s.chunks)))
            if s.gather:
                extra.append(_kwarg("gather", "True"))
        elif isinstance(s, Row):
            layer = "RowParallelLinear"
        else:
            layer = "VocabParallelEmbedding"
        extra.append(tp)
        self.needed_imports.add((TP_LAYERS, layer))
        self._edit(call, lambda n: _with_args(n, cst.Name(layer), extra))

    # ---- other methods: per-rank sizes -------------------------------------------

    def _plan_locals(self, cls: cst.ClassDef, fn: cst.FunctionDef, local: tuple[str, ...]) -> None:
        if not local:
            return
        names = set(local)
        static = any(
            self._qualified(
                d.decorator, frozenset({"builtins.staticmethod", "builtins.classmethod"})
            )
            for d in fn.decorators
        )
        first = None if static else _first_param(fn)
        self_name = first.name.value if first is not None else None
        where = f"{cls.name.value}.{fn.name.value}"
        for node in _walk(fn.body):
            if isinstance(node, cst.AugAssign):
                t = node.target
                if isinstance(t, cst.Name):
                    name = t.value
                elif self_name is not None and _self_path(t, self_name) is not None:
                    name = t.attr.value if isinstance(t, cst.Attribute) else ""
                else:
                    continue
                if name in names:
                    raise self.locate.error(
                        node,
                        f"{name} is a per-rank size (local=) but {where} updates it with "
                        f"{node_source(node).strip()!r}; annot divides reads of {name} by tp "
                        "and cannot keep an in-place update correct: assign the result to a "
                        f"new name instead ({name}2 = {name} + ...)",
                    )
            elif isinstance(node, (cst.Global, cst.Nonlocal)):
                kw = "global" if isinstance(node, cst.Global) else "nonlocal"
                for item in node.names:
                    if item.name.value in names:
                        raise self.locate.error(
                            node,
                            f"{item.name.value} is a per-rank size (local=) but {where} "
                            f"declares it {kw}; annot divides reads of local names inside a "
                            "method only, so keep it a plain local variable or an attribute "
                            "of self",
                        )
        scope = self.get_metadata(ScopeProvider, fn.body, None)
        if scope is None:
            return
        reads: list[cst.CSTNode] = []
        for name in sorted(names):
            assignments = [a for a in scope.assignments[name] if a.scope is scope]
            params = [a for a in assignments if isinstance(a.node, cst.Param)]
            if params and len(params) != len(assignments):
                raise self.locate.error(
                    params[0].node,
                    f"{name} is a per-rank size (local=) and both a parameter of {where} and "
                    "reassigned in it; annot leaves parameters as passed (callers in the class "
                    "already pass divided sizes) and divides reads of local variables, so "
                    "give the reassigned value a different name",
                )
            if params:
                continue
            for a in assignments:
                for access in a.references:
                    if isinstance(access.node, cst.Name) and self._is_load(access.node):
                        reads.append(access.node)
        if self_name is not None:
            for a in scope.assignments[self_name]:
                if a.scope is not scope or not isinstance(a.node, cst.Param):
                    continue
                for access in a.references:
                    parent = self.get_metadata(ParentNodeProvider, access.node, None)
                    if (
                        isinstance(parent, cst.Attribute)
                        and parent.value is access.node
                        and parent.attr.value in names
                        and self._is_load(parent)
                    ):
                        reads.append(parent)
        seen: set[int] = set()
        for node in reads:
            if id(node) in seen:
                continue
            seen.add(id(node))
            self._edit(node, self._divider(self._needs_parens(node)))

    def _is_load(self, node: cst.CSTNode) -> bool:
        return self.get_metadata(ExpressionContextProvider, node, None) == ExpressionContext.LOAD

    def _divider(self, parens: bool) -> Edit:
        tp = self.tp

        def divide(n: cst.CSTNode) -> cst.CSTNode:
            assert isinstance(n, cst.BaseExpression)
            op = cst.BinaryOperation(left=n, operator=cst.FloorDivide(), right=cst.Integer(str(tp)))
            if parens:
                op = op.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            return op

        return divide

    def _needs_parens(self, node: cst.CSTNode) -> bool:
        """Does ``node // tp`` need parentheses where ``node`` stands?"""
        parent = self.get_metadata(ParentNodeProvider, node, None)
        if isinstance(parent, cst.Arg):
            return parent.star != ""
        if isinstance(parent, cst.BinaryOperation):
            if isinstance(parent.operator, (cst.Add, cst.Subtract)):
                return False
            return not (
                parent.left is node
                and isinstance(
                    parent.operator,
                    (cst.Multiply, cst.Divide, cst.FloorDivide, cst.Modulo, cst.MatrixMultiply),
                )
            )
        if isinstance(parent, cst.UnaryOperation):
            return not isinstance(parent.operator, cst.Not)
        return not isinstance(
            parent,
            (
                cst.Element,
                cst.Index,
                cst.Slice,
                cst.Assign,
                cst.AnnAssign,
                cst.AugAssign,
                cst.Return,
                cst.Expr,
                cst.Comparison,
                cst.ComparisonTarget,
                cst.BooleanOperation,
                cst.IfExp,
                cst.DictElement,
                cst.FormattedStringExpression,
                cst.ListComp,
                cst.SetComp,
                cst.GeneratorExp,
                cst.DictComp,
                cst.CompFor,
                cst.CompIf,
                cst.If,
                cst.While,
                cst.For,
                cst.Assert,
                cst.Yield,
                cst.Lambda,
            ),
        )

    # ---- vocab-parallel loss -------------------------------------------------------

    def _plan_loss(self, fn: cst.FunctionDef, col_paths: set[tuple[str, ...]]) -> None:
        first = _first_param(fn)
        if first is None:
            return
        self_name = first.name.value
        for call in m.findall(fn.body, m.Call()):
            assert isinstance(call, cst.Call)
            if not self._qualified(call.func, CROSS_ENTROPY):
                continue
            inp = next(
                (
                    a
                    for a in call.args
                    if (a.keyword is None and not a.star)
                    or (a.keyword is not None and a.keyword.value == "input")
                ),
                None,
            )
            if inp is None or not self._sharded(inp.value, self_name, col_paths, set()):
                continue
            self.needed_imports.add((VOCAB_LOSS, "vocab_parallel_cross_entropy"))
            self._edit(
                call,
                lambda n: n.with_changes(func=cst.Name("vocab_parallel_cross_entropy")),
            )

    def _sharded(
        self,
        expr: cst.BaseExpression,
        self_name: str,
        col_paths: set[tuple[str, ...]],
        seen: set[int],
    ) -> bool:
        """Is ``expr`` provably the (reshaped) output of a non-gathered Col()?"""
        if isinstance(expr, cst.Call):
            path = _self_path(expr.func, self_name)
            if path is not None:
                return path in col_paths
            func = expr.func
            if isinstance(func, cst.Attribute) and func.attr.value in _KEEPS_SHARDING:
                return self._sharded(func.value, self_name, col_paths, seen)
            return False
        if isinstance(expr, cst.Subscript):
            return self._sharded(expr.value, self_name, col_paths, seen)
        if not isinstance(expr, cst.Name):
            return False
        scope = self.get_metadata(ScopeProvider, expr, None)
        if scope is None:
            return False
        referents = [r for access in scope.accesses[expr] for r in access.referents]
        if not referents:
            return False
        for ref in referents:
            if id(ref.node) in seen:
                continue  # a cycle (x = x.float()): the other definitions decide
            seen.add(id(ref.node))
            value = self._assigned_value(ref.node)
            if value is None or not self._sharded(value, self_name, col_paths, seen):
                return False
        return True

    def _assigned_value(self, node: cst.CSTNode) -> Optional[cst.BaseExpression]:
        """The value of ``node = value`` when ``node`` is the only target."""
        parent = self.get_metadata(ParentNodeProvider, node, None)
        if isinstance(parent, cst.AssignTarget) and parent.target is node:
            stmt = self.get_metadata(ParentNodeProvider, parent, None)
            if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1:
                return stmt.value
        if isinstance(parent, cst.AnnAssign) and parent.target is node:
            return parent.value
        return None


def _walk(node: cst.CSTNode) -> Iterable[cst.CSTNode]:
    """Every descendant of ``node``, nested functions included."""
    for child in node.children:
        yield child
        yield from _walk(child)


def _assignments(node: cst.CSTNode) -> Iterable[Union[cst.Assign, cst.AnnAssign]]:
    """The assignments of one function body, in source order, not descending
    into nested functions, classes or lambdas."""
    for child in node.children:
        if isinstance(child, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        if isinstance(child, (cst.Assign, cst.AnnAssign)):
            yield child
        else:
            yield from _assignments(child)


def _unpack(target: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The simple targets of ``a, (b, c) = ...`` (or ``[target]``)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        out: list[cst.BaseExpression] = []
        for el in target.elements:
            out += _unpack(el.value)
        return out
    return [target]
