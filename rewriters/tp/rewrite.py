"""Rewrite ``@shard``-annotated model source into its tensor-parallel form.

``rewrite_tensor_parallel(source, tp)`` returns the source every tp rank runs
(Megatron's layout). For each hinted class:

1. Its hints are read from the decorator as literals (:mod:`annot.rewriters.analysis.hint_reader`),
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
   (:mod:`annot.runtime.tp.convert`)::

       self.fc1 = linear_layer(d, h)       ->  column_parallel(linear_layer(d, h), tp=2)

   An attribute assigned by a different call in each branch of an ``if``
   (x-transformers' ``to_out``) has each site planned by its own call, so the
   hint follows the branch taken.

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
   the class already passes the divided value. A dotted name is a path from
   ``self``: ``config.n_head`` divides the reads of ``self.config.n_head``,
   never the (shared) config object.
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
resolved by :mod:`annot.rewriters.analysis.scopes` (libcst's scope rules, one method at a
time) and positions are computed only for a refusal. On a large model file
this is about the cost of libcst's own parse and codegen (``benchmarks/tp.py``
row (c)).
"""

from __future__ import annotations

from typing import Optional, Union, overload

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor

from annot.core.errors import HintError, MeshError
from annot.core.hints import ShardSpec
from annot.rewriters.analysis.hint_reader import find_hints
from annot.rewriters.analysis.scopes import ModuleScopes
from annot.rewriters.source.diagnostics import Locator, parse_source
from annot.rewriters.source.hint_literals import format_hint
from annot.rewriters.tp.edits import Target
from annot.rewriters.tp.local_sizes import LocalSizeEdits
from annot.rewriters.tp.loss import LossEdits
from annot.rewriters.tp.sharded import Sharded
from annot.rewriters.tp.syntax import first_param, methods_of

__all__ = ["TensorParallelTransformer", "rewrite_tensor_parallel"]

_MARKER = "# annot: @shard("

Source = Union[str, bytes]


@overload
def rewrite_tensor_parallel(
    source: str,
    tp: int,
    *,
    path: str = "<string>",
    extra_hints: Optional[dict[str, ShardSpec]] = None,
    extra_by_path: bool = False,
) -> str: ...


@overload
def rewrite_tensor_parallel(
    source: bytes,
    tp: int,
    *,
    path: str = "<string>",
    extra_hints: Optional[dict[str, ShardSpec]] = None,
    extra_by_path: bool = False,
) -> bytes: ...


def rewrite_tensor_parallel(
    source: Source,
    tp: int,
    *,
    path: str = "<string>",
    extra_hints: Optional[dict[str, ShardSpec]] = None,
    extra_by_path: bool = False,
) -> Source:
    """The tensor-parallel (degree ``tp``) version of ``source``.

    ``source`` is text or bytes; the result has the same type (bytes keep the
    file's encoding, BOM and line endings). ``extra_hints`` maps class names
    to :class:`ShardSpec` for hints given outside the source: a class without
    a ``@shard`` decorator is rewritten exactly as if decorated, and for a
    decorated class the given spec replaces the decorator's (the caller merges
    the two, as ``annot.parallelize`` does). Names not defined in ``source``
    are ignored (a model may span several files). ``extra_by_path``: an extra
    hint on an attribute the class's own ``__init__`` does not assign (a
    base class's does: PEFT's ``base_layer``) is left to the caller, which
    converts it by path after construction (``annot.parallelize``, whose
    hints were matched against the built model); else it is refused.
    Raises :class:`RewriteError` at
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
        context,
        tp,
        targets,
        locate,
        package=_package_of(path),
        scopes=scopes,
        text=text,
        extra_by_path=extra_by_path,
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


class TensorParallelTransformer(LossEdits, LocalSizeEdits):
    """Applies tensor-parallel hints to the classes in ``targets``.

    Everything is planned when the module is visited (all checks happen then,
    so a refusal comes before any output) into edits keyed by the original
    node; the transform then enters only the nodes that hold an edit, and
    ``on_leave`` applies the edits to the updated nodes. The imports the
    result needs are left in :attr:`needed_imports` for ``AddImportsVisitor``
    (``context`` is where the caller gathers them).

    ``scopes`` is the module's :class:`~annot.rewriters.analysis.scopes.ModuleScopes` (built
    from the visited module when not given); ``text`` its source, used to skip
    what cannot apply (no ``CrossEntropyLoss`` in the file: no loss module).

    The planning is split by concern into the classes it inherits, all on
    :class:`~annot.rewriters.tp.edits.TpEdits` (the state, the edits, the
    traversal): :mod:`~annot.rewriters.tp.constructors` (step 2),
    :mod:`~annot.rewriters.tp.local_sizes` (step 3) and
    :mod:`~annot.rewriters.tp.loss` (step 4), which follows sharded values
    with :mod:`~annot.rewriters.tp.outputs`, :mod:`~annot.rewriters.tp.sharded`
    and :mod:`~annot.rewriters.tp.reaching`.
    """

    # ---- planning ----------------------------------------------------------

    def visit_Module(self, node: cst.Module) -> bool:
        # Everything is planned up front: the hinted classes (in source order),
        # then the losses of every class, which need the whole file's sharded outputs.
        if self.scopes is None or self.scopes.module is not node:
            self.scopes = ModuleScopes(node)
        cols: dict[int, dict[tuple[str, ...], Sharded]] = {}
        for cls, spec, decorator in self.targets.values():
            cols[id(cls)] = self._plan_class(cls, spec, decorator)
        self.plan_losses(cols)
        self.enter = self.holding_edits(node)
        return True

    # ---- one class -----------------------------------------------------------

    def _plan_class(
        self, cls: cst.ClassDef, spec: ShardSpec, decorator: Optional[cst.Decorator]
    ) -> dict[tuple[str, ...], Sharded]:
        """Plan the constructor swaps and local sizes of one hinted class;
        return its non-gathered Col() submodules by path."""
        methods = methods_of(cls)
        init = next((f for f in methods if f.name.value == "__init__"), None)
        col_paths: set[tuple[str, ...]] = set()
        if spec.specs:
            if init is None or first_param(init) is None:
                raise self.locate.error(
                    cls.name,
                    f"class {cls.name.value} has hints for {', '.join(spec.specs)} but no "
                    "__init__(self, ...) that assigns them; annot rewrites the constructors "
                    "called in __init__",
                )
            self.at = (cls, init)
            col_paths = self.plan_init(cls, init, spec, decorator)
        for fn in methods:
            if fn is not init:
                self.at = (cls, fn)
                self.plan_locals(cls, fn, spec.local)
        index = None
        if decorator is not None:
            index = next(i for i, d in enumerate(cls.decorators) if d is decorator)
        self.at = (cls, None)
        self.edit(cls, lambda n: self._mark_class(n, spec, index))
        name = cls.name.value
        return {p: Sharded(name, p[-1], ".".join((name, *p))) for p in sorted(col_paths)}

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
