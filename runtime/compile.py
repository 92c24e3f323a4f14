"""``torch.compile`` on a parallel model, as torchtitan applies it.

This rank's model is compiled after sharding (``parallelize(compile=True)``,
``parallelize(compile={"backend": ...})`` or ``model.compile(...)`` on the
:class:`~annot.ParallelModel`): whole where it runs in one stage without
FSDP2, else each block of the model's block list (a transformers model's pp
plan, else its largest ``nn.ModuleList``: :func:`annot.hf.models.nested_blocks`). Only a block's ``forward`` is compiled (an
instance attribute, like activation checkpointing's wrapper), so the module
tree and every state-dict key stay as they are, and module hooks (FSDP2's,
the pipeline replay's, sequence parallelism's) run eagerly around it.

What stays eager: annot's orchestration (the pre-flight, the pipeline
executor and its replay of earlier stages on meta, the gradient
reductions), a block this rank does not hold (another stage's placeholder),
and a block that a pipeline boundary cuts (a compiled region never spans a
boundary). Inside a compiled block the tp collectives are torch's
functional collectives (:func:`annot.runtime.tp.comm.compiling`).

Dynamic shapes: torch's default policy (``dynamic=None``): a block is
compiled for the shapes of its first call; the first call with another
length recompiles it once with that dimension symbolic, and later lengths
reuse that graph. Pass ``dynamic=True`` to start symbolic, ``False`` to
specialise every length (a recompile each).

Exactness: dropout inside a compiled block draws its mask from the
compiler's own generator (inductor), not torch's, and annot's exact
per-rank masks (:mod:`annot.runtime.tp.dropout`) are not applied inside a
traced graph. So a compiled forward's first call in training mode (and in
eval mode) runs eagerly under :class:`~annot.runtime.tp.dropout.Recorder`:
a dropout that draws a mask there (``nn.Dropout``, ``F.dropout``,
``torch.dropout``, SDPA's ``dropout_p``), whichever API made it, is refused
with a :class:`~annot.core.errors.HintError` naming its module and line, before
the compiled code ever runs; otherwise later calls run compiled. A copy of
the model (``copy.deepcopy``, the pre-flight's meta twin) runs eagerly.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from annot.core.errors import HintError
from annot.runtime.runners.placeholder import Absent

__all__ = ["CompiledForward", "check_no_dropout", "compile_options", "compile_blocks"]

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


def check_no_dropout(module: nn.Module, fn: Callable, args: tuple, kwargs: dict, what: str):
    """``fn(*args, **kwargs)`` run eagerly, refused (:class:`HintError`) if it
    drew a dropout mask: ``what`` cannot compile it exactly."""
    from annot.runtime.tp.dropout import Recorder

    recorder = Recorder(module)
    with recorder:
        out = fn(*args, **kwargs)
    drawn = [c for c in recorder.calls if c.draws]
    if drawn:
        call = drawn[0]
        raise HintError(
            f"{what}: {call.where()} draws a dropout mask (p={call.p}); compiled, it would "
            "draw from the compiler's generator, not the single-device model's masks (nor, "
            "at tp > 1, each rank's slice of them), so the run could not equal it. Build the "
            "model with dropout 0 to compile it (or train it in eval mode), or leave compile off"
        )
    return out


class CompiledForward:
    """What a compiled module's ``forward`` attribute becomes: its first call
    in each mode (training, eval) runs eagerly and refuses a drawn dropout
    mask (:func:`check_no_dropout`); later calls run ``torch.compile``'s."""

    def __init__(self, module: nn.Module, path: str, options: dict):
        self.eager = module.forward  # bound: a checkpointing wrapper, or the class's
        self.compiled = torch.compile(self.eager, **options)
        self.module = module
        self.path = path
        self.checked: set[bool] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mode = self.module.training
        if mode in self.checked:
            return self.compiled(*args, **kwargs)
        what = f"torch.compile of {self.path or type(self.module).__name__}"
        out = check_no_dropout(self.module, self.eager, args, kwargs, what)
        self.checked.add(mode)
        return out

    def __deepcopy__(self, memo: dict) -> Any:
        """A copy of the module (the pre-flight's meta twin, a meta copy) runs
        its own forward eagerly, never this module's compiled code."""
        return copy.deepcopy(self.eager, memo)


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
    this rank holds and that no boundary cuts. Returns the paths
    compiled ("" for the whole module); a module compiled already is left
    as it is."""
    targets = _targets(module, container, boundaries, whole)
    for path, block in targets:
        block.forward = CompiledForward(block, path, options)
    paths = [p for p, _ in targets]
    if not paths:
        log.warning(
            "annot: torch.compile: nothing to compile here (no block list, and the model "
            "runs in several stages or under FSDP2); it runs eagerly"
        )
    log.info("annot: torch.compile on %s", ", ".join(p or "the model" for p in paths))
    return paths


def _compiled(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), CompiledForward)


def _targets(
    module: nn.Module, container: Optional[str], boundaries: tuple[str, ...], whole: bool
) -> list[tuple[str, nn.Module]]:
    if whole and not boundaries:
        return [] if _compiled(module) else [("", module)]
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
        if not _compiled(block):
            out.append((path, block))
    return out
