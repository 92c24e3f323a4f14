"""The values the flow reader (:mod:`annot.rewriters.analysis.head_flow`)
computes with, and what it is told and tells: a value's state (replicated, a
column output, split into heads, merged back) and the Linears it carries; the
module's children by kind (:class:`Children`); what one forward shows
(:class:`Flow`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

__all__ = [
    "CLEAN",
    "COLUMNS",
    "ELEMENTWISE",
    "ELEMENTWISE_METHODS",
    "HEADS",
    "MERGED",
    "METADATA",
    "RESHAPES",
    "SPLITS",
    "Children",
    "Flow",
    "Split",
    "Val",
    "Value",
    "flat",
]

CLEAN, COLUMNS, HEADS, MERGED = 0, 1, 2, 3  # what a value holds: see Val

#: functions (by their last name: ``F.gelu``, ``torch.tanh``) that act on each
#: element alone: a column-parallel output stays column-parallel through them
ELEMENTWISE = frozenset(
    {
        "gelu", "silu", "relu", "relu6", "tanh", "sigmoid", "dropout", "leaky_relu", "mish",
        "softplus", "elu", "selu", "celu", "hardswish", "hardsigmoid", "hardtanh", "exp", "erf",
        "square", "abs", "neg", "gelu_new", "quick_gelu",
    }
)  # fmt: skip
#: methods that act on each element (``x.float()``, ``x.sigmoid()``), or move
#: no element across the last dim
ELEMENTWISE_METHODS = ELEMENTWISE | {
    "float", "half", "bfloat16", "to", "type_as", "contiguous", "clone", "mul", "add", "sub",
    "div", "pow", "clamp",
}  # fmt: skip
RESHAPES = frozenset({"view", "reshape"})
METADATA = frozenset({"shape", "dtype", "device", "size", "dim", "ndim", "numel", "is_cuda"})
SPLITS = frozenset({"split", "chunk", "tensor_split"})


@dataclass(frozen=True)
class Children:
    """What the module's attributes are, by path from ``self`` (``"ff.up"`` for
    ``self.ff["up"]``): Linear layers, weightless element-wise modules
    (activations, dropout), modules with weights, its own raw parameters, and
    the ``nn.Sequential`` among them whose first step is a Linear (a gated
    output projection: row-parallel at its first step)."""

    linears: frozenset = frozenset()
    elementwise: frozenset = frozenset()
    weighted: frozenset = frozenset()
    params: frozenset = frozenset()
    sequences: frozenset = frozenset()
    # children whose forward returns a sharded first output (BERT's self-attention,
    # its output projection in another module): (path, ((column, chunks), ...),
    # state, the Local names those columns size)
    outputs: tuple = ()
    # children whose first argument reaches one Linear as its input, and nothing
    # else sharded (BERT's BertSelfOutput.dense): (path, the Linear's path)
    row_inputs: tuple = ()


@dataclass
class Flow:
    """What :func:`read_flow` found: ``specs`` by attribute path, the names
    ``Local`` divides, and why a Linear was left whole (``notes``)."""

    specs: dict = field(default_factory=dict)
    local: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    # the columns whose sharded output forward returns first: split only where the
    # caller hands it to a row-parallel Linear (its Children.outputs), with
    # ``chunks``, the value's state and the Local names they size
    exports: tuple = ()
    export_state: int = 0
    export_local: tuple[str, ...] = ()
    # the Linear forward's first argument reaches, read with that argument sharded
    row_input: Optional[str] = None
    # Local names of children whose exported columns this forward confirmed
    child_local: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Val:
    """An abstract value: ``state`` (CLEAN: replicated; COLUMNS: a column
    output, last dim sharded; HEADS: split into heads; MERGED: heads merged
    back) and ``src``, the Linears whose sharded outputs it carries."""

    state: int = CLEAN
    src: frozenset = frozenset()
    param: bool = False  # a raw parameter of the module

    def join(self, other: Val) -> Val:
        return Val(max(self.state, other.state), self.src | other.src, self.param or other.param)


Value = Union[Val, tuple, "Split"]  # a tuple value: a tuple of Val (or nested tuples)


def flat(v) -> Val:
    if isinstance(v, Split):
        return v.val
    if isinstance(v, tuple):
        out = Val()
        for x in v:
            out = out.join(flat(x))
        return out
    return v


@dataclass(frozen=True)
class Split:
    """A column output split into a number of equal parts the assignment
    tells (``q, k, v = qkv.split(size)``: three)."""

    val: Val
