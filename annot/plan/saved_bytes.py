"""The bytes a forward keeps for backward, counted by storage identity.

:class:`SavedBytes` is a ``saved_tensors_hooks`` pair that charges each
storage autograd saves once, to whichever key is current when it is first
saved, leaving out the storages of the parameters given. A storage is told
apart by its identity (torch keeps one Python object per storage, shared by
every view of it), never by ``data_ptr()``: on the meta device every
``data_ptr()`` is 0, so counting by address would collapse a whole model's
activations into one tensor. Counting by identity gives the same figure on
meta as on real tensors, so activation memory comes from shapes alone.

With ``split`` (the modules tensor parallelism splits, as ``"col"`` or
``"row"``), each saved storage is also told as *split* (it would hold
``1/tp`` of its elements at tp: what a column layer outputs, what is
computed from it, up to and including a row layer's input) or *whole* (the
rest: block inputs, norms, a row layer's reduced output). A dispatch mode
carries the mark from each op's inputs to its outputs.

    counter = SavedBytes(model.parameters())
    with counter.counting():
        loss = model(x).sum()
    counter.total()          # bytes kept for loss.backward()
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Hashable, Iterable, Iterator
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BackwardPeak", "SavedBytes", "real_paths_on_meta"]


def _storage(t: torch.Tensor) -> Optional[torch.UntypedStorage]:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None


class _RealPaths(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and args[0].is_meta:
            return _fused_attention(*args, **kwargs)
        if func is torch.arange and torch.device(kwargs.get("device") or "cpu").type == "meta":
            return func(*args, **{**kwargs, "device": "cpu"})  # positions: real values
        return func(*args, **kwargs)


def _fused_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return op(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def real_paths_on_meta() -> TorchFunctionMode:
    """A mode in which a model on the meta device takes the path a real run
    takes, so that what it saves for backward is what a real run saves:

    * ``scaled_dot_product_attention`` on meta tensors runs the fused (flash)
      kernel a real CPU or GPU picks, not meta's default math path (the fused
      kernel keeps its inputs, output and a log-sum-exp per row for backward,
      the math path the whole heads x seq x seq probabilities);
    * ``torch.arange`` asked for on meta (positions) is made on the CPU, so
      the decisions a model takes on positions (transformers: whether the
      causal mask can be left to the kernel, which also decides whether
      grouped key/value heads are repeated) see their real values."""
    return _RealPaths()


class _Marks(TorchDispatchMode):
    """Carries the *split* mark of :class:`SavedBytes` from each op's
    inputs to its outputs (by storage identity)."""

    def __init__(self, marked: dict[int, Any]):
        super().__init__()
        self.marked = marked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(isinstance(a, torch.Tensor) and self.is_marked(a) for a in flat):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.mark(t)
        return out

    def is_marked(self, t: torch.Tensor) -> bool:
        s = _storage(t)
        return s is not None and id(s) in self.marked

    def mark(self, t: torch.Tensor) -> None:
        s = _storage(t)
        if s is not None:
            self.marked[id(s)] = s  # held: an id is not reused while counting

    def unmark(self, t: torch.Tensor) -> None:
        s = _storage(t)
        if s is not None:
            self.marked.pop(id(s), None)


class SavedBytes:
    """Bytes saved for backward, per key (see the module docstring).

    ``exclude``: tensors whose storages are never charged (the parameters).
    ``split``: module -> ``"col"`` or ``"row"`` (the layers tp splits): then
    :meth:`split_bytes` tells what share of each key's bytes tp divides.
    ``float_size``: bytes per element to charge floating tensors at (2: as
    if the forward ran in bf16), default their own."""

    def __init__(
        self,
        exclude: Iterable[torch.Tensor] = (),
        split: Optional[dict[nn.Module, str]] = None,
        float_size: Optional[int] = None,
    ):
        self.float_size = float_size
        self.excluded = {id(s): s for t in exclude if (s := _storage(t)) is not None}
        self.key: Hashable = None
        self.bytes: dict[Hashable, int] = {}
        self.split: dict[Hashable, int] = {}
        self.seen: dict[int, torch.UntypedStorage] = {}
        self.layers = split or {}
        self.marks: Optional[_Marks] = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = _storage(t)
        if s is None or id(s) in self.excluded or id(s) in self.seen:
            return t
        self.seen[id(s)] = s  # held until counting ends: its id stays its own
        n = s.nbytes()
        if self.float_size is not None and t.is_floating_point():
            n = n // t.element_size() * self.float_size
        self.bytes[self.key] = self.bytes.get(self.key, 0) + n
        if self.marks is not None and id(s) in self.marks.marked:
            self.split[self.key] = self.split.get(self.key, 0) + n
        return t

    def total(self) -> int:
        return sum(self.bytes.values())

    def of(self, key: Hashable) -> int:
        return self.bytes.get(key, 0)

    def split_bytes(self, key: Hashable) -> int:
        """Of :meth:`of`, the bytes tp would split (0 without ``split``)."""
        return self.split.get(key, 0)

    @contextlib.contextmanager
    def counting(self) -> Iterator[SavedBytes]:
        """Count what autograd saves inside; ``self.key`` says where to charge."""
        handles = []
        with contextlib.ExitStack() as stack:
            if self.layers:
                self.marks = stack.enter_context(_Marks({}))
                for m, kind in self.layers.items():
                    hook = functools.partial(_layer_output, self.marks, kind)
                    handles.append(m.register_forward_hook(hook))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack))
            try:
                yield self
            finally:
                for h in handles:
                    h.remove()
        self.seen.clear()
        if self.marks is not None:
            self.marks.marked.clear()


class BackwardPeak(TorchDispatchMode):
    """The most bytes backward holds at once in the tensors it makes
    (gradients on their way, a kernel's outputs), per key: set ``key`` to
    where backward is. Each new storage an op makes (not one of its inputs')
    counts from the op until it is freed, by identity, on meta as on real
    tensors. Give the parameters their ``.grad`` before backward, so that
    gradients accumulate in place as in a training step after the first.
    ``float_size``: as for :class:`SavedBytes`."""

    def __init__(self, float_size: Optional[int] = None):
        super().__init__()
        self.float_size = float_size
        self.key: Hashable = None
        self.live = 0
        self.peak: dict[Hashable, int] = {}
        self.tracked: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        inputs = {id(s) for a in leaves if isinstance(a, torch.Tensor) and (s := _storage(a))}
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            s = _storage(t)
            if s is None or id(s) in inputs or id(s) in self.tracked:
                continue
            n = s.nbytes()
            if self.float_size is not None and t.is_floating_point():
                n = n // t.element_size() * self.float_size
            self.tracked.add(id(s))
            self.live += n
            weakref.finalize(s, self._freed, id(s), n)
        self.peak[self.key] = max(self.peak.get(self.key, 0), self.live)
        return out

    def _freed(self, key: int, n: int) -> None:
        self.live -= n
        self.tracked.discard(key)

    def of(self, key: Hashable) -> int:
        return self.peak.get(key, 0)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _layer_output(marks: _Marks, kind: str, module, args, out) -> None:
    """A column layer's output is split over tp; a row layer's, reduced, is whole."""
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            (marks.mark if kind == "col" else marks.unmark)(t)
