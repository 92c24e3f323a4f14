"""Argument checks shared by the tensor-parallel layers and ``shard_parameter``.

A layer's degree must be an int >= 1 (:func:`check_degree`), its split sizes
must divide evenly (:func:`check_divisible`, :class:`HintError` otherwise), and
the degree the code was rewritten for must equal the current mesh's tp degree
(:func:`mesh_for`, :class:`MeshError` otherwise).
"""

from __future__ import annotations

from typing import Optional

from annot.core.errors import HintError, MeshError
from annot.runtime.process_groups import ParallelContext, current

__all__ = ["check_degree", "check_divisible", "mesh_for", "tp_context", "factory"]


def check_degree(layer: str, tp: object) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise HintError(f"{layer}: tp={tp!r} must be an int >= 1")


def check_divisible(
    layer: str, arg: str, value: int, tp: int, chunks: Optional[int] = None
) -> None:
    """``value`` must split evenly over tp (and over each of ``chunks`` blocks)."""
    if chunks is None:
        if value % tp:
            raise HintError(
                f"{layer}: {arg}={value} is not divisible by tp({tp}); "
                f"choose a tp that divides {value}, or pad {arg} to a multiple of {tp}"
            )
        return
    if value % (tp * chunks):
        hint = (
            f"each of the {chunks} fused blocks must split evenly over tp"
            if chunks > 1
            else f"choose a tp that divides {value}, or pad {arg} to a multiple of {tp}"
        )
        raise HintError(
            f"{layer}: {arg}={value} is not divisible by tp({tp}) * chunks({chunks}) = "
            f"{tp * chunks}; {hint}"
        )


def mesh_for(layer: str, tp: int) -> Optional[ParallelContext]:
    """The active context, checked against the degree the code was written for."""
    ctx = current()
    have = 1 if ctx is None else ctx.mesh.tp
    if have != tp:
        where = (
            "no parallel context is active (tp=1)"
            if ctx is None
            else f"the current mesh is {ctx.mesh!r}"
        )
        raise MeshError(
            f"{layer}(tp={tp}): this code was rewritten for tp={tp} but {where}; "
            f"run it under a mesh with tp={tp} (inside annot.runtime.process_groups.use(ctx)), "
            f"or rewrite the model again with --tp {have}"
        )
    return ctx


def tp_context(layer: str, tp: int) -> ParallelContext:
    """:func:`mesh_for` where ``tp`` > 1: a context with that degree is active
    (without one the degree in force is 1, and :func:`mesh_for` raised)."""
    ctx = mesh_for(layer, tp)
    assert ctx is not None, f"{layer}: tp={tp} > 1 with no parallel context"
    return ctx


def factory(device, dtype) -> dict:
    return {"device": device, "dtype": dtype}
