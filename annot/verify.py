"""Check hints against a built model, before any rank does parallel work.

``@shard`` only records; this module verifies, in the torchgpipe habit of
``verify_skippables``: every hinted name exists, has a type the spec applies
to, and every size tp must divide is divisible. Errors name the class, the
argument and what was expected.
"""

from __future__ import annotations

import torch.nn as nn

from annot.errors import HintError
from annot.hints import ShardSpec
from annot.specs import Col, P, Replicate, Row, Vocab

__all__ = ["verify_shard_hints"]

_LINEAR_TYPES = (nn.Linear,)


def _linear_features(sub: nn.Module):
    """(in_features, out_features) of an nn.Linear, or of HF transformers'
    ``Conv1D`` (GPT-2; weight stored (in, out)); None for any other module."""
    if isinstance(sub, _LINEAR_TYPES):
        return sub.in_features, sub.out_features
    if type(sub).__name__ == "Conv1D" and type(sub).__module__ == "transformers.pytorch_utils":
        nx, nf = sub.weight.shape
        return nx, nf
    return None


def _fmt_names(names) -> str:
    return ", ".join(sorted(names)) or "(none)"


def verify_shard_hints(model: nn.Module, class_specs: dict[type, ShardSpec], tp: int) -> None:
    """Raise :class:`HintError` for the first hint that does not fit ``model``.

    ``class_specs`` maps each hinted class to its spec (decorator or external).
    Every instance of a hinted class inside ``model`` is checked.
    """
    fused: dict[tuple[type, str], tuple[int, str]] = {}  # (class, name) -> (out, first path)
    for path, mod in model.named_modules():
        spec = class_specs.get(type(mod))
        if spec is None:
            continue
        cls = type(mod).__name__
        where = f"{cls}" + (f" (at {path})" if path else "")
        children = dict(mod.named_children())
        params = dict(mod.named_parameters(recurse=False))
        for name, s in spec.specs.items():
            if isinstance(s, P):
                if name not in params:
                    raise HintError(
                        f"@shard on {where}: argument {name}={s!r} names no parameter of "
                        f"{cls}; its own parameters are: {_fmt_names(params)}"
                    )
                t = params[name]
                if len(s.dims) != t.dim():
                    raise HintError(
                        f"@shard on {where}: argument {name}={s!r} has {len(s.dims)} entries but "
                        f"{name} has {t.dim()} dims (shape {tuple(t.shape)}); give one entry per dim"
                    )
                d = s.split_dim
                if d is not None and t.shape[d] % tp:
                    raise HintError(
                        f"@shard on {where}: argument {name}={s!r}: dim {d} of {name} has size "
                        f"{t.shape[d]}, not divisible by tp ({tp})"
                    )
                continue
            sub = children.get(name)
            if sub is None:  # an entry of an nn.ModuleDict built in __init__ (nanoGPT's layout)
                sub = next(
                    (
                        c[name]
                        for c in children.values()
                        if isinstance(c, nn.ModuleDict) and name in c
                    ),
                    None,
                )
            if sub is None:
                hint = f"; its submodules are: {_fmt_names(children)}"
                if name in params:
                    hint = f"; {name} is a parameter: use P(...) for parameters"
                raise HintError(
                    f"@shard on {where}: argument {name}={s!r} names no submodule of {cls}{hint}"
                )
            kind = type(sub).__name__
            if isinstance(s, (Col, Row)):
                features = _linear_features(sub)
                if features is None:
                    raise HintError(
                        f"@shard on {where}: argument {name}={s!r} applies to nn.Linear, but "
                        f"{cls}.{name} is a {kind}"
                        + (
                            "; use Vocab() for an nn.Embedding"
                            if isinstance(sub, nn.Embedding)
                            else ""
                        )
                    )
                in_features, out_features = features
                if isinstance(s, Col) and s.chunks > 1:
                    seen = fused.setdefault((type(mod), name), (out_features, path or "<root>"))
                    if seen[0] != out_features:
                        raise HintError(
                            f"@shard on {where}: argument {name}={s!r}: {cls}.{name} has "
                            f"out_features={out_features} here but {seen[0]} at {seen[1]}; "
                            f"chunks={s.chunks} fits one fused layout only and annot hints are "
                            "per class (GPT-2's cross-attention c_attn fuses k|v, its "
                            "self-attention c_attn q|k|v): build one layout, or hint the "
                            "class by hand without chunks for both"
                        )
                if isinstance(s, Col):
                    div = tp * s.chunks
                    if out_features % div:
                        raise HintError(
                            f"@shard on {where}: argument {name}={s!r}: out_features="
                            f"{out_features} is not divisible by tp({tp}) * chunks({s.chunks}) = {div}"
                        )
                elif in_features % tp:
                    raise HintError(
                        f"@shard on {where}: argument {name}={s!r}: in_features={in_features} "
                        f"is not divisible by tp ({tp})"
                    )
            elif isinstance(s, Vocab):
                if not isinstance(sub, nn.Embedding):
                    raise HintError(
                        f"@shard on {where}: argument {name}=Vocab() applies to nn.Embedding, but "
                        f"{cls}.{name} is a {kind}"
                        + (
                            "; use Col() or Row() for an nn.Linear"
                            if isinstance(sub, nn.Linear)
                            else ""
                        )
                    )
                if sub.num_embeddings % tp:
                    raise HintError(
                        f"@shard on {where}: argument {name}=Vocab(): num_embeddings="
                        f"{sub.num_embeddings} is not divisible by tp ({tp})"
                    )
            elif isinstance(s, Replicate):
                pass
        for name in spec.local:
            if not hasattr(mod, name):
                continue  # a forward-local name (e.g. C in `B, T, C = x.size()`)
            value = getattr(mod, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise HintError(
                    f"@shard on {where}: local={spec.local!r}: {cls}.{name} is "
                    f"{type(value).__name__} {value!r}; local names must be int sizes"
                )
            if value % tp:
                raise HintError(
                    f"@shard on {where}: local={spec.local!r}: {cls}.{name}={value} is not "
                    f"divisible by tp ({tp})"
                )
