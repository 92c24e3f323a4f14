"""A stage's backward in two halves, for zero-bubble schedules (``I`` then
``W`` in :mod:`annot.runtime.pipeline.schedules`).

:func:`backward_input` computes the gradients of the stage's inputs (what
the stage before waits for) and keeps, at each node where the input path
meets a path to a weight, the gradient that arrived there;
:func:`backward_weight` later runs only the rest: from those nodes down to
the weights. Together they give the weights exactly the gradients one
``torch.autograd.backward`` gives. This is torch.distributed.pipelining's
method (``stage_backward_input`` / ``stage_backward_weight``), on its graph
helpers, with two differences. A weight with a path to an output that does
not pass through the inputs' part of the graph (a parameter that makes an
output on its own) would lose that part of its gradient (torch's grouping
does not check for it): here the whole backward runs at ``I`` instead and
``W`` has nothing to do; so it does where ``W`` would start at a node this
torch cannot take a gradient at (see :func:`takes_edge_grads`). And a node the input pass never reached is skipped,
not an error. A stage whose inputs need no gradient (the first) has nothing
to send at ``I``: its whole backward runs at ``W``, in the time ZB-H1 gives
the first rank's weight gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining._backward import construct_reverse_graph, reverse_closure

__all__ = [
    "WeightWork",
    "backward_input",
    "backward_weight",
    "release",
    "takes_edge_grads",
    "weight_groups",
]


@dataclass
class WeightWork:
    """What :func:`backward_weight` needs: per group of weights, the nodes
    where their gradients branch off the input path, and what arrived there."""

    weights: dict[Node, torch.nn.Parameter]  # AccumulateGrad node -> parameter
    groups: list[dict[str, Any]]  # params (nodes), intermediates (nodes), grads
    # a stage whose inputs need no gradient (the first): its whole backward
    whole: Optional[tuple[list[torch.Tensor], Optional[Sequence[torch.Tensor]]]] = None

    @property
    def retains_graph(self) -> bool:
        """The input pass kept the graph: drop references to the outputs."""
        return self.whole is None


def grad_node(t: torch.Tensor) -> Optional[Node]:
    """The autograd node a gradient of ``t`` flows into: its grad_fn, or for
    a leaf that requires grad, its AccumulateGrad node."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        view = t.view_as(t).grad_fn
        assert view is not None, "a view of a tensor that requires grad has a grad_fn"
        return view.next_functions[0][0]
    return None


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Optional[Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.nn.Parameter],
) -> tuple[list[Optional[torch.Tensor]], Optional[WeightWork]]:
    """The gradients of ``inputs`` (None where one gets none) from
    ``outputs`` and their ``grads`` (None for a scalar loss), and the
    :class:`WeightWork` left for the weights; None when the whole backward
    ran here (see the module's docstring). Only ``W`` accumulates into the
    weights' ``.grad``, except when it ran whole here."""
    roots = [n for n in map(grad_node, outputs) if n is not None]
    input_nodes = [n for n in map(grad_node, inputs) if n is not None]
    if not roots:
        return [None] * len(inputs), None
    if not any(t.requires_grad for t in inputs):  # nothing to send: all of it waits for W
        return [None] * len(inputs), WeightWork({}, [], whole=(list(outputs), grads))
    reverse = construct_reverse_graph(roots)
    nodes = {grad_node(p): p for p in weights if p.requires_grad}
    reached = [n for n in nodes if n in reverse]
    groups = weight_groups(roots, input_nodes, reached, reverse)
    if groups is None or not all(takes_edge_grads(n) for g in groups for n in g["intermediates"]):
        torch.autograd.backward(list(outputs), grads)
        return [t.grad for t in inputs], None
    handles = []
    try:
        for group in groups:
            group["intermediates"] = list(group["intermediates"])
            group["grads"] = {}
            for k, node in enumerate(group["intermediates"]):

                def keep(grad_outputs, saved=group["grads"], k=k):
                    saved[k] = grad_outputs

                handles.append(node.register_prehook(keep))
        wanted = [t for t in inputs if t.requires_grad]
        got = iter(
            torch.autograd.grad(list(outputs), wanted, grads, retain_graph=True, allow_unused=True)
        )
        in_grads = [next(got) if t.requires_grad else None for t in inputs]
    finally:
        for h in handles:
            h.remove()
    for t in outputs:  # free the part of the graph only the input pass needed
        release(t)
    return in_grads, WeightWork({n: nodes[n] for n in reached}, groups)


def takes_edge_grads(node: Node) -> bool:
    """Whether ``torch.autograd.grad`` takes a gradient at ``node`` (a
    :class:`GradientEdge` output with a grad): torch reads the node's input
    metadata, which torch 2.11 refuses on the node of a custom
    ``autograd.Function`` (activation checkpointing's, annot's collectives')
    with a RuntimeError; torch 2.13 gives it."""
    try:
        node._input_metadata  # noqa: B018 (what torch's _make_grads reads)
    except (AttributeError, RuntimeError):
        return False
    return True


def weight_groups(
    roots: list[Node], input_nodes: list[Node], weights: list[Node], reverse: dict
) -> Optional[list[dict[str, Any]]]:
    """Group the weights by the nodes where their gradients leave the input
    path ("intermediates"; weights sharing one are one group). None when a
    weight has a path to an output that avoids the input path: W alone
    could not give it that part of its gradient."""
    if not input_nodes:
        return None
    on_input_path, _ = reverse_closure(input_nodes, set(), reverse)
    outputs = set(roots)
    by_node: dict[Node, dict[str, Any]] = {}
    for w in weights:
        off_path, meets = reverse_closure([w], on_input_path, reverse)
        if off_path & outputs or not meets:
            return None
        group = {"params": {w}, "intermediates": set(meets)}
        for node in meets:  # merge with every group sharing a node
            other = by_node.get(node)
            if other is not None and other is not group:
                group["params"] |= other["params"]
                group["intermediates"] |= other["intermediates"]
        for node in group["intermediates"]:
            by_node[node] = group
    unique = {id(g): g for g in by_node.values()}
    return list(unique.values())


def backward_weight(work: Optional[WeightWork]) -> list[torch.nn.Parameter]:
    """Accumulate the weights' gradients left by :func:`backward_input` into
    their ``.grad``; returns the parameters whose ``.grad`` it wrote itself
    (not through autograd's accumulation, whose hooks do not fire for them)."""
    if work is None:
        return []
    if work.whole is not None:
        outputs, out_grads = work.whole
        torch.autograd.backward(outputs, out_grads)  # accumulates (and hooks) as usual
        return []
    done = []
    for group in work.groups:
        saved = group.pop("grads")
        nodes = group.pop("intermediates")
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        handles = []
        try:
            for k, node in enumerate(nodes):
                if k not in saved:
                    continue  # no gradient reached it: none flows on from it either
                for slot, g in enumerate(saved[k]):
                    if g is not None:
                        edges.append(GradientEdge(node, slot))
                        grads.append(g)
                if len(nodes) > 1:  # a path through an earlier node must not add to it again
                    handles.append(node.register_prehook(lambda _, g=saved[k]: g))
            if not edges:
                continue
            params = list(group["params"])
            dws = torch.autograd.grad(
                edges, [GradientEdge(n, 0) for n in params], grads, allow_unused=True
            )
        finally:
            for h in handles:
                h.remove()
        for node, dw in zip(params, dws):
            if dw is None:
                continue
            p = work.weights[node]
            if p.grad is None:
                p.grad = dw
            else:
                p.grad.add_(dw)
            done.append(p)
    return done


def release(t: torch.Tensor) -> None:
    """Cut ``t`` from its graph in place, so that holding ``t`` no longer
    keeps the graph (retained by the input pass) alive."""
    with contextlib.suppress(RuntimeError):  # a view: its graph goes with its last reference
        t.detach_()
