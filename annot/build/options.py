"""The options of :func:`annot.parallelize`, checked before any rank works
(:func:`resolve_options`): the mesh, the model or its class, precision,
``compile=``, and an option the model's constructor also takes refused."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch.nn as nn

from annot.core.errors import HintError, MeshError
from annot.core.mesh import Mesh
from annot.runtime.compile import compile_options
from annot.runtime.grads.buckets import check_bucket_options
from annot.runtime.precision import parse_precision

__all__ = ["Options", "option_defaults", "resolve_options"]


@dataclass
class Options:
    """What :func:`annot.parallelize` was asked for, checked."""

    mesh: Mesh
    instance: Optional[nn.Module]  # the model, where a built one was given
    cls: type
    kwargs: dict  # the constructor's keyword arguments
    chunks: int
    placement: str
    autocast: Any
    precision: Optional[str]
    compile_kw: Optional[dict]
    verify: bool
    sequence_parallel: Union[bool, str, list]
    sequence_dim: int
    overlap_grad_reduce: bool
    bucket_cap_mb: float
    fsdp: bool
    memory: Union[int, str, None]
    weights: Any

    def memory_budget(self) -> Any:
        from annot.build.stage_choice import MemoryBudget

        if self.memory is None:
            return None
        return MemoryBudget.of(self.memory, self.precision, self.fsdp, self.mesh.dp)


def resolve_options(
    model: Any,
    args: tuple,
    kwargs: dict,
    given: dict[str, Any],
    defaults: dict[str, Any],
    model_kwargs: dict,
) -> Options:
    """The options ``given`` (every option by name, as the caller passed it),
    checked: refused here, before any rank works. ``kwargs`` are the model
    constructor's, ``model_kwargs`` merged in."""
    mesh = _check_options(
        given["mesh"], given["chunks"], given["overlap_grad_reduce"], given["bucket_cap_mb"]
    )
    if mesh.cp > 1 and (mesh.pp > 1 or given["fsdp"] or given["sequence_parallel"]):
        raise MeshError(
            f"{mesh!r}: context parallelism with pipeline stages, fsdp=True or "
            "sequence_parallel= is not built yet; use cp with dp and tp"
        )
    autocast = parse_precision(given["precision"])
    compile_kw = compile_options(given["compile"])
    _check_option_names(model, given, defaults, model_kwargs)
    instance, cls = _model_and_class(model, args, kwargs)
    verify = given["verify"]
    if verify is None:
        verify = os.environ.get("ANNOT_VERIFY") == "1"
    return Options(
        mesh=mesh,
        instance=instance,
        cls=cls,
        kwargs=kwargs,
        chunks=given["chunks"],
        placement=_check_placement(given["placement"], given["chunks"], mesh),
        autocast=autocast,
        precision=given["precision"],
        compile_kw=compile_kw,
        verify=verify,
        sequence_parallel=given["sequence_parallel"],
        sequence_dim=given["sequence_dim"],
        overlap_grad_reduce=given["overlap_grad_reduce"],
        bucket_cap_mb=given["bucket_cap_mb"],
        fsdp=given["fsdp"],
        memory=given["memory"],
        weights=given["weights"],
    )


def option_defaults(parallelize: Callable) -> dict[str, Any]:
    """The keyword options of :func:`annot.parallelize` and their defaults."""
    params = inspect.signature(parallelize).parameters
    return {
        n: p.default
        for n, p in params.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "model_kwargs"
    }


def _check_option_names(
    model: Any, given: dict[str, Any], defaults: dict[str, Any], model_kwargs: dict
) -> None:
    """Refuse an option of :func:`parallelize` given (not its default) that
    the model's constructor takes too: the value went to annot, and the
    model would silently be built without it."""
    if not (isinstance(model, type) and issubclass(model, nn.Module)):
        return
    try:
        params = inspect.signature(model.__init__).parameters
    except (TypeError, ValueError):  # a builtin __init__: no names to clash
        return
    for name, value in given.items():
        default = defaults[name]
        if name in model_kwargs or name not in params:
            continue
        if not (value is default or (type(value) is type(default) and value == default)):
            raise HintError(
                f"parallelize: {model.__name__}.__init__ takes {name}=, and so does "
                f"parallelize; {name}={value!r} went to parallelize. Say which you mean: "
                f"for the model, pass model_kwargs={{{name!r}: {value!r}}}; for annot, "
                f"pass the model's own value through model_kwargs too, e.g. "
                f"annot.parallelize({model.__name__}, ..., {name}={value!r}, "
                f"model_kwargs={{{name!r}: ...}})"
            )


def _check_placement(placement: object, chunks: int, mesh: Mesh) -> str:
    """``"loop"`` or ``"v"`` (two stages per rank, for schedule="zbv")."""
    if placement not in ("loop", "v"):
        raise HintError(
            f"parallelize: placement={placement!r}; expected 'loop' (rank r holds stages r, "
            "r + pp, ...) or 'v' (rank r holds stages r and 2 pp - 1 - r, for schedule='zbv')"
        )
    if placement == "v" and (chunks != 2 or mesh.pp < 2):
        raise HintError(
            f"parallelize: placement='v' places two stages per rank in a V over pp > 1 ranks; "
            f"got chunks={chunks}, pp={mesh.pp}: use chunks=2 with pp >= 2"
        )
    return str(placement)


def _check_options(mesh: Optional[Mesh], chunks: int, overlap, bucket_cap_mb) -> Mesh:
    """The mesh, after the checks that need no rank: refused before any works."""
    mesh = mesh or Mesh()
    if not isinstance(mesh, Mesh):
        raise HintError(f"parallelize: mesh={mesh!r}; expected annot.Mesh(dp=, pp=, tp=)")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise HintError(f"parallelize: chunks={chunks!r}; expected an int >= 1")
    check_bucket_options(overlap, bucket_cap_mb)
    return mesh


def _model_and_class(model: Any, args: tuple, kwargs: dict) -> tuple[Optional[nn.Module], type]:
    """``(the built model or None, its class)``."""
    if isinstance(model, nn.Module):  # built already (e.g. by a library's loader)
        if args or kwargs:
            raise HintError(
                "parallelize: got a built model and constructor arguments; pass either the "
                "class and its arguments, or the model alone"
            )
        return model, type(model)
    if not (isinstance(model, type) and issubclass(model, nn.Module)):
        raise HintError(
            f"parallelize: expected an nn.Module class (and its constructor arguments) or a "
            f"built nn.Module, got {type(model).__name__}; e.g. "
            "annot.parallelize(GPT, config, mesh=mesh)"
        )
    return None, model
