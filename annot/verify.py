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


def _fmt_names(names) -> str:
    return ", ".join(sorted(names)) or "(none)"


def verify_shard_hints(model: nn.Module, class_specs: dict[type, ShardSpec], tp: int) -> None:
    """Raise :class:`HintError` for the first hint that does not fit ``model``.

    ``class_specs`` maps each hinted class to its spec (decorator or external).
    Every instance of a hinted class inside ``model`` is checked.
    """
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
                if not isinstance(sub, _LINEAR_TYPES):
                    raise HintError(
                        f"@shard on {where}: argument {name}={s!r} applies to nn.Linear, but "
                        f"{cls}.{name} is a {kind}"
                        + (
                            "; use Vocab() for an nn.Embedding"
                            if isinstance(sub, nn.Embedding)
                            else ""
                        )
                    )
                if isinstance(s, Col):
                    div = tp * s.chunks
                    if sub.out_features % div:
                        raise HintError(
                            f"@shard on {where}: argument {name}={s!r}: out_features="
                            f"{sub.out_features} is not divisible by tp({tp}) * chunks({s.chunks}) = {div}"
                        )
                elif sub.in_features % tp:
                    raise HintError(
                        f"@shard on {where}: argument {name}={s!r}: in_features={sub.in_features} "
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
