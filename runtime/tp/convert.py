"""Built torch layers into their tensor-parallel forms, decided by runtime type.

The rewriter swaps constructors it can name (``nn.Linear(...)`` ->
``ColumnParallelLinear(...)``). Real models build their layers other ways: a
subclass (HF Falcon's ``FalconLinear``, Gemma's scaled embedding), a factory
passed in (timm's ``linear_layer(...)``), ``partial(nn.Linear, bias=False)``
(x-transformers' ``LinearNoBias``), an entry of an ``nn.Sequential`` or
``nn.ModuleDict``. For those the layer is built as written and converted here,
by what it *is* at runtime:

=================================  =========================================
built layer                        becomes
=================================  =========================================
``nn.Linear`` or a subclass        ``ColumnParallelLinear`` / ``RowParallelLinear``
HF ``Conv1D`` or a subclass        ``ColumnParallelConv1D`` / ``RowParallelConv1D``
``nn.Embedding`` or a subclass     ``VocabParallelEmbedding`` (``Vocab()``),
                                   ``ColumnParallelEmbedding`` (``Col()``)
=================================  =========================================

A subclass that overrides ``forward`` is taken only when annot can show the
result is still right:

- its forward returns the base layer's result computed another way
  (``FalconLinear``: ``x @ self.weight.T + self.bias``): checked by running it
  on a small random probe against ``F.linear`` / ``F.embedding``; or
- its forward post-processes ``super().forward(...)``: its inputs go only
  into that call, and it reads ``self.weight`` / ``self.bias`` only for
  ``.dtype`` / ``.device`` (Gemma's
  ``super().forward(ids) * self.embed_scale``), and the parallel layer's
  output is the full tensor (``Vocab()``, ``Row()``, ``Col(gather=True)``):
  the subclass's forward is kept, its ``super()`` now the parallel layer's,
  and its other attributes and buffers come along.

Anything else is refused with :class:`HintError`, naming the class and what
to do. ``check_layer`` makes the same decision without building anything
(on the meta reference, before any rank works); ``to_parallel`` builds. A
layer with real values (not on the meta device) gives the parallel layer this
rank's slice of them, so ``column_parallel(nn.Linear(...), tp=2)`` keeps the
single-device initialization.

The subclass checks are :mod:`annot.runtime.tp.subclass`'s; ``Partial()``
and ``Heads()`` on a built module are forward hooks
(:mod:`annot.runtime.tp.hint_hooks`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from annot.core.errors import HintError
from annot.core.specs import Col, Heads, P, Row, Vocab, parallel_layer, partial_sum
from annot.runtime.tp import layers as L
from annot.runtime.tp.hint_hooks import partial_module, slice_heads
from annot.runtime.tp.state_dict import load_full_state_dict
from annot.runtime.tp.subclass import (
    composed_class,
    forward_definers,
    probe_equals_base,
    reads_super,
)
from annot.runtime.tp.user_hooks import carry_hooks

__all__ = [
    "check_layer",
    "column_parallel",
    "convert_hinted",
    "is_parallel_layer",
    "layer_kind",
    "partial_module",  # tp_hooks' own; the rewriter's generated code imports it from here
    "row_parallel",
    "tied_names",
    "to_parallel",
    "vocab_parallel",
]


def _conv1d_base(module: nn.Module) -> Optional[type]:
    for c in type(module).__mro__:
        if c.__name__ == "Conv1D" and c.__module__ == "transformers.pytorch_utils":
            return c
    return None


def layer_kind(module: nn.Module) -> Optional[str]:
    """``"linear"`` / ``"conv1d"`` / ``"embedding"`` by runtime type (subclasses
    included), or None for a module annot cannot shard as a layer."""
    if isinstance(module, nn.Linear):
        return "linear"
    if _conv1d_base(module) is not None:
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return None


def is_parallel_layer(module: nn.Module) -> bool:
    """Whether ``module`` is already one of annot's tp layers."""
    return callable(getattr(module, "annot_shard_layout", None))


def _base(module: nn.Module, kind: str) -> type:
    base = {"linear": nn.Linear, "embedding": nn.Embedding}.get(kind) or _conv1d_base(module)
    assert base is not None, f"{kind}: not layer_kind's kind of {type(module).__name__}"
    return base


def _full_output(spec: object) -> bool:
    return isinstance(spec, (Vocab, Row)) or (isinstance(spec, Col) and spec.gather)


_WANT = {
    Col: ("linear", "conv1d", "embedding"),
    Row: ("linear", "conv1d"),
    Vocab: ("embedding",),
}


def _plan(module: nn.Module, spec: object, where: str, what: str) -> tuple[str, Optional[type]]:
    """(kind, the class whose forward to keep or None), or HintError.
    ``where`` starts each message (the hint); ``what`` names the module."""
    kind = layer_kind(module)
    name = type(module).__name__
    want = _WANT.get(type(spec))
    if want is None:
        raise HintError(f"{where}: {spec!r} does not shard a layer")
    if kind not in want:
        if kind is None:
            raise HintError(
                f"{where}: annot shards nn.Linear, HF Conv1D and nn.Embedding (and their "
                f"subclasses) but {what} is a {name}; hint a layer inside it, or Replicate() it"
            )
        target, use = (
            ("nn.Embedding", "use Col() or Row() for an nn.Linear")
            if isinstance(spec, Vocab)
            else ("nn.Linear", "use Vocab() (rows) or Col() (columns) for an nn.Embedding")
        )
        raise HintError(f"{where} applies to {target}, but {what} is a {name}; {use}")
    if kind == "embedding" and isinstance(spec, Col) and spec.chunks != 1:
        raise HintError(f"{where}: Col() on an nn.Embedding splits its columns; drop chunks=")
    base = _base(module, kind)
    definers = forward_definers(type(module), base)
    if not definers:
        return kind, None
    same = probe_equals_base(module, kind)
    if same is None:
        return kind, None
    if len(definers) == 1 and _full_output(spec):
        composed = reads_super(definers[0])
        if composed is None:
            return kind, definers[0]
        same = f"{same}, and {composed}"
    raise HintError(
        f"{where}: {what} is a {name}, and annot cannot show its own forward stays right when "
        f"sharded ({same}). It takes a subclass whose forward equals the base "
        f"{base.__name__}'s, or post-processes super().forward(...) without reading "
        f"self.weight / self.bias (with Vocab(), Row() or Col(gather=True)). Hint a plain "
        f"{base.__name__} instead, or Replicate() this layer"
    )


def check_layer(module: nn.Module, spec: object, where: str, what: str = "the layer") -> None:
    """Raise :class:`HintError` if ``spec`` cannot shard ``module`` (nothing is
    built). ``where`` starts the message (the hint), ``what`` names the module."""
    _plan(module, spec, where, what)


def _build(module: nn.Module, spec: object, kind: str, tp: int) -> nn.Module:
    cls = getattr(L, parallel_layer(kind, spec))
    w = module.weight
    assert isinstance(w, torch.Tensor), "layer_kind's layers hold a weight parameter"
    with torch.device(w.device):
        if kind == "embedding":
            extra = {"gather": spec.gather} if isinstance(spec, Col) else {}
            layer = cls(
                module.num_embeddings,
                module.embedding_dim,
                padding_idx=module.padding_idx,
                max_norm=module.max_norm,
                norm_type=module.norm_type,
                scale_grad_by_freq=module.scale_grad_by_freq,
                sparse=module.sparse,
                dtype=w.dtype,
                tp=tp,
                **extra,
            )
        elif kind == "conv1d":
            nx, nf = w.shape
            if isinstance(spec, Col):
                layer = cls(nf, nx, chunks=spec.chunks, gather=spec.gather, tp=tp)
            else:
                assert isinstance(spec, Row)  # _plan (_WANT) lets Col or Row through
                layer = cls(nf, nx, split_input=spec.split_input, tp=tp)
            layer.to(dtype=w.dtype)
        else:
            bias = module.bias is not None
            args = (module.in_features, module.out_features)
            if isinstance(spec, Col):
                layer = cls(
                    *args, bias=bias, dtype=w.dtype, chunks=spec.chunks, gather=spec.gather, tp=tp
                )
            else:
                assert isinstance(spec, Row)  # _plan (_WANT) lets Col or Row through
                layer = cls(*args, bias=bias, dtype=w.dtype, split_input=spec.split_input, tp=tp)
    for name, p in module.named_parameters(recurse=False):
        q = getattr(layer, name, None)
        if isinstance(q, nn.Parameter):
            q.requires_grad_(p.requires_grad)
    return layer


def to_parallel(module: nn.Module, spec: object, tp: int, where: str = "") -> nn.Module:
    """The tp layer ``spec`` makes of the built ``module`` (see the module doc).
    Call it under the mesh's context (``annot.runtime.process_groups.use(ctx)``)."""
    where = where or f"{spec!r} on a {type(module).__name__}"
    kind, keep = _plan(module, spec, where, "the layer")
    layer = _build(module, spec, kind, tp)
    if keep is not None:
        built: type = type(layer)  # plain type: mypy finds type[Module] not Hashable
        layer.__class__ = composed_class(built, keep)
        for k, v in module.__dict__.items():
            if not k.startswith("_") and k not in layer.__dict__:
                layer.__dict__[k] = v
        for k, b in module._buffers.items():
            layer.register_buffer(k, b, persistent=k not in module._non_persistent_buffers_set)
        for k, sub in module._modules.items():
            layer._modules[k] = sub
        for k, p in module._parameters.items():
            if k not in ("weight", "bias"):
                layer._parameters[k] = p
    if not module.weight.is_meta:
        load_full_state_dict(layer, module.state_dict(), strict=False)
    carry_hooks(module, layer)  # a user's hooks on the layer: kept (views: view_hooks)
    return layer


def column_parallel(
    layer: nn.Module, *, chunks: int = 1, gather: bool = False, tp: int = 1
) -> nn.Module:
    """``Col(chunks=, gather=)`` applied to a built layer (emitted by the rewriter
    for a constructor it cannot name: ``column_parallel(linear_layer(d, h), tp=2)``)."""
    return to_parallel(layer, Col(chunks=chunks, gather=gather), tp)


def row_parallel(layer: nn.Module, *, split_input: bool = False, tp: int = 1) -> nn.Module:
    """``Row(split_input=)`` applied to a built layer (see :func:`column_parallel`)."""
    return to_parallel(layer, Row(split_input=split_input), tp)


def vocab_parallel(layer: nn.Module, *, tp: int = 1) -> nn.Module:
    """``Vocab()`` applied to a built layer (see :func:`column_parallel`)."""
    return to_parallel(layer, Vocab(), tp)


def convert_hinted(
    model: nn.Module, paths: dict[str, object], tp: int, ties: list[list[str]]
) -> None:
    """Apply every hint of ``paths`` (``{"h.0.mlp.fc": Col(), "h.0.w": P("tp",
    None)}``) that construction did not: a layer still a torch layer becomes
    its tp form, a parameter not yet sharded becomes its shard. Then each
    group of ``ties`` (parameter names that were one tensor in the reference)
    is one tensor again. Call under the mesh's context."""
    for path, spec in sorted(paths.items()):
        owner_path, _, name = path.rpartition(".")
        owner = model.get_submodule(owner_path)
        if isinstance(spec, P):
            p = owner._parameters.get(name)
            if p is not None and spec.split_dim is not None and not hasattr(p, "annot_shard_dim"):
                owner._parameters[name] = L.shard_parameter(
                    p, dim=spec.split_dim, chunks=spec.chunks, tp=tp
                )
            continue
        if isinstance(spec, Heads):
            slice_heads(owner, name, spec, tp, f"{path}: {spec!r}")
            continue
        sub = owner._modules.get(name)
        if partial_sum(spec) and sub is not None:
            partial_module(sub, tp=tp)
            continue
        if isinstance(spec, (Col, Row, Vocab)) and sub is not None and not is_parallel_layer(sub):
            owner._modules[name] = to_parallel(sub, spec, tp, f"{path}: {spec!r}")
    for names in ties:
        first = model.get_parameter(names[0])
        for n in names[1:]:
            owner_path, _, attr = n.rpartition(".")
            owner = model.get_submodule(owner_path)
            if owner._parameters.get(attr) is first:
                continue
            tied = owner._parameters[attr]
            assert tied is not None, f"{n}: a tied parameter of the model"
            if tied.shape != first.shape:
                raise HintError(
                    f"{names[0]} and {n} are one tied weight but their hints shard them "
                    "differently; give both the same split (e.g. Vocab() and Col())"
                )
            owner._parameters[attr] = first


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor in ``model``."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [g for g in groups.values() if len(g) > 1]
