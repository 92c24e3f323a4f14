"""The planner's step 1: the split points of a class's ``forward``, read from
its source.

:func:`split_points` lists every place
:func:`annot.rewriters.split.stage_split.split_stages` can begin a stage, by the
splitter's own rule (:func:`annot.rewriters.split.boundaries.place_boundary`), then
checks them by splitting at all of them at once (:func:`points_and_split`),
dropping those the splitter refuses. :func:`split_forward` is
``split_stages``, remembered across plans of the same class.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

import libcst as cst
import torch.nn as nn

from annot.core.errors import PartitionError, RewriteError
from annot.rewriters.split.boundaries import Use, place_boundary, uses_in
from annot.rewriters.split.forward_body import forward_statements

__all__ = ["module_at", "no_markers", "points_and_split", "split_forward", "split_points"]


def _resolve(uses: Sequence[Use], path: str) -> Optional[tuple[int, int]]:
    """Where split_stages begins a stage for boundary ``path``: (item, element),
    or None where it would refuse it (stage_split's own rule, and a loop with a
    ``break`` is never split)."""
    found = place_boundary(uses, path)
    if found is None or found.problem or (found.element and found.use.breaks):
        return None
    return found.use.item, found.element


def _find_class(module: cst.Module, qualname: str) -> cst.ClassDef:
    body: Sequence[cst.CSTNode] = module.body
    found: Optional[cst.ClassDef] = None
    for part in qualname.split("."):
        found = next(
            (s for s in body if isinstance(s, cst.ClassDef) and s.name.value == part), None
        )
        if found is None:
            raise PartitionError(f"class {qualname} is not defined at the top of its source file")
        body = found.body.body
    assert found is not None
    return found


def _forward_items(cls_node: cst.ClassDef) -> tuple[str, list[cst.BaseStatement]]:
    fwd = next(
        (
            s
            for s in cls_node.body.body
            if isinstance(s, cst.FunctionDef) and s.name.value == "forward"
        ),
        None,
    )
    if fwd is None:
        raise PartitionError(
            f"class {cls_node.name.value} has no forward in its body; plan the class whose "
            "forward is split (a forward inherited from a base class is not rewritten)"
        )
    positional = [*fwd.params.posonly_params, *fwd.params.params]
    if not positional:
        raise PartitionError("forward takes no `self` parameter; annot splits methods")
    return positional[0].name.value, forward_statements(fwd.body)


def module_at(model: nn.Module, path: str) -> Any:
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _proposals(source: str, qualname: str, model: nn.Module) -> list[tuple[str, tuple, tuple]]:
    """(path, (item, element), group) for every split point, in forward order."""
    module = cst.parse_module(source)
    self_name, items = _forward_items(_find_class(module, qualname))
    uses = uses_in(items, self_name, qnames={})
    out: dict[tuple[int, int], tuple[str, tuple]] = {}
    for i in range(len(items)):
        mine = [u for u in uses if u.item == i and u.context is None]
        for u in mine:  # a stage beginning before statement i
            path = {"call": u.path, "loop": f"{u.path}.0", "loop-other": u.path}[u.kind]
            if i > 0 and _resolve(uses, path) == (i, 0):
                out.setdefault((i, 0), (path, ("statement", i)))
                break
        for u in mine:  # a stage beginning at iteration k of a loop over a module list
            seq = module_at(model, u.path) if u.kind == "loop" else None
            if not isinstance(seq, (nn.ModuleList, nn.Sequential)):
                continue
            for k in range(1, len(seq)):
                path = f"{u.path}.{k}"
                if _resolve(uses, path) == (i, k):
                    out.setdefault((i, k), (path, ("loop", i, u.path)))
    return [(p, pos, g) for pos, (p, g) in sorted(out.items())]


def split_forward(source: str, qualname: str, paths: Sequence[str], path: str):
    return _split_cached(source, qualname, tuple(paths), path)


@functools.lru_cache(maxsize=16)
def _split_cached(source: str, qualname: str, paths: tuple[str, ...], path: str):
    """split_stages, remembered: planning the same class again (another stage
    count, a memory-fit run) does not parse it again. StageSplit is immutable."""
    from annot.rewriters.split.stage_split import split_stages

    return split_stages(source, qualname, list(paths), path=path)


def split_points(
    source: str, class_name: str, model: nn.Module, *, path: str = "<string>"
) -> list[str]:
    """Every module path where ``split_stages`` can begin a stage of
    ``class_name``'s forward, in forward order (``model`` gives the lengths
    of the module lists forward loops over). Points it would refuse (a loop
    with a ``break``, a loop variable read after the loop, a ``return`` before
    the point, ...) are left out. Raises :class:`PartitionError` when forward
    has ``annot.boundary()`` markers: those fix the stages by hand."""
    return points_and_split(source, class_name, model, path)[0]


def no_markers(class_name: str, split: Any) -> None:
    markers = [b for b in split.boundaries if b.startswith("boundary()@")]
    if markers:
        raise PartitionError(
            f"{class_name}.forward has annot.boundary() markers ({', '.join(markers)}): they "
            "place the stages by hand, so there is nothing to plan; remove them to let annot "
            "choose the boundaries"
        )


def points_and_split(source: str, qualname: str, model: nn.Module, path: str):
    """The split points and the split of forward at all of them."""
    props = _proposals(source, qualname, model)
    try:
        split = split_forward(source, qualname, [p for p, _, _ in props], path)
        no_markers(qualname, split)
        return [p for p, _, _ in props], split
    except RewriteError:
        no_markers(qualname, split_forward(source, qualname, [], path))
    ok: dict[tuple, bool] = {}  # one check per statement / per split loop
    kept = []
    for p, _, group in props:
        if group not in ok:
            try:
                split_forward(source, qualname, [p], path)
                ok[group] = True
            except RewriteError:
                ok[group] = False
        if ok[group]:
            kept.append(p)
    try:
        return kept, split_forward(source, qualname, kept, path)
    except RewriteError as exc:
        raise PartitionError(
            f"cannot split {qualname}.forward at all of its split points {kept}: {exc}"
        ) from None
