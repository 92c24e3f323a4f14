"""Models in other people's styles, with their blocks below the root forward.

Written the way their libraries write them, without any annot hint, for the
pipeline tests (:mod:`tests.e2e.test_pp_nested`):

* :class:`TimmStyleViT`: ``forward`` -> ``forward_features`` -> an
  ``nn.Sequential`` of blocks called once; ``cls_token`` and ``pos_embed``
  are the root's own parameters (timm's ``VisionTransformer``).
* :class:`TorchvisionStyleResNet`: ``forward`` -> ``_forward_impl`` ->
  ``self.layer1(x)`` ...; BatchNorm with running statistics (torchvision's
  ``ResNet``).
* :class:`SequentialMLP`: every block in one ``nn.Sequential``, called once.
* :class:`XStyleDecoder`: each layer an ``nn.ModuleList([block, norm])`` whose
  elements forward calls directly, the list itself never called
  (x-transformers' ``Decoder``), inside a one-line wrapper
  (:class:`XStyleWrapper`).
* :class:`BranchyEncoder`: a nested forward whose path depends on the data
  (``if h.mean() > 0``) and on a Python int read from a tensor, before and
  after the boundary, with a dataclass output.
* :class:`TwoTower`: a CLIP-like model (open_clip's style): the root forward
  calls an image tower, then a text tower, and reads raw parameters between
  and after the calls: a class token concatenated in, positional embeddings
  added, projections used with ``@``, a learned temperature returned as
  ``self.logit_scale.exp()`` in its output dict.
* :class:`LateProjection`: a tower's own raw parameter (``self.image.proj``)
  read by the root after the other tower has run.
* :class:`ScaledHeadLM`: a raw parameter read after the blocks
  (``self.head(self.norm(x) * self.scale.exp())``), the embedding tied to
  the head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# -- timm style ---------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, h, N, hd)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 2 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmStyleViT(nn.Module):
    def __init__(
        self, img: int = 8, patch: int = 4, dim: int = 16, depth: int = 4, classes: int = 5
    ):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, 2) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward_features(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, dim)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        x = self.blocks(x)
        return self.norm(x)

    def forward_head(self, x):
        return self.head(x[:, 0])

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


# -- torchvision style --------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TorchvisionStyleResNet(nn.Module):
    def __init__(self, width: int = 4, classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(
            BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width)
        )
        self.layer3 = nn.Sequential(BasicBlock(2 * width, 4 * width, 2))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(4 * width, classes)

    def _forward_impl(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)

    def forward(self, x):
        return self._forward_impl(x)


# -- one nn.Sequential --------------------------------------------------------


class SequentialMLP(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 6):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(dim, 2 * dim), nn.Tanh()]
        for _ in range(depth):
            layers += [nn.Linear(2 * dim, 2 * dim), nn.LayerNorm(2 * dim), nn.GELU()]
        layers.append(nn.Linear(2 * dim, dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


# -- data-dependent control flow in a nested forward ---------------------------


@dataclass
class EncoderOutput:
    last_hidden: torch.Tensor
    gate: Optional[torch.Tensor] = None


class Encoder(nn.Module):
    def __init__(self, dim: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.gate = nn.Linear(dim, 1)

    def forward(self, h, *, twice: bool = False):
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if h.mean() > 0:  # a branch on the data, taken per microbatch
                h = h * 1.5
            else:
                h = h - 0.1
            if twice and i == 0:
                h = torch.tanh(layer(h))  # a module called twice
        steps = int(h.abs().sum().item() * 10) % 3  # a Python int read from a tensor
        for _ in range(steps):
            h = h * 0.5
        return EncoderOutput(last_hidden=h, gate=torch.sigmoid(self.gate(h)))


class BranchyEncoder(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 4, classes: int = 3):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.encoder = Encoder(dim, depth)
        self.head = nn.Linear(dim, classes)

    def forward(self, x, twice: bool = False):
        out = self.encoder(self.embed(x), twice=twice)
        if out.gate is None:  # early return
            return self.head(out.last_hidden)
        return self.head(out.last_hidden * out.gate)


# -- x-transformers style -------------------------------------------------------------


class XStyleDecoder(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16, depth: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [nn.ModuleList([Mlp(dim, 2 * dim), nn.LayerNorm(dim)]) for _ in range(depth)]
        )
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for block, norm in self.layers:  # a layer (a ModuleList) is never called itself
            x = norm(x + block(x))
        return self.out(x)


class XStyleWrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = XStyleDecoder()

    def forward(self, ids):
        return self.net(ids)


class XStyleSubclass(XStyleDecoder):
    """Only ``__init__`` of its own; forward inherited from the library's class."""

    def __init__(self):
        super().__init__(depth=4)


# -- raw parameters read in the root's forward (open_clip style) ----------------------


class Tower(nn.Module):
    """A transformer over ``(B, N, dim)`` tokens: blocks, then a norm."""

    def __init__(self, dim: int, depth: int):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(dim, 2) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(self.blocks(x))


class TwoTower(nn.Module):
    def __init__(
        self,
        img: int = 8,
        patch: int = 4,
        vocab: int = 64,
        context: int = 8,
        dim: int = 16,
        embed: int = 12,
        depth: int = 2,
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(3, dim, patch, patch, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(dim) * 0.02)
        self.visual_positional = nn.Parameter(torch.randn((img // patch) ** 2 + 1, dim) * 0.02)
        self.visual = Tower(dim, depth)
        self.visual_proj = nn.Parameter(torch.randn(dim, embed) * dim**-0.5)
        self.token_embedding = nn.Embedding(vocab, dim)
        self.positional_embedding = nn.Parameter(torch.randn(context, dim) * 0.01)
        self.text = Tower(dim, depth)
        self.text_projection = nn.Parameter(torch.randn(dim, embed) * dim**-0.5)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def encode_image(self, images):
        x = self.conv1(images).flatten(2).transpose(1, 2)  # (B, N, dim)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)  # (B, 1, dim)
        x = torch.cat([cls, x], dim=1) + self.visual_positional  # (B, N + 1, dim)
        x = self.visual(x)
        return x[:, 0] @ self.visual_proj  # (B, embed)

    def encode_text(self, ids):
        x = self.token_embedding(ids) + self.positional_embedding[: ids.shape[1]]
        x = self.text(x)  # (B, T, dim)
        return x.mean(1) @ self.text_projection  # (B, embed)

    def forward(self, images, ids):
        image_features = F.normalize(self.encode_image(images), dim=-1)
        text_features = F.normalize(self.encode_text(ids), dim=-1)
        return {
            "image_features": image_features,
            "text_features": text_features,
            "logit_scale": self.logit_scale.exp(),
        }


def clip_loss(out: dict) -> torch.Tensor:
    """open_clip's contrastive loss over the pairs of one batch."""
    logits = out["logit_scale"] * out["image_features"] @ out["text_features"].T  # (B, B)
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class ProjectedTower(Tower):
    """A tower holding its output projection, which its caller applies."""

    def __init__(self, dim: int, depth: int, embed: int):
        super().__init__(dim, depth)
        self.proj = nn.Parameter(torch.randn(dim, embed) * dim**-0.5)


class LateProjection(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16, embed: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.image = ProjectedTower(dim, 2, embed)
        self.text = Tower(dim, 2)

    def forward(self, ids):
        x = self.image(self.embed(ids))
        x = self.text(x)  # (B, T, dim)
        return x @ self.image.proj  # (B, T, embed): the image tower's weight, read here


class ScaledHeadLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16, depth: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        # (no attention: a key bias has no gradient, and AdamW magnifies its rounding)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), Mlp(dim, 2 * dim)) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied across the first and last stage

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x) * self.scale.exp())
