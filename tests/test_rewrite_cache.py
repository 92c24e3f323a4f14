"""The just-in-time rewrite cache: a second process hits it; tracebacks point at
real lines of the cached file; a training script's top-level code never runs
twice; the user's file is never touched."""

import hashlib
from pathlib import Path

import pytest

from annot.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _build(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from annot.rewrite_cache import last_rewritten
    from examples.gpt.model import GPT, GPTConfig

    annot.parallelize(GPT, GPTConfig(n_layer=1), mesh=annot.Mesh(tp=1), seed=0)
    return [(r.hit, str(r.cache_path), r.namespace.__name__) for r in last_rewritten()]


def test_second_process_hits_the_cache(tmp_path):
    model_file = ROOT / "examples" / "gpt" / "model.py"
    before = hashlib.sha256(model_file.read_bytes()).hexdigest()
    (first,) = run_ranks(_build, 1, str(tmp_path))
    (second,) = run_ranks(_build, 1, str(tmp_path))
    assert [h for h, _, _ in first] == [False]
    assert [h for h, _, _ in second] == [True]
    assert first[0][1] == second[0][1]
    assert Path(first[0][1]).parent == tmp_path
    assert hashlib.sha256(model_file.read_bytes()).hexdigest() == before


SCRIPT = """\
import torch.nn as nn
from annot import Col, Row, shard

RAN = []
RAN.append("top-level code")  # a script's body: must not run again in the JIT copy


@shard(up=Col(), down=Row())
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x):
        h = self.up(x)
        if x.shape[0] == 3:
            raise ValueError("three rows")
        return self.down(h)
"""


def _traceback(path: str, cache: str):
    import importlib.util
    import os
    import sys
    import traceback

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot

    spec = importlib.util.spec_from_file_location("user_script", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["user_script"] = mod
    spec.loader.exec_module(mod)
    model = annot.parallelize(mod.Net, mesh=annot.Mesh(tp=2), seed=0)
    try:
        model(torch.randn(3, 4))
    except ValueError:
        frames = traceback.extract_tb(sys.exc_info()[2])
        last = frames[-1]
        return last.filename, last.lineno, last.line, list(mod.RAN)
    return None


def test_traceback_points_at_the_cached_file(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    cache = tmp_path / "cache"
    results = run_ranks(_traceback, 2, str(script), str(cache))
    for filename, lineno, line, ran in results:
        assert Path(filename).parent == cache
        assert line == 'raise ValueError("three rows")'
        assert Path(filename).read_text().splitlines()[lineno - 1].strip() == line
        assert ran == ["top-level code"]  # once, by the import above; not by annot
    assert script.read_text() == SCRIPT


def test_source_less_class_is_refused():
    import torch.nn as nn

    import annot

    ns: dict = {"nn": nn}
    exec("class Dyn(nn.Module):\n    def forward(self, x):\n        return x\n", ns)
    from annot.rewrite_cache import rewrite_classes

    ns["Dyn"].__module__ = "not_a_module_anywhere"
    with pytest.raises(annot.AnnotError, match="has no source file"):
        rewrite_classes([ns["Dyn"]], key="k", transform=lambda s, p, m: s)


LAYERS = """\
import torch.nn as nn


class Layer(nn.Linear):  # the rewrite leaves it alone: it stays itself
    pass


class Block(nn.Module):  # the rewrite changes it
    def __init__(self):
        super().__init__()
        self.layer = Layer(2, 2)


class Outer(nn.Module):  # unchanged, but builds a changed class
    def __init__(self):
        super().__init__()
        self.block = Block()


REGISTRY = {"block": Block}


class ViaRegistry(nn.Module):  # unchanged, but reads a registry that holds one
    def __init__(self):
        super().__init__()
        self.block = REGISTRY["block"]()


class Plain(nn.Module):  # unchanged, reads nothing changed
    def __init__(self):
        super().__init__()
        self.layer = Layer(2, 2)
"""


def test_only_classes_the_rewrite_changes_are_copied(tmp_path):
    """A built layer keeps its runtime type (an instance's transformers Conv1D
    stays Conv1D, so tp_convert knows it); a class that builds a rewritten
    one, directly or through a registry, is rewritten too."""
    import importlib.util
    import sys

    from annot.rewrite_cache import rewrite_classes

    path = tmp_path / "layers_model.py"
    path.write_text(LAYERS)
    spec = importlib.util.spec_from_file_location("layers_model", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["layers_model"] = mod
    try:
        spec.loader.exec_module(mod)
        mapping = rewrite_classes(
            [mod.Outer, mod.Plain],
            key="k",
            transform=lambda s, p, m: s.replace(
                "Layer(2, 2)\n\n\nclass Outer", "Layer(2, 3)\n\n\nclass Outer"
            ),
            directory=tmp_path / "cache",
        )
    finally:
        del sys.modules["layers_model"]
    assert set(mapping) == {mod.Block, mod.Outer, mod.ViaRegistry}
    outer = mapping[mod.Outer]()
    assert type(outer.block) is mapping[mod.Block]
    assert type(outer.block.layer) is mod.Layer  # the original class, not a copy
    assert outer.block.layer.out_features == 3  # built by the rewritten Block
    assert type(mapping[mod.ViaRegistry]().block) is mapping[mod.Block]
    assert mapping.get(mod.Plain, mod.Plain) is mod.Plain
