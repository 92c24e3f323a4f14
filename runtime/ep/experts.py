"""``Experts()`` applied to a built module: each rank of an expert group keeps
its ``E / ep`` experts of every tensor of the module (:mod:`annot.runtime.ep.shards`)
and the module's forward dispatches tokens to them (:mod:`annot.runtime.ep.dispatch`).
"""

from __future__ import annotations

import types

from torch import nn

from annot.core.errors import HintError
from annot.runtime.ep.dispatch import expert_forward
from annot.runtime.ep.shards import EP_ATTR, expert_group, split_experts

__all__ = ["convert_experts", "expert_parallel"]


def _experts_count(module: nn.Module, where: str) -> int:
    """E: the leading dim every parameter of the module shares."""
    sizes = {name: p.shape[0] if p.dim() else 0 for name, p in module.named_parameters()}
    counts = set(sizes.values())
    if len(counts) != 1 or 0 in counts:
        raise HintError(
            f"{where}: Experts() splits the module's parameters by their first dim (the "
            f"expert), but their first dims differ: {sizes}. Hint the module that holds "
            "only the experts' weights, stacked (E, ...), as transformers' experts modules do"
        )
    return counts.pop()


def expert_parallel(module: nn.Module, *, ep: int, where: str = "") -> nn.Module:
    """``Experts()`` on a built module, on this rank of its expert group: its
    tensors cut to this rank's experts, its int attributes named for experts
    that hold their count (``num_experts``) set to this rank's count, its
    forward dispatching tokens to the ranks that hold theirs. Returns
    ``module``; at ``ep == 1`` unchanged."""
    where = where or type(module).__name__
    if ep == 1 or module.__dict__.get(EP_ATTR):
        return module
    count = _experts_count(module, where)
    if count % ep:
        raise HintError(
            f"{where}: Experts() splits {count} experts over ep={ep}, which does not divide "
            f"them; use an ep that divides {count} (e.g. Mesh(dp=..., ep="
            f"{max(d for d in range(1, count + 1) if count % d == 0 and d <= ep)}))"
        )
    _, rank = expert_group(ep, where)
    split_experts(module, count, ep, rank)
    for name, value in list(vars(module).items()):  # the count its forward reads: this rank's
        if "expert" in name and type(value) is int and value == count:
            module.__dict__[name] = count // ep
    module.__dict__[EP_ATTR] = ep
    module.__dict__["annot_experts"] = count
    module.forward = types.MethodType(expert_forward, module)
    return module


def convert_experts(model: nn.Module, paths: dict[str, object], ep: int) -> list[str]:
    """Apply every ``Experts()`` of ``paths`` (hints by module path) to
    ``model``; returns the paths, in order. Call under the mesh's context."""
    from annot.core.specs import Experts

    done = []
    for path, spec in sorted(paths.items()):
        if not isinstance(spec, Experts):
            continue
        try:
            sub = model.get_submodule(path)
        except AttributeError:  # on another pipeline stage
            continue
        expert_parallel(sub, ep=ep, where=f"{path}: Experts()")
        done.append(path)
    return done
