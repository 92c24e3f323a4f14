"""``torch.nn.utils.clip_grad_norm_`` on a parallel model's parameters: the
whole model's norm, not this rank's.

Each rank of a pipeline holds its stages' parameters, and under tp each
holds shards: torch's ``clip_grad_norm_(model.parameters(), max_norm)`` on
each rank scales each rank's gradients by its own part's norm, a result that
differs from the single device's without any error (the norm of a stage is
smaller than the model's). Training scripts and trainers (Hugging Face's
Trainer through accelerate) call it as it is, so once a distributed
:class:`~annot.parallel_model.ParallelModel` with pipeline stages, tp or
FSDP2 exists, :func:`install` wraps it:

- called with the model's parameters (every local one that has a gradient,
  and no parameter of anything else), it clips by the whole model's norm,
  :meth:`~annot.parallel_model.ParallelModel.clip_grad_norm_` (a collective:
  every rank calls it, as a training loop does), and returns that norm;
- called with a part of them (some of the parameters with a gradient, or
  mixed with another model's), it refuses with an
  :class:`~annot.core.errors.AnnotError`: a part's norm is a different
  norm on each rank;
- any other call is torch's own.

A name bound before the first parallel model was built (``from
torch.nn.utils import clip_grad_norm_`` at the top of a script) keeps
torch's function: call ``annot.clip_grad_norm_(model, max_norm)`` or
``model.clip_grad_norm_(max_norm)`` there.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch

from annot.core.errors import AnnotError

__all__ = ["guard", "install"]

# the distributed parallel models whose parameters the wrapper routes
_MODELS: weakref.WeakSet = weakref.WeakSet()


def guard(model: Any) -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` on ``model``'s parameters
    to its whole-model clip from now on (installs the wrapper once)."""
    _MODELS.add(model)
    install()


def install() -> None:
    """Wrap ``torch.nn.utils.clip_grad_norm_`` (where torch defines it and
    where scripts find it), once."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    if getattr(utils.clip_grad_norm_, "__annot_clip__", False):
        return
    wrapped = _wrap(utils.clip_grad_norm_)
    utils.clip_grad_norm_ = wrapped
    clip_grad.clip_grad_norm_ = wrapped


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def clip_grad_norm_(
        parameters: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        model = _owner(params)
        if model is None:
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        norm = model.clip_grad_norm_(max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        return norm

    clip_grad_norm_.__annot_clip__ = True  # type: ignore[attr-defined]
    return clip_grad_norm_


def _owner(params: list) -> Any:
    """The guarded model whose parameters ``params`` are (every local one
    with a gradient), None when they are none of a guarded model's; refuses
    a part of one."""
    given = {id(p) for p in params}
    for model in list(_MODELS):
        named = list(model.named_parameters())
        mine = {id(p) for _, p in named}
        if given.isdisjoint(mine):
            continue
        missing = [name for name, p in named if p.grad is not None and id(p) not in given]
        foreign = len(given - mine)
        if missing or foreign:
            what = (
                f"leaves out {len(missing)} of this rank's parameters with a gradient "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
                if missing
                else f"mixes in {foreign} tensor(s) that are not the model's parameters"
            )
            raise AnnotError(
                "torch.nn.utils.clip_grad_norm_ on a part of a parallel model's parameters "
                f"{what}: each rank holds only its pipeline stages (and tp shards), so a part's "
                "norm is a different norm on each rank and the clipped gradients would differ "
                "from one device's. Clip the whole model, on every rank: "
                "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or "
                "annot.clip_grad_norm_(model, max_norm)"
            )
        return model
    return None
