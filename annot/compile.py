"""``torch.compile`` on a parallel model, as torchtitan applies it.

This rank's model is compiled after sharding (``parallelize(compile=True)``,
``parallelize(compile={"backend": ...})`` or ``model.compile(...)`` on the
:class:`~annot.ParallelModel`): whole where it runs in one stage without
FSDP2, else each block of the model's block list (a transformers model's pp
plan, else its largest ``nn.ModuleList``: :func:`annot.hf.nested_blocks`). Only a block's ``forward`` is compiled (an
instance attribute, like activation checkpointing's wrapper), so the module
tree and every state-dict key stay as they are, and module hooks (FSDP2's,
the pipeline replay's, sequence parallelism's) run eagerly around it.

What stays eager: annot's orchestration (the pre-flight, the pipeline
executor and its replay of earlier stages on meta, the gradient
reductions), a block this rank does not hold (another stage's placeholder),
and a block that a pipeline boundary cuts (a compiled region never spans a
boundary). Inside a compiled block the tp collectives are torch's
functional collectives (:func:`annot.runtime.tp_comm.compiling`).

Dynamic shapes: torch's default policy (``dynamic=None``): a block is
compiled for the shapes of its first call; the first call with another
length recompiles it once with that dimension symbolic, and later lengths
reuse that graph. Pass ``dynamic=True`` to start symbolic, ``False`` to
specialise every length (a recompile each).

Exactness: dropout inside a compiled block draws its mask from the
compiler's own generator (inductor), not torch's, and annot's exact
per-rank masks (:mod:`annot.runtime.tp_dropout`) are not applied inside a
traced graph, so an ``nn.Dropout`` with ``p > 0`` in a block to compile is
refused, naming it.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch
import torch.nn as nn

from annot.errors import HintError
from annot.runtime.stage_prune import Absent

__all__ = ["compile_options", "compile_blocks", "compiled_paths"]

log = logging.getLogger("annot")


def compile_options(compile: Union[bool, dict, None]) -> Optional[dict]:
    """``parallelize(compile=...)`` as keyword arguments for ``torch.compile``
    (None: do not compile)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, dict):
        if "model" in compile:
            raise HintError("parallelize: compile= takes torch.compile's options, not a model")
        return dict(compile)
    raise HintError(
        f"parallelize: compile={compile!r}; expected True, False or a dict of torch.compile "
        'options, e.g. compile={"backend": "inductor", "dynamic": None}'
    )


def compile_blocks(
    module: nn.Module,
    options: dict,
    *,
    container: Optional[str],
    boundaries: tuple[str, ...] = (),
    whole: bool = True,
) -> list[str]:
    """Compile ``module``'s own forward where ``whole`` (one stage, no
    FSDP2: its embedding, head and loss are worth compiling too), else the
    ``forward`` of each block of ``container`` (a path under ``module``) that
    this rank holds and that no boundary cuts. Returns the paths compiled
    ("" for the whole module)."""
    targets = _targets(module, container, boundaries, whole)
    _check_dropout(targets)
    for _, block in targets:
        block.forward = torch.compile(block.forward, **options)
        block.annot_compiled = True
    paths = [p for p, _ in targets]
    log.info("annot: torch.compile on %s", ", ".join(p or "the model" for p in paths) or "nothing")
    return paths


def compiled_paths(module: nn.Module) -> list[str]:
    """The paths under ``module`` whose forward :func:`compile_blocks` compiled."""
    return [p for p, m in module.named_modules() if getattr(m, "annot_compiled", False)]


def _targets(
    module: nn.Module, container: Optional[str], boundaries: tuple[str, ...], whole: bool
) -> list[tuple[str, nn.Module]]:
    if whole and not boundaries:
        return [("", module)]
    if container is None:
        return []
    out = []
    for name, block in module.get_submodule(container).named_children():
        path = f"{container}.{name}"
        if isinstance(block, Absent):  # another stage's placeholder
            continue
        if any(b.startswith(path + ".") for b in boundaries):  # cut by a boundary: eager
            log.info("annot: %s is cut by a pipeline boundary; it runs eagerly", path)
            continue
        if getattr(block, "annot_compiled", False):
            continue
        out.append((path, block))
    return out


def _check_dropout(targets: list[tuple[str, nn.Module]]) -> None:
    """Refuse a dropout with ``p > 0`` in a block to compile (see the module
    docstring), naming it."""
    for path, block in targets:
        for name, m in block.named_modules():
            p = getattr(m, "p", 0.0)
            if isinstance(m, nn.modules.dropout._DropoutNd) and p > 0:
                where = ".".join(x for x in (path, name) if x) or type(block).__name__
                raise HintError(
                    f"torch.compile: {where} is a dropout with p={p}; in a compiled block its "
                    "masks would not be the ones the single-device model draws (nor, at "
                    "tp > 1, each rank's slice of them), so the run could not equal it. "
                    "Build the model with dropout 0 to compile it, or leave compile off"
                )
