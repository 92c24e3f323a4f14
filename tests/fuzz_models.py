"""Models drawn by the structure fuzzer (tests/test_fuzz_structures.py).

One set of classes, shaped by a :class:`Recipe` (plain data, the same on
every rank): the parts real libraries are made of, each switched on or off.

- containers at several depths: blocks in an ``nn.ModuleList``, an
  ``nn.Sequential`` called whole, an ``nn.ModuleDict``, or a ModuleList of
  Sequential pairs;
- attention (q, k, v column-parallel, out row-parallel) whose head count is
  read from the module (``self.n_head``) or from a config object the blocks
  share (``self.config.n_head``), split into heads with the head size named
  or as ``-1`` (``view(B, T, n_head, -1)``: a head count left global still
  fits the shard there, so only the pre-flight's reshape check refuses it),
  and an MLP;
- in-place ops on layer outputs (``y += x`` on a row-parallel output);
- raw parameters read in the root's forward, across stages: a positional
  table added, a class token concatenated, a projection used with ``@``, a
  learned temperature ``exp``'d after the blocks;
- two towers; skip connections across blocks (U-Net); a block called twice;
  a branch on data; the embedding tied to the head; blocks built inline or
  through a module-level factory function.

The fuzzer knows, from the recipe, the right hints (:func:`hints`) and where
a stage may begin (:func:`boundaries`): its oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Recipe", "FuzzNet", "hints", "boundaries", "batch"]


@dataclass(frozen=True)
class Recipe:
    blocks: int = 2  # per tower
    heads: int = 4
    head_dim: int = 4
    container: str = "list"  # list | seq | dict | nested
    kinds: str = "am"  # per block, cycled: a(ttention) m(lp)
    heads_on_config: bool = False
    inplace: bool = False
    pos_param: bool = False
    cls_token: bool = False
    proj_param: bool = False
    scale_param: bool = False
    two_towers: bool = False
    skip: bool = False
    twice: bool = False
    branch: bool = False
    tied: bool = False
    factory: bool = False  # blocks built through a module-level function
    reshape_minus_one: bool = False  # heads split / merged with -1 for the head size
    hooks: bool = False  # hooks registered in __init__ (a library's): tp layers' and the root's
    instance: bool = False  # annot is handed an instance (as from_pretrained gives), not the class
    lora: bool = False  # LoRA adapters (PEFT) on its linears, handed over wrapped (with_lora)
    vocab: int = 32
    seq: int = 8

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    @property
    def per_block_control(self) -> bool:
        """Whether the tower loops over its blocks itself (skip, twice, branch)."""
        return self.container in ("list", "dict")


class SharedConfig:
    """A config object every block holds (HF style): its head count is read
    in forward as ``self.config.n_head``."""

    def __init__(self, n_head: int, n_embd: int):
        self.n_head = n_head
        self.n_embd = n_embd


class Attention(nn.Module):
    def __init__(self, r: Recipe, config: SharedConfig):
        super().__init__()
        self.config = config
        self.n_head = r.heads
        self.head_dim = r.head_dim
        self.on_config = r.heads_on_config
        self.inplace = r.inplace
        self.minus_one = r.reshape_minus_one
        self.q = nn.Linear(r.width, r.width)
        self.k = nn.Linear(r.width, r.width)
        self.v = nn.Linear(r.width, r.width)
        self.out = nn.Linear(r.width, r.width)

    def forward(self, x):
        B, T, _ = x.shape
        n_head = self.config.n_head if self.on_config else self.n_head
        hd = -1 if self.minus_one else self.head_dim
        q = self.q(x).view(B, T, n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k(x).view(B, T, n_head, hd).transpose(1, 2)
        v = self.v(x).view(B, T, n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, nh, T, T)
        y = att.softmax(-1) @ v  # (B, nh, T, hd)
        merged = -1 if self.minus_one else n_head * self.head_dim
        y = self.out(y.transpose(1, 2).reshape(B, T, merged))  # (B, T, C)
        if self.inplace:
            y += x  # in place on the row-parallel layer's output
            return y
        return y + x


class MLP(nn.Module):
    def __init__(self, r: Recipe):
        super().__init__()
        self.inplace = r.inplace
        self.up = nn.Linear(r.width, 2 * r.width)
        self.down = nn.Linear(2 * r.width, r.width, bias=False)

    def forward(self, x):
        y = self.down(F.gelu(self.up(x)))
        if self.inplace:
            return y.add_(x)
        return y + x


def _block(r: Recipe, i: int, config: SharedConfig) -> nn.Module:
    return Attention(r, config) if r.kinds[i % len(r.kinds)] == "a" else MLP(r)


class Tower(nn.Module):
    def __init__(self, r: Recipe, config: SharedConfig):
        super().__init__()
        self.r = r
        if r.factory:
            made = [_block(r, i, config) for i in range(r.blocks)]
        else:
            kinds = [r.kinds[i % len(r.kinds)] for i in range(r.blocks)]
            made = [Attention(r, config) if k == "a" else MLP(r) for k in kinds]
        if r.container == "list":
            self.blocks = nn.ModuleList(made)
        elif r.container == "seq":
            self.blocks = nn.Sequential(*made)
        elif r.container == "dict":
            self.blocks = nn.ModuleDict({f"b{i}": b for i, b in enumerate(made)})
        else:  # nested: a ModuleList of Sequential pairs
            pairs = [nn.Sequential(*made[i : i + 2]) for i in range(0, len(made), 2)]
            self.blocks = nn.ModuleList(pairs)
        self.norm = nn.LayerNorm(r.width)

    def forward(self, x):
        r = self.r
        if not r.per_block_control:
            if r.container == "seq":
                return self.norm(self.blocks(x))
            for pair in self.blocks:
                x = pair(x)
            return self.norm(x)
        blocks = self.blocks.values() if r.container == "dict" else self.blocks
        saved = []
        half = r.blocks // 2
        for i, block in enumerate(blocks):
            if r.skip and i >= r.blocks - half:
                x = x + saved.pop()  # U-Net: the mirror block's output
            x = block(x)
            if r.twice and i == 0:
                x = block(x)  # the same module, called again
            if r.skip and i < half:
                saved.append(x)
            if r.branch and i == 0 and x.mean() > 0:  # a branch on data
                x = x * 0.5
        return self.norm(x)


def _mix(module, args, out):  # reads every output feature: wrong on a tp shard
    return out + 0.5 * out.softmax(-1)


def _scale_loss(module, args, out):
    logits, loss = out
    return logits, loss * 1.5


def add_hooks(model: nn.Module) -> None:
    """Forward hooks a library would register: on each attention's ``q`` and
    each MLP's ``up`` (tp-split layers under the hints), and on the root."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.q.register_forward_hook(_mix)
        elif isinstance(m, MLP):
            m.up.register_forward_hook(_mix)
    model.register_forward_hook(_scale_loss)


class FuzzNet(nn.Module):
    def __init__(self, r: Recipe):
        super().__init__()
        self.r = r
        config = SharedConfig(r.heads, r.width)
        self.emb = nn.Embedding(r.vocab, r.width)
        if r.pos_param:
            self.pos = nn.Parameter(torch.randn(r.seq, r.width) * 0.1)
        if r.cls_token:
            self.cls = nn.Parameter(torch.randn(1, 1, r.width) * 0.1)
        self.tower = Tower(r, config)
        if r.two_towers:
            self.text_emb = nn.Embedding(r.vocab, r.width)
            self.text = Tower(r, config)
        if r.proj_param:
            self.proj = nn.Parameter(torch.randn(r.width, r.width) / math.sqrt(r.width))
        if r.scale_param:
            self.scale = nn.Parameter(torch.tensor(0.3))
        self.head = nn.Linear(r.width, r.vocab, bias=False)
        if r.tied:
            self.head.weight = self.emb.weight
        if r.hooks:
            add_hooks(self)

    def forward(self, ids, targets):
        r = self.r
        B, T = ids.shape
        x = self.emb(ids)
        if r.pos_param:
            x = x + self.pos[:T]
        if r.cls_token:
            x = torch.cat([self.cls.expand(B, -1, -1), x], dim=1)
        x = self.tower(x)
        if r.two_towers:
            t = self.text_emb(ids)
            if r.cls_token:
                t = torch.cat([self.cls.expand(B, -1, -1), t], dim=1)
            x = x + self.text(t)
        if r.proj_param:
            x = x @ self.proj
        if r.scale_param:
            x = x * self.scale.exp()
        logits = self.head(x)
        if r.cls_token:
            logits = logits[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, r.vocab), targets.reshape(-1))
        return logits, loss


def hints(r: Recipe, wrong: str = "") -> dict:
    """The right tp hints for ``r`` (path patterns); ``wrong`` draws a wrong
    one on purpose: ``"swap"`` (the MLP's Col / Row swapped), ``"global"``
    (the head count left global: a crash in the pre-flight, or with
    ``reshape_minus_one`` a reshape that fits and mixes heads, refused by
    the pre-flight's reshape check). The head size is never named in
    ``Local``: with the head count local, ``-1`` and ``self.head_dim`` agree."""
    from annot import Col, Local, Row

    out = {}
    if "a" in r.kinds[: r.blocks]:
        out.update({"**.q": Col(), "**.k": Col(), "**.v": Col(), "**.out": Row()})
    if "m" in r.kinds[: r.blocks]:
        swap = wrong == "swap"
        out.update({"**.up": Row() if swap else Col(), "**.down": Col() if swap else Row()})
    if wrong != "global":
        name = "config.n_head" if r.heads_on_config else "n_head"
        for tower in ("tower", "text") if r.two_towers else ("tower",):
            for i, path in enumerate(_block_paths(r, tower)):
                if r.kinds[i % len(r.kinds)] == "a":
                    out[path] = Local(name)
    return out


def _block_paths(r: Recipe, tower: str) -> list[str]:
    if r.container == "dict":
        return [f"{tower}.blocks.b{i}" for i in range(r.blocks)]
    if r.container == "nested":
        return [f"{tower}.blocks.{i // 2}.{i % 2}" for i in range(r.blocks)]
    return [f"{tower}.blocks.{i}" for i in range(r.blocks)]


def boundaries(r: Recipe) -> list[str]:
    """Module paths where a second stage may begin, in call order: the blocks
    after the first (the first may be called twice), the second tower; then
    containers: the block container (a module list or dict is never called:
    its stage begins at its first call inside), a nested pair."""
    out = _block_paths(r, "tower")[1:]
    if r.two_towers:
        out += ["text"] + _block_paths(r, "text")[1:]
    if not r.twice:
        out.append("tower.blocks")
    if r.container == "nested" and r.blocks > 2:
        out.append("tower.blocks.1")
    return out


LORA_PREFIX = "base_model.model."  # where a PEFT model holds the model it wraps


def with_lora(model: nn.Module) -> nn.Module:
    """``model`` wrapped by PEFT with LoRA adapters on its attention and MLP
    linears (``lora_B`` drawn, not zero, so every adapter's gradient shows);
    only the adapters train."""
    from peft import LoraConfig, get_peft_model

    names = {path.rpartition(".")[2] for path, _ in model.named_modules()}
    targets = [t for t in ("q", "v", "out", "up", "down") if t in names]
    g = torch.Generator().manual_seed(1)
    wrapped = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=targets))
    for path, p in wrapped.named_parameters():
        if "lora_" in path:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return wrapped


def lora_paths(paths: dict | list) -> dict | list:
    """Hints or boundaries of the model, for it wrapped by :func:`with_lora`."""

    def at(k: str) -> str:
        return k if k.startswith("**") else LORA_PREFIX + k

    if isinstance(paths, dict):
        return {at(k): v for k, v in paths.items()}
    return [at(k) for k in paths]


def batch(r: Recipe, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, r.vocab, (n, r.seq), generator=g)
    return ids, torch.randint(0, r.vocab, (n, r.seq), generator=g)


def source_of(r: Recipe) -> str:
    """A module with ``FuzzNet`` for ``r`` written out: the same parameters,
    built in the same order (so ``parallelize(..., seed=0)`` equals
    ``FuzzNet(r)`` under ``torch.manual_seed(0)``), with forwards that hold
    only the parts ``r`` switches on and no ``if`` on the recipe: code the
    stage-split rewriter can cut (``runner="source"``), as a person would
    have written this model."""
    made = "[fm.Attention(r, config) if k == 'a' else fm.MLP(r) for k in kinds]"
    container = {
        "list": "nn.ModuleList(made)",
        "seq": "nn.Sequential(*made)",
        "dict": 'nn.ModuleDict({f"b{i}": b for i, b in enumerate(made)})',
        "nested": "nn.ModuleList(nn.Sequential(*made[i : i + 2]) for i in range(0, len(made), 2))",
    }[r.container]
    tower = [
        "    def __init__(self, r, config):",
        "        super().__init__()",
        "        self.r = r",
        "        kinds = [r.kinds[i % len(r.kinds)] for i in range(r.blocks)]",
        f"        made = {made}",
        f"        self.blocks = {container}",
        "        self.norm = nn.LayerNorm(r.width)",
        "",
        "    def forward(self, x):",
    ]
    if not r.per_block_control:
        if r.container == "seq":
            tower.append("        return self.norm(self.blocks(x))")
        else:
            tower += ["        for pair in self.blocks:", "            x = pair(x)"]
            tower.append("        return self.norm(x)")
    else:
        blocks = "self.blocks.values()" if r.container == "dict" else "self.blocks"
        half = r.blocks // 2
        if r.skip:
            tower.append("        saved = []")
        tower.append(f"        for i, block in enumerate({blocks}):")
        if r.skip:
            tower += [
                f"            if i >= {r.blocks - half}:",
                "                x = x + saved.pop()",
            ]
        tower.append("            x = block(x)")
        if r.twice:
            tower += ["            if i == 0:", "                x = block(x)"]
        if r.skip:
            tower += [f"            if i < {half}:", "                saved.append(x)"]
        if r.branch:
            tower += ["            if i == 0 and x.mean() > 0:", "                x = x * 0.5"]
        tower.append("        return self.norm(x)")

    init = [
        "    def __init__(self, r):",
        "        super().__init__()",
        "        self.r = r",
        "        config = fm.SharedConfig(r.heads, r.width)",
        "        self.emb = nn.Embedding(r.vocab, r.width)",
    ]
    fwd = [
        "    def forward(self, ids, targets):",
        "        B, T = ids.shape",
        "        x = self.emb(ids)",
    ]
    if r.pos_param:
        init.append("        self.pos = nn.Parameter(torch.randn(r.seq, r.width) * 0.1)")
        fwd.append("        x = x + self.pos[:T]")
    if r.cls_token:
        init.append("        self.cls = nn.Parameter(torch.randn(1, 1, r.width) * 0.1)")
        fwd.append("        x = torch.cat([self.cls.expand(B, -1, -1), x], dim=1)")
    init.append("        self.tower = Tower(r, config)")
    fwd.append("        x = self.tower(x)")
    if r.two_towers:
        init += [
            "        self.text_emb = nn.Embedding(r.vocab, r.width)",
            "        self.text = Tower(r, config)",
        ]
        fwd.append("        t = self.text_emb(ids)")
        if r.cls_token:
            fwd.append("        t = torch.cat([self.cls.expand(B, -1, -1), t], dim=1)")
        fwd.append("        x = x + self.text(t)")
    if r.proj_param:
        init.append(
            "        self.proj = nn.Parameter(torch.randn(r.width, r.width) / math.sqrt(r.width))"
        )
        fwd.append("        x = x @ self.proj")
    if r.scale_param:
        init.append("        self.scale = nn.Parameter(torch.tensor(0.3))")
        fwd.append("        x = x * self.scale.exp()")
    init.append("        self.head = nn.Linear(r.width, r.vocab, bias=False)")
    if r.tied:
        init.append("        self.head.weight = self.emb.weight")
    fwd.append("        logits = self.head(x)")
    if r.cls_token:
        fwd.append("        logits = logits[:, 1:]")
    fwd += [
        f"        loss = F.cross_entropy(logits.reshape(-1, {r.vocab}), targets.reshape(-1))",
        "        return logits, loss",
    ]
    head = [
        '"""FuzzNet written out for one recipe (tests/fuzz_models.py: source_of)."""',
        "",
        "import math",
        "",
        "import torch",
        "import torch.nn as nn",
        "import torch.nn.functional as F",
        "",
        "from tests import fuzz_models as fm",
        "",
        "",
        "class Tower(nn.Module):",
    ]
    return "\n".join([*head, *tower, "", "", "class FuzzNet(nn.Module):", *init, "", *fwd, ""])
