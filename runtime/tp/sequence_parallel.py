"""Megatron's sequence parallelism (Korthikanti et al., 2022) over a run of blocks.

Tensor parallelism alone leaves the activations between the blocks' tp
regions whole on every rank: the norms, the dropouts and the residual adds
run tp times over, on tp copies. Sequence parallelism splits those
activations along the sequence instead:

- the first block's input is cut to this rank's shard of the sequence (its
  gradient all-gathered in backward);
- a tp region (an attention, an MLP) all-gathers its input from the shards
  (backward: reduce-scatter of the column layers' partial gradients), and its
  row-parallel layer reduce-scatters the output back to them (backward:
  all-gather), in place of the two all-reduces;
- the last block's output is all-gathered whole again (backward: this
  rank's slice).

A transformer block then costs 2 all-gathers and 2 reduce-scatters forward
and the same backward, the communication of its 2 + 2 all-reduces, and the
norms and dropouts between them run on ``1/tp`` of the sequence. A replicated
parameter inside the blocks sees only this rank's tokens (a norm's weight) or
heads (a per-head q/k norm), so its gradient is summed over tp.

:func:`apply_sequence_parallel` sets this up on a built model; the build
(:func:`annot.parallelize`, ``sequence_parallel=``) chooses the blocks.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Optional, cast

import torch
import torch.nn as nn

from annot.core.errors import HintError
from annot.core.specs import PARALLEL_LAYERS, Col, Row
from annot.runtime.tp import layers as tp_layers
from annot.runtime.tp.comm import (
    check_sequence_split,
    gather_from_tp,
    gather_sequence,
    scatter_to_tp,
)
from annot.runtime.tp.embedding import ColumnParallelEmbedding, VocabParallelEmbedding
from annot.runtime.tp.state_dict import shard_layouts

__all__ = ["apply_sequence_parallel", "stage_runs"]


def _layers(spec: type) -> tuple[type, ...]:
    """The parallel layers of linear kinds (not embeddings) that ``spec`` makes."""
    return tuple(
        getattr(tp_layers, name)
        for (kind, s), name in PARALLEL_LAYERS.items()
        if s is spec and kind != "embedding"
    )


# PARALLEL_LAYERS' linear kinds: ColumnParallelLinear/Conv1D, RowParallelLinear/Conv1D
_COLUMNS = cast(
    "tuple[type[tp_layers.ColumnParallelLinear | tp_layers.ColumnParallelConv1D], ...]",
    _layers(Col),
)
_ROWS = cast(
    "tuple[type[tp_layers.RowParallelLinear | tp_layers.RowParallelConv1D], ...]", _layers(Row)
)
_SPLIT_LAYERS = (*_COLUMNS, *_ROWS)


def apply_sequence_parallel(root: nn.Module, blocks: Sequence[str], dim: int, tp: int) -> None:
    """Run the blocks at ``blocks`` (module paths under ``root``, in the order
    forward calls them) on sequence shards along ``dim`` of their first
    argument.

    Inside a block, each smallest module holding both column- and
    row-parallel layers (an attention, an MLP) is a tp region: its first
    argument is all-gathered on entry, so its code sees the whole sequence
    (``B, T, C = x.shape`` reads the full ``T``). A column layer outside any
    region gathers its own input. Refuses, naming the module, what it cannot
    make equal to the single-device run."""
    if tp == 1 or not blocks:
        return
    modules = dict(root.named_modules())
    missing = [b for b in blocks if b not in modules]
    if missing:
        raise HintError(
            f"sequence_parallel: no module {missing[0]!r} under {type(root).__name__}; "
            "name the blocks by their paths (e.g. 'model.layers.0')"
        )
    sharded = shard_layouts(root)
    rows = 0
    for block in blocks:
        for path, m in modules[block].named_modules(prefix=block):
            if isinstance(m, (VocabParallelEmbedding, ColumnParallelEmbedding)) or (
                isinstance(m, _COLUMNS) and m.gather
            ):
                raise HintError(
                    f"sequence_parallel: {path} ({type(m).__name__}) inside the block "
                    f"{block} makes its output whole along the features, which a "
                    "sequence shard cannot continue; hint it Col() without gather, or "
                    "leave the block out of sequence_parallel=[...]"
                )
            if isinstance(m, _SPLIT_LAYERS):
                m.sequence_dim = dim
                rows += isinstance(m, _ROWS)
            for p in m.parameters(recurse=False):
                if p.requires_grad and id(p) not in sharded:
                    p.__dict__["annot_grad_sum"] = "tp"  # this rank's tokens or heads only
        for path, region in _regions(modules[block], block):
            gather = _Gather(path, dim)
            region.register_forward_pre_hook(gather, with_kwargs=True)
            for sub_path, m in region.named_modules(prefix=path):
                if isinstance(m, _COLUMNS):
                    m.sequence_gathered = True
                elif not isinstance(m, _SPLIT_LAYERS) and any(
                    p.requires_grad for p in m.parameters(recurse=False)
                ):
                    m.register_forward_pre_hook(_NotFromGather(gather, sub_path), with_kwargs=True)
    if not rows:
        raise HintError(
            f"sequence_parallel: the blocks {list(blocks)[:3]}... hold no row-parallel "
            "layer, so nothing returns their activations to sequence shards; hint the "
            "blocks' projections Col()/Row() first"
        )
    modules[blocks[0]].register_forward_pre_hook(_Enter(blocks[0], dim, tp), with_kwargs=True)
    modules[blocks[-1]].register_forward_hook(_Leave(dim))


def stage_runs(layout, root: nn.Module, blocks: Sequence[str]) -> list[list[str]]:
    """The blocks each of this rank's pipeline stages runs (``layout``: an
    :class:`~annot.runtime.pipeline.layout.PipelineLayout`), in order. Each run enters
    sequence shards at its first block and leaves them after its last, so the
    stages hand whole activations on, as without sequence parallelism. A
    block is a stage's when the stage holds weights of it."""
    weighted = {p for p, m in root.named_modules() if next(m.parameters(), None) is not None}
    runs: list[list[str]] = []
    seen: dict[str, int] = {}
    for s in layout.local_stage_ids:
        held = layout.stage_modules.get(s, set()) & weighted
        run = [b for b in blocks if any(p == b or p.startswith(f"{b}.") for p in held)]
        for b in run:
            if seen.setdefault(b, s) != s:
                raise HintError(
                    f"sequence_parallel: the block {b!r} runs in pipeline stages {seen[b]} and "
                    f"{s}; annot runs a block on sequence shards in one stage only. Leave it "
                    "out of sequence_parallel=[...]"
                )
        if run:
            runs.append(run)
    return runs


def _regions(block: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """The smallest modules under ``block`` (not ``block`` itself) that hold
    both column- and row-parallel layers."""

    def kinds(m: nn.Module) -> set[str]:
        found = set()
        for sub in m.modules():
            found |= {"col"} if isinstance(sub, _COLUMNS) else set()
            found |= {"row"} if isinstance(sub, _ROWS) else set()
        return found

    out = []

    def visit(m: nn.Module, path: str) -> None:
        for name, child in m.named_children():
            child_path = f"{path}.{name}"
            if kinds(child) != {"col", "row"}:
                continue
            if any(kinds(c) == {"col", "row"} for c in child.children()):
                visit(child, child_path)
            else:
                out.append((child_path, child))

    visit(block, prefix)
    return out


def _first_input(args: tuple, kwargs: dict, where: str):
    """``(tensor, rebuild)``: the first positional tensor argument (else
    ``hidden_states=``) of a call to ``where``, and how to call with a
    replacement for it."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], lambda t: ((t, *args[1:]), kwargs)
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"], lambda t: (args, {**kwargs, "hidden_states": t})
    raise HintError(
        f"sequence_parallel: {where} was called without a tensor as its first argument or "
        "hidden_states=, so annot cannot tell which input runs on sequence shards; build "
        "with sequence_parallel=False"
    )


class _Enter:
    """Forward pre-hook of the first block: its first argument to this rank's
    sequence shard."""

    def __init__(self, block: str, dim: int, tp: int) -> None:
        self.block, self.dim, self.tp = block, dim, tp

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        x, rebuild = _first_input(args, kwargs, self.block)
        check_sequence_split(x, self.dim, self.tp, f"the input of {self.block}")
        return rebuild(scatter_to_tp(x, self.dim))


class _Gather:
    """Forward pre-hook of a tp region: its first argument whole (all-gather;
    backward, reduce-scatter of the column layers' partial gradients)."""

    def __init__(self, region: str, dim: int) -> None:
        self.region, self.dim = region, dim
        self.last: Optional[weakref.ref[torch.Tensor]] = None  # the current call's gathered tensor

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        x, rebuild = _first_input(args, kwargs, self.region)
        whole = gather_sequence(x, self.dim)
        self.last = weakref.ref(whole)
        return rebuild(whole)


class _NotFromGather:
    """Forward pre-hook of a replicated module with weights inside a tp region:
    refuse when it reads the region's gathered input itself (its gradient is
    whole on every rank, and the gather's reduce-scatter would add it tp
    times)."""

    def __init__(self, gather: _Gather, path: str) -> None:
        self.gather, self.path = gather, path

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        whole = self.gather.last() if self.gather.last is not None else None
        if whole is None:
            return
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and (t is whole or t._base is whole):
                raise HintError(
                    f"sequence_parallel: {self.path} ({type(module).__name__}) reads the "
                    f"whole sequence that {self.gather.region} gathers, with replicated "
                    "weights, so its gradient would be summed over the tp ranks; shard it "
                    "(Col()), or leave its block out of sequence_parallel=[...]"
                )


class _Leave:
    """Forward hook of the last block: its output (or its output's first
    element) whole again."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def __call__(self, module: nn.Module, args: tuple, out):
        if isinstance(out, torch.Tensor):
            return gather_from_tp(out, self.dim)
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            return type(out)([gather_from_tp(out[0], self.dim), *out[1:]])
        raise HintError(
            f"sequence_parallel: {type(module).__name__} returned {type(out).__name__}, "
            "not a tensor or a tuple starting with one, so annot cannot make the "
            "sequence whole after the last block; build with sequence_parallel=False"
        )
