"""Values at a stage boundary on this rank, for the pipeline executor
(:mod:`annot.runtime.pipeline.executor`): a stage's outputs handed to the next stage
on the same rank, the gradients its inputs collect and send back, and its
outputs paired with the gradients received. Tensors are taken in the flatten
order of :mod:`annot.runtime.pipeline.p2p_codec`, the same on both sides of a boundary.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from annot.core.errors import PipelineError
from annot.runtime.pipeline.p2p_codec import flatten, tensors_requiring_grad, unflatten

__all__ = ["grad_pairs", "handoff", "input_grads", "keep_grads"]


def handoff(out: Any, device: Optional[torch.device]) -> Any:
    """A stage's outputs as the next stage's inputs on the same rank: the same
    values, tensors detached, so each stage keeps its own graph (as after p2p)."""
    tree, tensors = flatten(out, root="stage outputs")
    fresh = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
    return unflatten(tree, fresh, device=device)


def keep_grads(inputs: Any) -> None:
    """Received tensors that require grad must collect a ``.grad`` (p2p gives
    leaves; anything else is asked to retain it)."""
    for t in tensors_requiring_grad(inputs):
        if not t.is_leaf:
            t.retain_grad()


def input_grads(inputs: Any) -> list[Optional[torch.Tensor]]:
    """What B sends back: the ``.grad`` of each input tensor that requires
    grad (p2p's flatten order), None where one got no gradient."""
    return [t.grad for t in tensors_requiring_grad(inputs)]


def grad_pairs(out: Any, grads: list, stage: int, microbatch: int) -> list[tuple]:
    """Pair each output tensor that requires grad with its gradient; skip Nones."""
    tensors = tensors_requiring_grad(out)
    if not isinstance(grads, list) or len(grads) != len(tensors):
        n = len(grads) if isinstance(grads, list) else type(grads).__name__
        raise PipelineError(
            f"stage {stage}, microbatch {microbatch}: {n} gradients arrived for "
            f"{len(tensors)} outputs that require grad; the two sides of the stage boundary "
            "disagree about its values (please report this)"
        )
    return [(t, g) for t, g in zip(tensors, grads) if g is not None]
