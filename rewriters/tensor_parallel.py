"""Rewrite ``@shard``-annotated model source into its tensor-parallel form.

``rewrite_tensor_parallel(source, tp)`` returns the source every tp rank runs
(Megatron's layout). For each hinted class:

1. Its hints are read from the decorator as literals (:mod:`annot.rewriters.hint_reader`),
   or taken from ``extra_hints`` for a class the user cannot decorate.
2. In ``__init__``, each spec'd attribute's constructor is swapped, keeping the
   user's arguments as written::

       self.c_attn = nn.Linear(d, 3 * d)   ->  ColumnParallelLinear(d, 3 * d, chunks=3, tp=2)
       self.c_proj = nn.Linear(d, d)       ->  RowParallelLinear(d, d, tp=2)
       self.wte = nn.Embedding(V, d)       ->  VocabParallelEmbedding(V, d, tp=2)
       self.w = nn.Parameter(t)            ->  shard_parameter(nn.Parameter(t), dim=0, tp=2)
       self.c_attn = Conv1D(3 * d, d)      ->  ColumnParallelConv1D(3 * d, d, chunks=3, tp=2)

   ``Conv1D`` is HF transformers' ``transformers.pytorch_utils.Conv1D``
   (GPT-2), matched by qualified name; relative imports (``from
   ...pytorch_utils import Conv1D``) are resolved against the package the
   file lives in (its parent directories with an ``__init__.py``).

   Any other constructor (a subclass such as ``FalconLinear(...)``, a factory
   ``linear_layer(...)``, ``partial(nn.Linear, bias=False)(...)``) is kept as
   written and what it builds is converted by its runtime type
   (:mod:`annot.runtime.tp_convert`)::

       self.fc1 = linear_layer(d, h)       ->  column_parallel(linear_layer(d, h), tp=2)

   ``Partial()`` (a module computing a partial sum, MoE experts) wraps the
   call the same way: ``partial_module(Experts(config), tp=2)``.
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
4. Vocab-parallel loss. A *sharded value* is the output of a non-gathered
   ``Col()`` (each rank holds its 1/tp slice of the last dim), followed
   through simple and tuple-unpacking assignments, ``.view/.reshape/.float/
   .contiguous/.flatten/.to``, slicing and tuple indexing. Across the classes
   of the file: a class whose ``forward`` returns a sharded value (as is or as
   a tuple element, on every return) has a *sharded output*, computed to a
   fixpoint, so in any class, hinted or not, ``self.cls(...)`` (also
   ``self.cls.predictions(...)``) with ``self.cls = Head(...)`` in ``__init__``
   gives a sharded value: Hugging Face's layout, the ``Col()`` in a head and
   the loss in the parent. Then, in any class of the file:

   - ``F.cross_entropy(x, ...)`` (any alias) on a sharded ``x`` becomes
     ``vocab_parallel_cross_entropy(x, ...)`` with the same arguments;
   - a call of an ``nn.CrossEntropyLoss(...)`` instance (built inline, in a
     local variable or as ``self.loss_fct`` in ``__init__``) on a sharded
     input becomes ``vocab_parallel_cross_entropy(x, y, <its constructor
     arguments as keywords>)``; arguments built away from the call must be
     literals (``ignore_index=-1``, ``reduction="sum"``);
   - refused: a sharded value passed to any other callee named like a loss
     (``self.loss_function(...)``, ``F.nll_loss``, ``nn.NLLLoss()(...)``), to
     ``softmax / log_softmax / argmax / argmin / topk`` (function or method),
     or reshaped on its way to a loss without provably keeping its last dim
     (``x.view(-1, config.vocab_size)``: write ``x.view(-1, x.size(-1))``).

   Any other use is left as it is: returning sharded logits from ``forward``
   is allowed, as Megatron's ``parallel_output``. nanoGPT's inference branch
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
``__init__`` never assigns, ``P(...)`` on something not an ``nn.Parameter``, a spec
that does not fit the layer (``Vocab()`` on a Linear), an attribute assigned
with different calls, and a ``local=`` name written by ``+=`` or declared
``global``/``nonlocal`` in a method, and the sharded-value uses of item 4.
Not seen: sizes read through ``getattr(self, "n_head")``; sharded values that
pass through a helper function, arithmetic (``logits / temperature``), a call
of ``self(...)``, a name also assigned something else anywhere in the method
(names are followed without regard to order), a returned dict or dataclass, or
a class in another file.

The result keeps the user's line numbers except for the added import lines
(after the existing imports) and multi-line ``@shard(...)`` decorators, which
collapse to one comment line.

Cost: one parse, a walk of the module's top level, of the hinted classes'
constructors and of the methods where sizes are divided or losses looked for,
and a transform that enters only the statements it changes; names are
resolved by :mod:`annot.rewriters.scopes` (libcst's scope rules, one method at a
time) and positions are computed only for a refusal. On a large model file
this is about the cost of libcst's own parse and codegen (``benchmarks/tp.py``
row (c)).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Optional, Union

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor

from annot.errors import HintError, MeshError, RewriteError
from annot.hints import ShardSpec
from annot.rewriters.diagnostics import Locator, children, is_a, node_source, parse_source
from annot.rewriters.hint_reader import find_hints, format_hint
from annot.rewriters.scopes import LOAD, Assignment, ModuleScopes
from annot.specs import Col, Heads, P, Partial, Replicate, Row, Vocab

__all__ = ["TensorParallelTransformer", "rewrite_tensor_parallel"]

TP_LAYERS = "annot.runtime.tp_layers"
VOCAB_LOSS = "annot.runtime.vocab_loss"
TP_CONVERT = "annot.runtime.tp_convert"

LINEAR = frozenset({"torch.nn.Linear", "torch.nn.modules.linear.Linear"})
EMBEDDING = frozenset({"torch.nn.Embedding", "torch.nn.modules.sparse.Embedding"})
# HF transformers' GPT-2 projection: a Linear with weight (in, out), built as Conv1D(nf=out, nx=in).
CONV1D = frozenset({"transformers.pytorch_utils.Conv1D", "transformers.Conv1D"})
PARAMETER = frozenset({"torch.nn.Parameter", "torch.nn.parameter.Parameter"})
MODULE_DICT = frozenset({"torch.nn.ModuleDict", "torch.nn.modules.container.ModuleDict"})
CROSS_ENTROPY = frozenset({"torch.nn.functional.cross_entropy"})
CROSS_ENTROPY_LOSS = frozenset(
    {"torch.nn.CrossEntropyLoss", "torch.nn.modules.loss.CrossEntropyLoss"}
)
# nn.CrossEntropyLoss's constructor parameters, in order: also F.cross_entropy's keywords
_LOSS_PARAMS = ("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
# Functions over a row of logits that are wrong on one rank's slice of it.
_NEEDS_FULL_ROW = frozenset(
    f"{mod}.{fn}"
    for mod in ("torch", "torch.nn.functional", "torch.special")
    for fn in ("softmax", "log_softmax", "argmax", "argmin", "topk")
)
_NEEDS_FULL_ROW_METHODS = frozenset({"softmax", "log_softmax", "argmax", "argmin", "topk"})
# Tensor methods that keep "this is a vocab-sharded logits tensor" true.
_KEEPS_SHARDING = frozenset(
    {"view", "reshape", "float", "double", "half", "bfloat16", "contiguous", "flatten", "to"}
)
_MARKER = "# annot: @shard("

_KIND_NAMES = {
    "linear": "nn.Linear",
    "conv1d": "transformers Conv1D",
    "embedding": "nn.Embedding",
    "parameter": "nn.Parameter",
}
# (HF transformers' Conv1D is accepted wherever nn.Linear is; the message keeps to torch's layers)
_SUPPORTED = (
    "annot shards nn.Linear (Col(), Row()), nn.Embedding (Vocab(), Col()) and nn.Parameter "
    "(P(...)); Replicate() keeps any attribute whole"
)
# (Col / Row layer) for each linear-like kind
_LAYERS = {
    "linear": ("ColumnParallelLinear", "RowParallelLinear"),
    "conv1d": ("ColumnParallelConv1D", "RowParallelConv1D"),
}

Source = Union[str, bytes]
Edit = Callable[[cst.CSTNode], cst.CSTNode]
# (class node, its hints, the @shard decorator or None when from extra_hints)
Target = tuple[cst.ClassDef, ShardSpec, Optional[cst.Decorator]]
# a class, and the method of it being planned (None: the class itself)
_Where = tuple[cst.ClassDef, Optional[cst.FunctionDef]]


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
    module = parse_source(source, path)
    text = _text(source, module)
    scopes = ModuleScopes(module, text)
    locate = Locator(module, path)
    targets = _targets(module, scopes, locate, extra)
    if not targets:
        return source
    context = CodemodContext(filename=path)
    transformer = TensorParallelTransformer(
        context, tp, targets, locate, package=_package_of(path), scopes=scopes, text=text
    )
    module = module.visit(transformer)
    if transformer.needed_imports:
        for mod, name in sorted(transformer.needed_imports):
            AddImportsVisitor.add_needed_import(context, mod, name)
        module = _add_imports(module, context)
    if isinstance(source, bytes):
        return module.bytes
    return bom + module.code


def _text(source: Source, module: cst.Module) -> Optional[str]:
    """The source as text (None when bytes do not decode: then nothing is skipped)."""
    if isinstance(source, str):
        return source
    try:
        return source.decode(module.encoding)
    except (LookupError, UnicodeDecodeError):
        return None


_IMPORT_LINE = m.SimpleStatementLine(body=[m.ImportFrom() | m.Import()])
_DOCSTRING_OR_STRICT = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(target=m.Name("__strict__"))])]
) | m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString())])


def _add_imports(module: cst.Module, context: CodemodContext) -> cst.Module:
    """``AddImportsVisitor`` run on the statements it reads and edits only: the
    docstring, the first block of imports and the statement after it (which may
    get a blank line before it). A class or other compound statement there is
    stood in for by a ``pass`` line with its leading lines: the visitor would
    copy and walk all of it."""
    body = list(module.body)
    start = 1 if body and m.matches(body[0], _DOCSTRING_OR_STRICT) else 0
    end = start
    while end < len(body) and m.matches(body[end], _IMPORT_LINE):
        end += 1
    head = body[: end + 1]
    after = body[end] if end < len(body) else None
    if isinstance(after, cst.BaseCompoundStatement):
        head[-1] = cst.SimpleStatementLine([cst.Pass()], leading_lines=after.leading_lines)
    new_head = list(
        AddImportsVisitor(context).transform_module(module.with_changes(body=head)).body
    )
    if isinstance(after, cst.BaseCompoundStatement):
        new_head[-1] = after.with_changes(leading_lines=new_head[-1].leading_lines)
    return module.with_changes(body=[*new_head, *body[end + 1 :]])


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


def _package_of(path: str) -> Optional[str]:
    """The dotted package a source file belongs to (``.../transformers/models/gpt2/
    modeling_gpt2.py`` -> ``transformers.models.gpt2``): its parent directories
    that hold an ``__init__.py``. None for a file outside any package."""
    import os

    if not path or path.startswith("<"):
        return None
    parts: list[str] = []
    d = os.path.dirname(os.path.abspath(path))
    while os.path.isfile(os.path.join(d, "__init__.py")):
        parts.append(os.path.basename(d))
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return ".".join(reversed(parts)) or None


def _absolute(name: str, package: Optional[str]) -> str:
    """``...pytorch_utils.Conv1D`` in package ``transformers.models.gpt2`` ->
    ``transformers.pytorch_utils.Conv1D`` (a name from a relative import, as
    ``QualifiedNameProvider`` reports it). Other names are returned as they are."""
    if not name.startswith(".") or package is None:
        return name
    rest = name.lstrip(".")
    up = len(name) - len(rest)
    base = package.split(".")
    if up - 1 >= len(base):
        return name  # beyond the top-level package: leave it unresolved
    base = base[: len(base) - (up - 1)]
    return ".".join(base + ([rest] if rest else []))


def _has_marker(cls: cst.ClassDef) -> bool:
    lines = list(cls.leading_lines) + list(cls.lines_after_decorators)
    for dec in cls.decorators:
        lines += dec.leading_lines
    return any(ln.comment is not None and ln.comment.value.startswith(_MARKER) for ln in lines)


def _targets(
    module: cst.Module, scopes: ModuleScopes, locate: Locator, extra: dict[str, ShardSpec]
) -> list[Target]:
    found = {id(h.node): h for h in find_hints(module, "shard", locate.path, scopes=scopes)}
    targets: list[Target] = []
    for cls in scopes.classes:
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


class TensorParallelTransformer(cst.CSTTransformer):
    """Applies tensor-parallel hints to the classes in ``targets``.

    Everything is planned when the module is visited (all checks happen then,
    so a refusal comes before any output) into edits keyed by the original
    node; the transform then enters only the nodes that hold an edit, and
    ``on_leave`` applies the edits to the updated nodes. The imports the
    result needs are left in :attr:`needed_imports` for ``AddImportsVisitor``
    (``context`` is where the caller gathers them).

    ``scopes`` is the module's :class:`~annot.rewriters.scopes.ModuleScopes` (built
    from the visited module when not given); ``text`` its source, used to skip
    what cannot apply (no ``CrossEntropyLoss`` in the file: no loss module).
    """

    def __init__(
        self,
        context: CodemodContext,
        tp: int,
        targets: Iterable[Target],
        locate: Locator,
        package: Optional[str] = None,
        *,
        scopes: Optional[ModuleScopes] = None,
        text: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.context = context
        self.tp = tp
        self.package = package  # resolves names from relative imports
        self.targets = {id(cls): (cls, spec, dec) for cls, spec, dec in targets}
        self.locate = locate
        self.scopes = scopes
        self.needed_imports: set[tuple[str, str]] = set()
        self._loss_modules = text is None or "CrossEntropyLoss" in text
        self._edits: dict[int, Edit] = {}
        # the class and method being planned; those edited, to enter them
        self._at: Optional[_Where] = None
        self._edited: dict[int, tuple[_Where, list[cst.CSTNode]]] = {}
        self._enter: set[int] = set()
        self._reached: dict[int, Optional[list[Assignment]]] = {}
        self._returns: dict[int, list[cst.Return]] = {}  # forward's, read at every round

    # ---- traversal ---------------------------------------------------------

    def visit_Module(self, node: cst.Module) -> bool:
        # Everything is planned up front: the hinted classes (in source order),
        # then the losses of every class, which need the whole file's sharded outputs.
        if self.scopes is None or self.scopes.module is not node:
            self.scopes = ModuleScopes(node)
        cols: dict[int, dict[tuple[str, ...], _Sharded]] = {}
        for cls, spec, decorator in self.targets.values():
            cols[id(cls)] = self._plan_class(cls, spec, decorator)
        self._plan_losses(cols)
        self._enter = self._holding_edits(node)
        return True

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.Module):
            return self.visit_Module(node)
        return id(node) in self._enter  # leave alone what holds no edit

    def on_leave(self, original_node, updated_node):
        updated = super().on_leave(original_node, updated_node)
        edit = self._edits.get(id(original_node))
        return edit(updated) if edit is not None else updated

    def _edit(self, node: cst.CSTNode, edit: Edit) -> None:
        prev = self._edits.get(id(node))
        self._edits[id(node)] = edit if prev is None else (lambda n: edit(prev(n)))
        assert self._at is not None
        cls, fn = self._at
        self._edited.setdefault(id(fn if fn is not None else cls), (self._at, []))[1].append(node)

    def _holding_edits(self, module: cst.Module) -> set[int]:
        """The nodes the transform must enter: those with an edited node below."""
        assert self.scopes is not None
        enter = {id(module)}
        for (cls, fn), nodes in self._edited.values():
            enter.update(id(n) for n in self.scopes.ancestors(cls))
            if fn is not None:
                enter.update((id(cls), id(cls.body)))
                if not self._climb(fn, nodes, enter):
                    self._mark(fn, enter)
        return enter

    def _climb(self, fn: cst.FunctionDef, nodes: list[cst.CSTNode], enter: set[int]) -> bool:
        """Enter the ancestors of ``nodes`` up to ``fn``, by the parents an
        analysed method knows; False when it was not analysed."""
        assert self.scopes is not None
        found: list[int] = []
        for node in nodes:
            cur = self.scopes.parent(node)
            while cur is not None and cur is not fn:
                found.append(id(cur))
                cur = self.scopes.parent(cur)
            if cur is None:
                return False
        enter.update(found)
        enter.add(id(fn))
        return True

    def _mark(self, node: cst.CSTNode, enter: set[int]) -> bool:
        below = False
        for child in children(node):
            below = self._mark(child, enter) or below
        if below:
            enter.add(id(node))
        return below or id(node) in self._edits

    def _qualified(self, node: cst.CSTNode, names: frozenset[str]) -> bool:
        assert self.scopes is not None
        qnames = self.scopes.qualified_names(node)
        if not qnames.isdisjoint(names):
            return True
        return any(q.startswith(".") and _absolute(q, self.package) in names for q in qnames)

    # ---- one class -----------------------------------------------------------

    def _plan_class(
        self, cls: cst.ClassDef, spec: ShardSpec, decorator: Optional[cst.Decorator]
    ) -> dict[tuple[str, ...], _Sharded]:
        """Plan the constructor swaps and local sizes of one hinted class;
        return its non-gathered Col() submodules by path."""
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
            self._at = (cls, init)
            col_paths = self._plan_init(cls, init, spec, decorator)
        for fn in methods:
            if fn is not init:
                self._at = (cls, fn)
                self._plan_locals(cls, fn, spec.local)
        index = None
        if decorator is not None:
            index = next(i for i, d in enumerate(cls.decorators) if d is decorator)
        self._at = (cls, None)
        self._edit(cls, lambda n: self._mark_class(n, spec, index))
        name = cls.name.value
        return {p: _Sharded(name, p[-1], ".".join((name, *p))) for p in sorted(col_paths)}

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
            if isinstance(s, Heads):  # a forward argument: sliced at runtime, by path
                continue
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
            if isinstance(s, Partial):  # any module: its calls are wrapped, not swapped
                for _, value in found:
                    self._plan_conversion(s, value)
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
                if kind is None:
                    self._plan_conversion(s, value)
                else:
                    assert isinstance(value, cst.Call)
                    self._plan_constructor(s, value, kind)
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
        """(kind, label): kind is "linear" / "conv1d" / "embedding" / "parameter"
        or None for a call annot does not know; label is the callee as written."""
        if not isinstance(value, cst.Call):
            return None, node_source(value)
        label = node_source(value.func)
        for kind, names in (
            ("linear", LINEAR),
            ("conv1d", CONV1D),
            ("embedding", EMBEDDING),
            ("parameter", PARAMETER),
        ):
            if self._qualified(value.func, names):
                return kind, label
        return None, label

    def _check_fits(
        self, name: str, s: object, value: cst.BaseExpression, kind: Optional[str], label: str
    ) -> None:
        want = {Col: "linear", Row: "linear", Vocab: "embedding", P: "parameter"}[type(s)]
        if kind == want or (want == "linear" and kind == "conv1d"):
            return
        if isinstance(s, Col) and kind == "embedding" and s.chunks == 1:
            return  # its columns: ColumnParallelEmbedding
        if kind is None and want != "parameter":
            return  # built as written, converted by its runtime type (annot.runtime.tp_convert)
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
                    if kind in _LAYERS
                    else 'give the parameter a partition spec such as P("tp", None)'
                )
            )
        elif isinstance(s, P):
            use = "Col() or Row()" if kind in _LAYERS else "Vocab()"
            reason = (
                f"P(...) splits a raw nn.Parameter, but self.{name} is an "
                f"{_KIND_NAMES[kind]}; use {use}"
            )
        elif kind == "embedding":
            reason = (
                f"{s!r} splits an nn.Linear, but self.{name} is an nn.Embedding; "
                "use Vocab() to split its rows, or Col() (no chunks) its columns"
            )
        else:
            reason = (
                f"self.{name} is an nn.Parameter; give it a partition spec such as "
                'P("tp", None) (split dim 0) or P(None, "tp") (split dim 1)'
            )
        raise self.locate.error(value, head + reason)

    def _plan_conversion(self, s: object, value: cst.BaseExpression) -> None:
        """A layer built by a call annot cannot name (a subclass, a factory,
        ``partial(nn.Linear, ...)``): keep the call and convert what it builds,
        ``column_parallel(linear_layer(d, h), tp=2)``, by its runtime type."""
        args = []
        if isinstance(s, Col):
            fn = "column_parallel"
            if s.chunks != 1:
                args.append(_kwarg("chunks", str(s.chunks)))
            if s.gather:
                args.append(_kwarg("gather", "True"))
        elif isinstance(s, Partial):
            fn = "partial_module"
        else:
            fn = "row_parallel" if isinstance(s, Row) else "vocab_parallel"
            if isinstance(s, Row) and s.split_input:
                args.append(_kwarg("split_input", "True"))
        args.append(_kwarg("tp", str(self.tp)))
        self.needed_imports.add((TP_CONVERT, fn))
        space = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        self._edit(
            value,
            lambda n: cst.Call(
                func=cst.Name(fn),
                args=[
                    cst.Arg(n, comma=space),
                    *(a.with_changes(comma=space) for a in args[:-1]),
                    args[-1],
                ],
            ),
        )

    def _plan_constructor(self, s: object, call: cst.Call, kind: Optional[str] = None) -> None:
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
                        *(
                            a.with_changes(
                                comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
                            )
                            for a in [_kwarg("dim", str(dim))]
                            + ([_kwarg("chunks", str(s.chunks))] if s.chunks != 1 else [])
                        ),
                        tp,
                    ],
                ),
            )
            return
        extra = []
        col, row = _LAYERS["conv1d" if kind == "conv1d" else "linear"]
        if kind == "embedding":
            col = "ColumnParallelEmbedding"  # Col() on an embedding: its columns
        if isinstance(s, Col):
            layer = col
            if s.chunks != 1:
                extra.append(_kwarg("chunks", str(s.chunks)))
            if s.gather:
                extra.append(_kwarg("gather", "True"))
        elif isinstance(s, Row):
            layer = row
            if s.split_input:
                extra.append(_kwarg("split_input", "True"))
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
        assert self.scopes is not None
        self.scopes.prepare(cls, fn)
        scope = self.scopes.scope(fn.body)
        if scope is None:
            return
        reads: list[cst.CSTNode] = []
        for name in sorted(names):
            assignments = scope.own(name)
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
            divided = [self._reads_divided(a.node, self_name, names) for a in assignments]
            if all(divided):
                continue  # e.g. kv = self.n_head if ... else self.n_kv: already per rank
            if any(divided):
                a = assignments[divided.index(True)]
                raise self.locate.error(
                    a.node,
                    f"{name} is a per-rank size (local=) that {where} assigns both from "
                    "per-rank sizes of self (here) and from other values; annot cannot "
                    "tell whether a read is already divided, so give one of them another name",
                )
            for a in assignments:
                for access in a.references:
                    if isinstance(access.node, cst.Name) and self._is_load(access.node):
                        reads.append(access.node)
        if self_name is not None:
            for a in scope.own(self_name):
                if not isinstance(a.node, cst.Param):
                    continue
                for access in a.references:
                    parent = self.scopes.parent(access.node)
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

    def _reads_divided(
        self, target: cst.CSTNode, self_name: Optional[str], names: set[str]
    ) -> bool:
        """Whether the value assigned to ``target`` reads ``self.<name>`` for a
        listed name (whose reads are divided already)."""
        assert self.scopes is not None
        node: Optional[cst.CSTNode] = target
        while node is not None and not isinstance(node, (cst.Assign, cst.AnnAssign)):
            if isinstance(node, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                return False
            node = self.scopes.parent(node)
        if node is None or node.value is None or self_name is None:
            return False
        listed = m.Attribute(
            value=m.Name(self_name), attr=m.Name(value=m.MatchIfTrue(lambda v: v in names))
        )
        return bool(m.findall(node.value, listed))

    def _is_load(self, node: cst.CSTNode) -> bool:
        assert self.scopes is not None
        return self.scopes.context(node) == LOAD

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
        assert self.scopes is not None
        parent = self.scopes.parent(node)
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

    def _plan_losses(self, cols: dict[int, dict[tuple[str, ...], _Sharded]]) -> None:
        """Find the sharded values of every class of the file and plan the
        loss rewrites and refusals of every method.

        A class has a *sharded output* when its ``forward`` returns (as is, or
        as a tuple element) a value derived from a sharded source; computed to
        a fixpoint so heads nested in heads count too. A class none of whose
        sources holds a sharded tensor has nothing to rewrite or refuse.
        """
        assert self.scopes is not None
        classes = self.scopes.classes
        counts: dict[str, int] = {}
        for c in classes:
            counts[c.name.value] = counts.get(c.name.value, 0) + 1
        by_name = {c.name.value: c for c in classes if counts[c.name.value] == 1}
        infos = [self._class_info(c, cols.get(id(c), {}), by_name) for c in classes]
        unique = {i.name: i for i in infos if i.name in by_name}
        outputs: dict[str, _Shard] = {}
        # only the outputs of classes built in some __init__ are read
        children = {name for i in infos for name in i.children.values()}
        built = [i for i in unique.values() if i.name in children]
        for _ in range(len(infos) + 1):
            changed = False
            for info in built:
                out = self._forward_output(info, unique, outputs)
                if out != outputs.get(info.name):
                    outputs[info.name] = out
                    changed = True
            if not changed:
                break
        for info in infos:
            sources = self._sources(info, unique, outputs)
            if all(_contained(s) is None for s in sources.values()):
                continue  # no value of this class can be sharded
            for fn in info.methods:
                self_name = self._self_name(fn)
                if self_name is None:
                    continue
                env = _Env(self_name, sources, info.loss_attrs)
                self._at = (info.node, fn)
                for call in _calls(fn.body):
                    self._plan_call(call, env)

    def _self_name(self, fn: cst.FunctionDef) -> Optional[str]:
        static = any(
            self._qualified(
                d.decorator, frozenset({"builtins.staticmethod", "builtins.classmethod"})
            )
            for d in fn.decorators
        )
        first = None if static else _first_param(fn)
        return first.name.value if first is not None else None

    def _class_info(
        self,
        cls: cst.ClassDef,
        cols: dict[tuple[str, ...], _Sharded],
        by_name: dict[str, cst.ClassDef],
    ) -> _ClassInfo:
        """What ``__init__`` builds: submodules that are classes of this file
        (``self.cls = Head(...)``, also ModuleDict entries) and
        ``nn.CrossEntropyLoss`` instances (``self.loss_fct = CrossEntropyLoss()``)."""
        methods = _methods(cls)
        info = _ClassInfo(cls, cls.name.value, methods, cols)
        init = next((f for f in methods if f.name.value == "__init__"), None)
        self_name = self._self_name(init) if init is not None else None
        if init is None or self_name is None:
            return info
        values: dict[tuple[str, ...], list[Optional[cst.BaseExpression]]] = {}
        for stmt in _assignments(init.body):
            targets = (
                [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
            )
            for target in targets:
                for el in _unpack(target):
                    path = _self_path(el, self_name)
                    if path is not None and len(path) == 1:
                        clean = el is target and len(targets) == 1
                        values.setdefault(path, []).append(stmt.value if clean else None)
                path = _self_path(target, self_name)
                if path is not None and len(path) == 1 and stmt.value is not None:
                    for key, entry in self._module_dict_entries(stmt.value):
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
            if len(built) == 1 and None not in built:
                info.children[path] = built.pop()
            v = vals[0]
            if len(path) == 1 and len(vals) == 1 and isinstance(v, cst.Call):
                if self._qualified(v.func, CROSS_ENTROPY_LOSS):
                    info.loss_attrs[path[0]] = v
        return info

    def _sources(
        self,
        info: _ClassInfo,
        infos: dict[str, _ClassInfo],
        outputs: dict[str, _Shard],
        depth: int = 0,
    ) -> dict[tuple[str, ...], _Shard]:
        """``self.<path>(...)`` calls of ``info``'s class that give sharded values:
        its own non-gathered Col() submodules and submodules with a sharded output
        (also reached through them: ``self.cls.predictions(...)``)."""
        sources: dict[tuple[str, ...], _Shard] = dict(info.cols)
        for path, child in info.children.items():
            if outputs.get(child) is not None:
                sources[path] = outputs[child]
            if depth < 8:
                inner = self._sources(infos[child], infos, outputs, depth + 1)
                for sub, s in inner.items():
                    sources.setdefault(path + sub, s)
        return sources

    def _forward_output(
        self, info: _ClassInfo, infos: dict[str, _ClassInfo], outputs: dict[str, _Shard]
    ) -> _Shard:
        """The sharding of what ``forward`` returns (None unless every return agrees)."""
        fn = next((f for f in info.methods if f.name.value == "forward"), None)
        self_name = self._self_name(fn) if fn is not None else None
        if fn is None or self_name is None:
            return None
        env = _Env(self_name, self._sources(info, infos, outputs), info.loss_attrs)
        self._at = (info.node, fn)
        out: _Shard = _CYCLE
        if id(fn) not in self._returns:
            self._returns[id(fn)] = list(_returns(fn.body))
        for ret in self._returns[id(fn)]:
            value = self._eval(ret.value, env, set()) if ret.value is not None else None
            out = _meet(out, value)
        return _settle(out)

    def _plan_call(self, call: cst.Call, env: _Env) -> None:
        """Rewrite ``call`` to the vocab-parallel loss, refuse it, or leave it."""
        func = call.func
        if self._qualified(func, CROSS_ENTROPY):
            s = self._input_sharding(call, env)
            if s is not None:
                self._check_view(s)
                self.needed_imports.add((VOCAB_LOSS, "vocab_parallel_cross_entropy"))
                self._edit(
                    call, lambda n: n.with_changes(func=cst.Name("vocab_parallel_cross_entropy"))
                )
            return
        ctor = self._loss_module(func, env)
        if ctor is not None:
            s = self._input_sharding(call, env)
            if s is not None:
                self._check_view(s)
                self._plan_loss_module(call, ctor, s)
            return
        name = _terminal_name(func)
        if name is not None and "loss" in name.lower():
            for arg in call.args:
                s = _contained(self._eval(arg.value, env, set()))
                if s is not None:
                    raise self._refusal(
                        call,
                        s,
                        node_source(arg.value),
                        f"annot cannot tell what {node_source(func)}(...) computes, so it "
                        "cannot make it correct on a sharded value",
                    )
            return
        if self._qualified(func, _NEEDS_FULL_ROW):
            arg = _input_arg(call)
            value = arg.value if arg is not None else None
            shown = node_source(func)
        elif isinstance(func, cst.Attribute) and func.attr.value in _NEEDS_FULL_ROW_METHODS:
            value, shown = func.value, f".{func.attr.value}"
        else:
            return
        s = self._eval(value, env, set()) if value is not None else None
        if isinstance(s, _Sharded):
            raise self._refusal(
                call,
                s,
                node_source(value),
                f"{shown}(...) over its last dim would see only this rank's slice",
            )

    def _input_sharding(self, call: cst.Call, env: _Env) -> Optional[_Sharded]:
        arg = _input_arg(call)
        if arg is None:
            return None
        s = self._eval(arg.value, env, set())
        return s if isinstance(s, _Sharded) else None

    def _refusal(self, call: cst.Call, s: _Sharded, what: str, why: str) -> RewriteError:
        return self.locate.error(
            call,
            f"{what} is vocab-sharded (Col() without gather on {s.origin}: each rank holds "
            f"1/{self.tp} of its last dim), and {why}; compute the loss with F.cross_entropy "
            "on it (annot makes that vocab_parallel_cross_entropy), or hint "
            f"{s.hint}=Col(gather=True) on {s.cls} so that every rank has the full logits",
        )

    def _check_view(self, s: _Sharded) -> None:
        """Refuse a loss input reshaped so its last dim is no longer the per-rank slice."""
        if s.view is None:
            return
        view = s.view
        assert isinstance(view.func, cst.Attribute)
        recv = node_source(view.func.value)
        if view.func.attr.value == "flatten":
            fix = f"flatten only the leading dims ({recv}.flatten(0, -2))"
        else:
            fix = (
                f"write the last dim as {recv}.size(-1) "
                f"({recv}.{view.func.attr.value}(-1, {recv}.size(-1)))"
            )
        raise self.locate.error(
            view,
            f"{node_source(view)} feeds a loss, but {recv} is vocab-sharded (Col() without "
            f"gather on {s.origin}: each rank holds 1/{self.tp} of its last dim), and annot "
            f"cannot prove the result keeps that per-rank last dim; {fix}, or hint "
            f"{s.hint}=Col(gather=True) on {s.cls} so that every rank has the full logits",
        )

    def _loss_module(self, func: cst.BaseExpression, env: _Env) -> Optional[cst.Call]:
        """The ``nn.CrossEntropyLoss(...)`` call that built the module ``func``
        calls: inline (``nn.CrossEntropyLoss()(x, y)``), a local variable assigned
        once, or an attribute ``__init__`` assigns once."""
        if isinstance(func, cst.Call) and self._qualified(func.func, CROSS_ENTROPY_LOSS):
            return func
        path = _self_path(func, env.self_name)
        if path is not None:
            return env.loss_attrs.get(path[0]) if len(path) == 1 else None
        if not isinstance(func, cst.Name) or not self._loss_modules:
            return None
        refs = self._reaching(func)
        if refs is None or len(refs) != 1:
            return None
        value = self._assigned_value(refs[0].node)
        if isinstance(value, cst.Call) and self._qualified(value.func, CROSS_ENTROPY_LOSS):
            return value
        return None

    def _plan_loss_module(self, call: cst.Call, ctor: cst.Call, s: _Sharded) -> None:
        """``loss_fct(x, y)`` with ``loss_fct = nn.CrossEntropyLoss(ignore_index=0)``
        -> ``vocab_parallel_cross_entropy(x, y, ignore_index=0)``."""
        inline = call.func is ctor
        shown = node_source(ctor)
        subject = (
            f"the input of {shown}(...)"
            if inline
            else f"{node_source(call.func)} is {shown} and its input"
        ) + f" is vocab-sharded (Col() without gather on {s.origin})"
        positional = [a for a in call.args if a.keyword is None]
        if (
            any(a.star for a in call.args)
            or len(positional) > 2
            or any(
                a.keyword is not None and a.keyword.value not in ("input", "target")
                for a in call.args
            )
        ):
            raise self.locate.error(
                call,
                f"{subject}; annot rewrites the call to vocab_parallel_cross_entropy(input, "
                "target, ...) but cannot map its arguments; call it as loss(input, target), or "
                "call F.cross_entropy(input, target) directly (annot makes that vocab-parallel)",
            )
        keywords: list[str] = []
        for i, a in enumerate(ctor.args):
            key = a.keyword.value if a.keyword is not None else None
            if key is None and not a.star and i < len(_LOSS_PARAMS):
                key = _LOSS_PARAMS[i]
            why = None
            if a.star or key not in _LOSS_PARAMS:
                why = (
                    f"its argument {node_source(a).strip().rstrip(',')} does not map to a parameter"
                )
            elif not inline and not _literal(a.value):
                why = (
                    f"its argument {key}={node_source(a.value)} is not a literal, so annot "
                    "cannot move it to the call"
                )
            if why is not None:
                fix = f"input, target, {key}=..." if key in _LOSS_PARAMS else "input, target"
                raise self.locate.error(
                    call,
                    f"{subject}; annot rewrites the call to vocab_parallel_cross_entropy(input, "
                    f"target, <the constructor's arguments>) but {why}; call "
                    f"F.cross_entropy({fix}) directly (annot makes that vocab-parallel), or "
                    f"hint {s.hint}=Col(gather=True) on {s.cls}",
                )
            keywords.append(key)  # type: ignore[arg-type]
        self.needed_imports.add((VOCAB_LOSS, "vocab_parallel_cross_entropy"))
        literal_args = [a.value for a in ctor.args]

        def rewrite(n: cst.CSTNode) -> cst.CSTNode:
            assert isinstance(n, cst.Call)
            values = [a.value for a in n.func.args] if inline else literal_args  # type: ignore[union-attr]
            func = cst.Name("vocab_parallel_cross_entropy")
            if not keywords:
                return n.with_changes(func=func)
            extra = [_kwarg_node(k, v) for k, v in zip(keywords, values)]
            return _with_args(n, func, extra)

        self._edit(call, rewrite)

    # ---- which values are sharded ----------------------------------------------------

    def _eval(self, expr: cst.BaseExpression, env: _Env, stack: set[int]) -> _Shard:
        """The sharding of ``expr``: a :class:`_Sharded` tensor, a tuple of
        shardings (a tuple value), None (not provably sharded) or ``_CYCLE``.

        Followed: ``self.<source>(...)``, simple and tuple-unpacking assignments,
        ``.view/.reshape/.float/.contiguous/.flatten/.to`` and slicing, tuple
        building, indexing and ``+``. ``stack`` holds the assignments being
        followed (``x = x.float()`` is a cycle, decided by x's other definitions).
        """
        if isinstance(expr, cst.Call):
            func = expr.func
            path = _self_path(func, env.self_name)
            if path is not None:
                return env.sources.get(path)
            if isinstance(func, cst.Attribute) and func.attr.value in _KEEPS_SHARDING:
                inner = self._eval(func.value, env, stack)
                if isinstance(inner, _Sharded):
                    if inner.view is None and not self._keeps_last_dim(expr, env, stack):
                        return _Sharded(inner.cls, inner.hint, inner.origin, expr)
                    return inner
                return _CYCLE if inner is _CYCLE else None
            return None
        if isinstance(expr, cst.Subscript):
            inner = self._eval(expr.value, env, stack)
            if isinstance(inner, tuple):
                return _index(inner, expr)
            return inner if isinstance(inner, _Sharded) or inner is _CYCLE else None
        if isinstance(expr, cst.Tuple):
            items: list[_Shard] = []
            for el in expr.elements:
                v = self._eval(el.value, env, stack)
                if isinstance(el, cst.StarredElement):
                    if not isinstance(v, tuple):
                        return None
                    items.extend(v)
                else:
                    items.append(v)
            return tuple(items)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            left = self._eval(expr.left, env, stack)
            right = self._eval(expr.right, env, stack)
            if isinstance(left, tuple) and isinstance(right, tuple):
                return left + right
            return None
        if isinstance(expr, cst.IfExp):
            return _meet(self._eval(expr.body, env, stack), self._eval(expr.orelse, env, stack))
        if isinstance(expr, cst.Name):
            return self._eval_name(expr, env, stack)
        return None

    def _eval_name(self, expr: cst.Name, env: _Env, stack: set[int]) -> _Shard:
        """A name is sharded when every assignment that may reach it is."""
        refs = self._reaching(expr)
        if not refs:
            return None
        out: _Shard = _CYCLE
        for ref in refs:
            if id(ref.node) in stack:
                continue
            stack.add(id(ref.node))
            try:
                value = self._eval_target(ref.node, env, stack)
            finally:
                stack.discard(id(ref.node))
            out = _meet(out, value)
            if out is None:
                return None
        return out

    def _reaching(self, name: cst.Name) -> Optional[list[Assignment]]:
        """The assignments that may give ``name`` (a read) its value; None when
        one of them is not a plain assignment (a builtin, an import, ...).

        libcst's scopes know every assignment of a name in its scope, not which
        reach a read. This keeps the ones that can: those that end before the
        read, from the last one on the straight-line path to it (an earlier
        statement of an enclosing block: ``h = self.transform(h); h =
        self.decoder(h); return h`` reads the second), plus those later in a
        loop around the read that does not hold that last one. A read from a
        nested scope (a closure) keeps them all.

        Scopes come from :mod:`annot.rewriters.scopes` (the method being planned is
        analysed on the first call); "before" compares the numbers it gives
        the nodes of one function, in source order.
        """
        if id(name) not in self._reached:
            self._reached[id(name)] = self._reaching_uncached(name)
        return self._reached[id(name)]

    def _reaching_uncached(self, name: cst.Name) -> Optional[list[Assignment]]:
        assert self.scopes is not None and self._at is not None
        self.scopes.prepare(*self._at)
        scope = self.scopes.scope(name)
        if scope is None:
            return None
        refs = [r for access in scope.accesses_of(name) for r in access.referents]
        if any(r.builtin for r in refs):
            return None
        here = self.scopes.span(name)
        if here is None or any(r.scope is not scope for r in refs):
            return refs
        # libcst leaves out assignments after the read: a loop can bring them back
        refs = list(scope.own(name.value))
        refs.sort(key=lambda r: _start(self.scopes.span(r.node)))  # type: ignore[union-attr]
        at = here[0]
        # the straight-line statements before the read: block id -> index of its ancestor
        blocks: dict[int, int] = {}
        loops: list[cst.CSTNode] = []
        node: cst.CSTNode = name
        while not isinstance(node, (cst.FunctionDef, cst.Lambda, cst.ClassDef, cst.Module)):
            parent = self.scopes.parent(node)
            if parent is None:
                break
            if isinstance(parent, (cst.IndentedBlock, cst.Module)):
                blocks[id(parent)] = next(i for i, b in enumerate(parent.body) if b is node)
            if isinstance(parent, (cst.For, cst.While)) and node is parent.body:
                loops.append(parent)
            node = parent
        before: list[tuple[tuple[int, int], Assignment]] = []
        later: list[Assignment] = []
        last = None
        for ref in refs:
            stmt, line = self._statement(ref.node)
            pos = self.scopes.span(stmt) if stmt is not None else None
            if pos is None:
                return refs
            if pos[1] <= at:
                start = pos[0]
                before.append((start, ref))
                block = self.scopes.parent(line) if line else None
                if block is not None and id(block) in blocks:
                    index = next(i for i, b in enumerate(block.body) if b is line)  # type: ignore[attr-defined]
                    if index < blocks[id(block)] and (last is None or start > last[0]):
                        last = (start, ref)
            else:
                later.append(ref)
        out = [r for start, r in before if last is None or start >= last[0]]
        for ref in later:
            for loop in loops:
                inside = self._inside(ref.node, loop)
                if inside and (last is None or not self._inside(last[1].node, loop)):
                    out.append(ref)
                    break
        return out

    def _statement(
        self, node: cst.CSTNode
    ) -> tuple[Optional[cst.CSTNode], Optional[cst.SimpleStatementLine]]:
        """The statement holding an assignment target, and its line when that
        statement is a simple one (``x = ...``) that can dominate a later read."""
        assert self.scopes is not None
        cur: Optional[cst.CSTNode] = node
        while cur is not None and not isinstance(
            cur, (cst.BaseSmallStatement, cst.BaseCompoundStatement)
        ):
            cur = self.scopes.parent(cur)
        if isinstance(cur, (cst.Assign, cst.AnnAssign)):
            line = self.scopes.parent(cur)
            if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
                return cur, line
        return cur, None

    def _inside(self, node: cst.CSTNode, ancestor: cst.CSTNode) -> bool:
        assert self.scopes is not None
        cur: Optional[cst.CSTNode] = node
        while cur is not None:
            if cur is ancestor:
                return True
            cur = self.scopes.parent(cur)
        return False

    def _eval_target(self, node: cst.CSTNode, env: _Env, stack: set[int]) -> _Shard:
        """The sharding assigned to the name ``node`` (``x = v``, ``a, x = v``)."""
        value = self._assigned_value(node)
        if value is not None:
            return self._eval(value, env, stack)
        assert self.scopes is not None
        positions: list[tuple[int, int]] = []  # (index, length), innermost first
        cur = node
        while True:
            parent = self.scopes.parent(cur)
            if not (isinstance(parent, cst.Element) and parent.value is cur):
                break
            seq = self.scopes.parent(parent)
            if not isinstance(seq, (cst.Tuple, cst.List)) or any(
                isinstance(e, cst.StarredElement) for e in seq.elements
            ):
                return None
            index = next(i for i, e in enumerate(seq.elements) if e is parent)
            positions.append((index, len(seq.elements)))
            cur = seq
        if not positions:
            return None
        value = self._assigned_value(cur)
        if value is None:
            return None
        out = self._eval(value, env, stack)
        for index, length in reversed(positions):
            if out is _CYCLE:
                return _CYCLE
            if not isinstance(out, tuple) or len(out) != length:
                return None
            out = out[index]
        return out

    def _keeps_last_dim(self, call: cst.Call, env: _Env, stack: set[int]) -> bool:
        """Does ``x.view(...)`` / ``x.reshape(...)`` / ``x.flatten(...)`` provably keep
        x's last dim? (``view(-1, x.size(-1))``, ``view(B, T, -1)``, ``flatten(0, 1)``;
        other methods of ``_KEEPS_SHARDING`` do not reshape.)"""
        assert isinstance(call.func, cst.Attribute)
        method = call.func.attr.value
        args = list(call.args)
        if any(a.star for a in args):
            return False
        if method == "flatten":
            end = next((a.value for a in args if a.keyword and a.keyword.value == "end_dim"), None)
            positional = [a.value for a in args if a.keyword is None]
            if end is None and len(positional) >= 2:
                end = positional[1]
            end_dim = _int_literal(end) if end is not None else -1
            return end_dim is not None and end_dim != -1
        if method not in ("view", "reshape"):
            return True
        dims = [a.value for a in args]
        if len(dims) == 1 and isinstance(dims[0], (cst.Tuple, cst.List)):
            elements = dims[0].elements
            if any(isinstance(e, cst.StarredElement) for e in elements):
                return False
            dims = [e.value for e in elements]
        if len(dims) < 2:
            return False
        last = dims[-1]
        if _int_literal(last) == -1:
            return True
        receiver = _last_dim_of(last)
        if receiver is None:
            return False
        r = self._eval(receiver, env, stack)
        return isinstance(r, _Sharded) or r is _CYCLE

    def _assigned_value(self, node: cst.CSTNode) -> Optional[cst.BaseExpression]:
        """The value of ``node = value`` when ``node`` is the only target."""
        assert self.scopes is not None
        parent = self.scopes.parent(node)
        if isinstance(parent, cst.AssignTarget) and parent.target is node:
            stmt = self.scopes.parent(parent)
            if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1:
                return stmt.value
        if isinstance(parent, cst.AnnAssign) and parent.target is node:
            return parent.value
        return None


@dataclass(frozen=True)
class _Sharded:
    """A tensor split over the tp ranks along its last dim: the output of the
    non-gathered Col() ``hint`` of class ``cls`` (at ``origin``, "Head.decoder").
    ``view`` is a reshape on the way that may not keep that last dim."""

    cls: str
    hint: str
    origin: str
    view: Optional[cst.Call] = field(default=None, compare=False)


class _Cycle:
    """A name defined only in terms of itself (so far): no information."""

    def __repr__(self) -> str:
        return "_CYCLE"


_CYCLE = _Cycle()
# None: not provably sharded; a tuple: a tuple value, per element
_Shard = Union[None, _Sharded, _Cycle, tuple]


@dataclass
class _ClassInfo:
    node: cst.ClassDef
    name: str
    methods: list[cst.FunctionDef]
    cols: dict[tuple[str, ...], _Sharded]
    children: dict[tuple[str, ...], str] = field(default_factory=dict)  # path -> class name
    loss_attrs: dict[str, cst.Call] = field(default_factory=dict)  # attr -> CrossEntropyLoss(...)


@dataclass
class _Env:
    self_name: str
    sources: dict[tuple[str, ...], _Shard]
    loss_attrs: dict[str, cst.Call]


def _meet(a: _Shard, b: _Shard) -> _Shard:
    """What holds on both paths."""
    if a is _CYCLE:
        return b
    if b is _CYCLE:
        return a
    if isinstance(a, _Sharded) and isinstance(b, _Sharded):
        return a
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_meet(x, y) for x, y in zip(a, b))
    return None


def _settle(s: _Shard) -> _Shard:
    if isinstance(s, tuple):
        return tuple(_settle(x) for x in s)
    return None if s is _CYCLE else s


def _contained(s: _Shard) -> Optional[_Sharded]:
    """The first sharded tensor in ``s`` (itself or a tuple element)."""
    if isinstance(s, _Sharded):
        return s
    if isinstance(s, tuple):
        return next((x for x in map(_contained, s) if x is not None), None)
    return None


def _index(items: tuple, sub: cst.Subscript) -> _Shard:
    """``t[1]`` / ``t[1:]`` of a tuple value with literal bounds."""
    if len(sub.slice) != 1:
        return None
    sl = sub.slice[0].slice
    if isinstance(sl, cst.Index):
        i = _int_literal(sl.value)
        if i is None or not -len(items) <= i < len(items):
            return None
        return items[i]
    if isinstance(sl, cst.Slice) and sl.step is None:
        bounds = [None if b is None else _int_literal(b) for b in (sl.lower, sl.upper)]
        if any(b is None and e is not None for b, e in zip(bounds, (sl.lower, sl.upper))):
            return None
        return items[bounds[0] : bounds[1]]
    return None


def _start(span: Optional[tuple[int, int]]) -> int:
    return span[0] if span is not None else 0


def _int_literal(expr: cst.BaseExpression) -> Optional[int]:
    if isinstance(expr, cst.Integer):
        return int(expr.evaluated_value)
    if (
        isinstance(expr, cst.UnaryOperation)
        and isinstance(expr.operator, cst.Minus)
        and isinstance(expr.expression, cst.Integer)
    ):
        return -int(expr.expression.evaluated_value)
    return None


def _literal(expr: cst.BaseExpression) -> bool:
    """A constant that means the same anywhere it is moved to."""
    if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString)):
        return True
    if isinstance(expr, cst.Name):
        return expr.value in ("None", "True", "False")
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        return isinstance(expr.expression, (cst.Integer, cst.Float))
    return False


def _last_dim_of(expr: cst.BaseExpression) -> Optional[cst.BaseExpression]:
    """``x`` for ``x.size(-1)``, ``x.size(dim=-1)``, ``x.shape[-1]``, ``x.size()[-1]``."""
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        if expr.func.attr.value == "size" and len(expr.args) == 1:
            arg = expr.args[0]
            by_dim = arg.keyword is None or arg.keyword.value == "dim"
            if not arg.star and by_dim and _int_literal(arg.value) == -1:
                return expr.func.value
        return None
    if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
        sl = expr.slice[0].slice
        if not (isinstance(sl, cst.Index) and _int_literal(sl.value) == -1):
            return None
        v = expr.value
        if isinstance(v, cst.Attribute) and v.attr.value == "shape":
            return v.value
        if (
            isinstance(v, cst.Call)
            and isinstance(v.func, cst.Attribute)
            and v.func.attr.value == "size"
            and not v.args
        ):
            return v.func.value
    return None


def _input_arg(call: cst.Call) -> Optional[cst.Arg]:
    """The first positional argument, or ``input=``."""
    return next(
        (
            a
            for a in call.args
            if (a.keyword is None and not a.star)
            or (a.keyword is not None and a.keyword.value == "input")
        ),
        None,
    )


def _terminal_name(func: cst.BaseExpression) -> Optional[str]:
    """``loss_fct`` / ``self.loss_function`` / ``nn.NLLLoss()`` -> the last name."""
    if isinstance(func, cst.Name):
        return func.value
    if isinstance(func, cst.Attribute):
        return func.attr.value
    if isinstance(func, cst.Call):
        return _terminal_name(func.func)
    return None


def _kwarg_node(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(
        keyword=cst.Name(name),
        value=value,
        equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
        ),
    )


def _descendants(node: cst.CSTNode, prune: tuple[type, ...] = ()) -> Iterable[cst.CSTNode]:
    """The nodes under ``node`` in source order (preorder), leaving out
    those of a type in ``prune`` and everything under them."""
    stack = children(node)[::-1]
    while stack:
        child = stack.pop()
        if type(child) in prune:
            continue
        yield child
        stack.extend(children(child)[::-1])


def _calls(node: cst.CSTNode) -> Iterable[cst.Call]:
    """The calls under ``node``, outer first, not descending into nested classes."""
    return [n for n in _descendants(node, (cst.ClassDef,)) if type(n) is cst.Call]  # type: ignore[misc]


_SUITES = (
    cst.IndentedBlock,
    cst.SimpleStatementLine,
    cst.SimpleStatementSuite,
    cst.Else,
    cst.ExceptHandler,
    cst.ExceptStarHandler,
    cst.Finally,
    cst.MatchCase,
)


_STATEMENT = (cst.BaseSmallStatement, cst.BaseCompoundStatement)
_DEFINITION = (cst.FunctionDef, cst.ClassDef)
_IN_BODIES = (*_SUITES, *_STATEMENT)


def _statements(node: cst.CSTNode, nested: bool = False) -> Iterable[cst.CSTNode]:
    """The statements under ``node`` (a function body), small ones too, in
    source order; those of nested functions and classes only when ``nested``.
    (Expressions hold no statement: they are not walked.)"""
    stack = children(node)[::-1]
    while stack:
        child = stack.pop()
        if is_a(child, _STATEMENT):
            yield child
            if is_a(child, (cst.BaseSmallStatement,)) or (not nested and is_a(child, _DEFINITION)):
                continue
        elif not is_a(child, _SUITES):
            continue
        stack.extend(c for c in children(child)[::-1] if is_a(c, _IN_BODIES))


def _returns(node: cst.CSTNode) -> Iterable[cst.Return]:
    """The return statements of one function body (not of nested functions)."""
    return [n for n in _statements(node) if type(n) is cst.Return]  # type: ignore[misc]


def _walk(node: cst.CSTNode) -> Iterable[cst.CSTNode]:
    """Every statement under ``node``, nested functions included."""
    return _statements(node, nested=True)


def _assignments(node: cst.CSTNode) -> Iterable[Union[cst.Assign, cst.AnnAssign]]:
    """The assignments of one function body, in source order, not descending
    into nested functions or classes."""
    return [
        n  # type: ignore[misc]
        for n in _statements(node)
        if type(n) is cst.Assign or type(n) is cst.AnnAssign
    ]


def _unpack(target: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The simple targets of ``a, (b, c) = ...`` (or ``[target]``)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        out: list[cst.BaseExpression] = []
        for el in target.elements:
            out += _unpack(el.value)
        return out
    return [target]
