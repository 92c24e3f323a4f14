"""Check hints against a built model, before any rank does parallel work.

``@shard`` only records; this module verifies, in the torchgpipe habit of
``verify_skippables``: every hinted name exists, has a type the spec applies
to (decided by runtime type, :func:`annot.runtime.tp.convert.check_layer`), and
every size tp must divide is divisible. Errors name the class, the argument
and what was expected.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from annot.core.errors import HintError
from annot.core.hints import ShardSpec, hinted_paths
from annot.core.specs import Col, Experts, Heads, P, Partial, Replicate, Row, Spec, Vocab

__all__ = ["check_shard_hints"]


def _fmt_names(names) -> str:
    return ", ".join(sorted(names)) or "(none)"


def _features(sub: nn.Module, kind: str) -> tuple[int, int]:
    """(in, out) features of a linear-like layer (HF Conv1D stores (in, out))."""
    if kind == "conv1d":
        weight = sub.get_parameter("weight")
        nx, nf = weight.shape
        return nx, nf
    assert isinstance(sub, nn.Linear)  # layer_kind: "linear"
    return sub.in_features, sub.out_features


def _hint_owner(full: str, modules: dict, class_specs: dict) -> tuple[str, nn.Module]:
    """(path, module) whose hint names ``full``: its parent, or the owner of an
    ``nn.ModuleDict`` hinted with the dict's keys (nanoGPT's ``transformer.wte``)."""
    parent_path, _, name = full.rpartition(".")
    if isinstance(modules[parent_path], nn.ModuleDict) and parent_path:
        owner_path = parent_path.rpartition(".")[0]
        spec = class_specs.get(type(modules[owner_path]))
        if spec is not None and name in spec.specs:
            return owner_path, modules[owner_path]
    return parent_path, modules[parent_path]


def check_shard_hints(
    model: nn.Module,
    class_specs: dict[type, ShardSpec],
    tp: int,
    paths: Optional[dict[str, Spec]] = None,
) -> None:
    """Raise :class:`HintError` for the first hint that does not fit ``model``.

    ``class_specs`` maps each hinted class to its spec (decorator or external);
    ``paths`` every hint by the path it applies to (default: the class specs
    at every instance, :func:`annot.core.hints.hinted_paths`).
    """
    from annot.runtime.tp.convert import check_layer, layer_kind

    modules = dict(model.named_modules(remove_duplicate=False))  # a shared module: each name
    if paths is None:
        paths = hinted_paths(model, class_specs)
    params = dict(model.named_parameters(remove_duplicate=False))
    fused: dict[tuple[type, str], tuple[int, str]] = {}  # (class, name) -> (out, first path)
    for full, s in paths.items():
        name = full.rpartition(".")[2]
        parent_path, parent = _hint_owner(full, modules, class_specs)
        cls = type(parent).__name__
        where = f"{cls}" + (f" (at {parent_path})" if parent_path else "")
        head = f"@shard on {where}: argument {name}={s!r}"
        if isinstance(s, Heads):
            _check_heads(parent, name, s, tp, head, cls)
            continue
        sub = modules.get(full)
        param = None if sub is not None else params.get(full)
        if isinstance(s, P):
            if param is None:
                own = dict(parent.named_parameters(recurse=False))
                raise HintError(
                    f"{head} names no parameter of {cls}; its own parameters are: {_fmt_names(own)}"
                )
            if len(s.dims) != param.dim():
                raise HintError(
                    f"{head} has {len(s.dims)} entries but {name} has {param.dim()} dims (shape "
                    f"{tuple(param.shape)}); give one entry per dim"
                )
            d = s.split_dim
            if d is not None and param.shape[d] % (tp * s.chunks):
                by = f"tp ({tp})" if s.chunks == 1 else f"tp ({tp}) * chunks ({s.chunks})"
                raise HintError(
                    f"{head}: dim {d} of {name} has size {param.shape[d]}, not divisible by {by}"
                )
            continue
        if sub is None:
            if isinstance(s, Replicate) and param is not None:
                continue
            hint = f"; its submodules are: {_fmt_names(dict(parent.named_children()))}"
            if param is not None:
                hint = f"; {name} is a parameter: use P(...) for parameters"
            raise HintError(f"{head} names no submodule of {cls}{hint}")
        if isinstance(s, (Replicate, Partial, Experts)):
            continue
        check_layer(sub, s, head, f"{cls}.{name}")
        kind = layer_kind(sub)
        assert kind is not None  # check_layer refuses a module of no layer kind
        if kind == "embedding":
            size, what = (
                (sub.num_embeddings, "num_embeddings")
                if isinstance(s, Vocab)
                else (sub.embedding_dim, "embedding_dim")
            )
            if size % tp:
                raise HintError(f"{head}: {what}={size} is not divisible by tp ({tp})")
            continue
        in_features, out_features = _features(sub, kind)
        if isinstance(s, Col) and s.chunks > 1:
            seen = fused.setdefault((type(parent), name), (out_features, parent_path or "<root>"))
            if seen[0] != out_features:
                raise HintError(
                    f"{head}: {cls}.{name} has out_features={out_features} here but {seen[0]} "
                    f"at {seen[1]}; chunks={s.chunks} fits one fused layout only and annot "
                    "hints are per class (GPT-2's cross-attention c_attn fuses k|v, its "
                    "self-attention c_attn q|k|v): build one layout, or hint the class by "
                    "hand without chunks for both"
                )
        if isinstance(s, Col):
            div = tp * s.chunks
            if out_features % div:
                raise HintError(
                    f"{head}: out_features={out_features} is not divisible by tp({tp}) * "
                    f"chunks({s.chunks}) = {div}"
                )
        elif isinstance(s, Row) and in_features % tp:
            raise HintError(f"{head}: in_features={in_features} is not divisible by tp ({tp})")
    for path, mod in modules.items():
        spec = class_specs.get(type(mod))
        if spec is not None:
            _check_local_sizes(mod, path, spec.local, tp)


def _check_local_sizes(mod: nn.Module, path: str, local: tuple[str, ...], tp: int) -> None:
    """Each per-rank size ``mod`` holds is an int that tp divides; a dotted
    name (``config.n_head``) must lead from ``mod`` to one."""
    cls = type(mod).__name__
    where = f"{cls}" + (f" (at {path})" if path else "")
    for name in local:
        value = _attribute_path(mod, name)
        if value is _MISSING:
            if "." not in name:
                continue  # a forward-local name (e.g. C in `B, T, C = x.size()`)
            raise HintError(
                f"@shard on {where}: local={local!r}: {cls} has no {name} (a dotted local "
                f"name is a path of attributes from the module: self.{name}); name the "
                "attribute forward reads"
            )
        if isinstance(value, bool) or not isinstance(value, int):
            raise HintError(
                f"@shard on {where}: local={local!r}: {cls}.{name} is "
                f"{type(value).__name__} {value!r}; local names must be int sizes"
            )
        if value % tp:
            raise HintError(
                f"@shard on {where}: local={local!r}: {cls}.{name}={value} is not "
                f"divisible by tp ({tp})"
            )


_MISSING = object()


def _attribute_path(obj: object, name: str) -> object:
    """``obj.a.b`` for ``name`` ``"a.b"``; ``_MISSING`` where a part is absent."""
    for part in name.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            break
    return obj


def _check_heads(module, name: str, s: Heads, tp: int, head: str, cls: str) -> None:
    """``Heads()`` names an argument of the module's forward, and its heads divide."""
    import inspect

    params = inspect.signature(module.forward).parameters
    if name not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise HintError(
            f"{head}: {cls}.forward has no argument {name!r} (its arguments: "
            f"{', '.join(params) or 'none'}); Heads() names a tensor argument of forward"
        )
    if s.heads is not None and s.heads % tp:
        raise HintError(f"{head}: heads={s.heads} is not divisible by tp ({tp})")
