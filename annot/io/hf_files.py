"""A Hugging Face checkpoint on disk, for :mod:`annot.io.pretrained`: which
safetensors files hold the weights (``model.safetensors``, or the shards
``model.safetensors.index.json`` lists, or the one file given), every file's
header checked (:func:`annot.io.safetensors_files.read_header`) and where
each stored tensor lies. Opening reads headers only (a few KiB a file), so
every rank opens the whole checkpoint and refuses a broken one before any
weight is read."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from annot.core.errors import CheckpointError
from annot.io.safetensors_files import Entry, read_header

__all__ = [
    "CONFIG",
    "GENERATION_CONFIG",
    "INDEX",
    "WEIGHTS",
    "Stored",
    "beside_weights",
    "open_stored",
]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


@dataclass(frozen=True)
class Stored:
    """An opened checkpoint: ``tensors[name] = (file, entry)``; ``directory``
    is the checkpoint directory (None for a lone safetensors file)."""

    path: str
    directory: str | None
    tensors: dict[str, tuple[str, Entry]]


def _weight_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{path}: no such checkpoint; expected a directory saved by save_pretrained "
            "(config.json and model.safetensors) or a .safetensors file"
        )
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{index}: not a readable index ({type(e).__name__}: {e}); it should hold "
                '{"weight_map": {"<tensor name>": "<file>.safetensors", ...}}'
            ) from None
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{index}: lists {missing}, which {path} does not have")
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, WEIGHTS)
    if os.path.isfile(single):
        return [single]
    found = sorted(n for n in os.listdir(path) if n.endswith(_WEIGHT_SUFFIXES))
    raise CheckpointError(
        f"{path}: has neither {WEIGHTS} nor {INDEX} (weight files found: {found or 'none'}); "
        "annot reads safetensors checkpoints: save the model with transformers' "
        "save_pretrained (safetensors is its default) and load that directory"
    )


def open_stored(path: str | os.PathLike) -> Stored:
    """The checkpoint at ``path`` (a directory or one safetensors file), every
    file's header checked; a tensor stored twice is refused."""
    path = os.path.abspath(os.fspath(path))
    tensors: dict[str, tuple[str, Entry]] = {}
    for file in _weight_files(path):
        for name, entry in read_header(file).entries.items():
            if name in tensors:
                raise CheckpointError(
                    f"{path}: {name} is stored twice, in {tensors[name][0]} and {file}"
                )
            tensors[name] = (file, entry)
    return Stored(path, path if os.path.isdir(path) else None, tensors)


def beside_weights(directory: str) -> list[str]:
    """The files of a checkpoint directory that are not weights, an index or
    configs annot writes itself: tokenizer files, chat template, README...
    (the files :func:`annot.save_pretrained` copies)."""
    own = {INDEX, CONFIG, GENERATION_CONFIG}
    return sorted(
        n
        for n in os.listdir(directory)
        if os.path.isfile(os.path.join(directory, n))
        and n not in own
        and not n.endswith(_WEIGHT_SUFFIXES)
        and not n.endswith(".index.json")
    )
