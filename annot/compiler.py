"""Just-in-time rewriting of a model's source, cached on disk.

For every Python module that defines a class of the model, the module's
source is rewritten (tensor-parallel, then pipeline stages) and the result is
written to a cache file keyed by the source hash, the hints and the mesh. A
second process with the same model and mesh finds the file and skips the
rewrite.

Loading re-executes only the ``nn.Module`` class definitions of the rewritten
file, compiled with the cache file's name (so tracebacks point at real lines
of a real file), in a copy of the original module's namespace. The module's
other top-level code (a training script's body, say) never runs twice, and
its constants and helpers are shared with the original.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import os
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.nn as nn

from annot.errors import AnnotError, RewriteError
from annot.files import atomic_write
from annot.hints import checkpoint, get_checkpoint

__all__ = ["CompiledModule", "cache_dir", "compile_classes"]


def _rewriter_fingerprint() -> str:
    """A hash of the rewriters' own source: a cache entry written by another
    version of the rewriters is never reused."""
    from annot import rewriters

    h = hashlib.sha256()
    for f in sorted(Path(rewriters.__file__).parent.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


REWRITE_VERSION = _rewriter_fingerprint()


def cache_dir() -> Path:
    """``$ANNOT_CACHE_DIR``, else ``$XDG_CACHE_HOME/annot``, else ``~/.cache/annot``."""
    env = os.environ.get("ANNOT_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "annot"


@dataclass
class CompiledModule:
    """One rewritten module: where it came from, where it lives, its classes."""

    original: types.ModuleType
    source_path: Path
    cache_path: Path
    source: str  # the rewritten source
    namespace: types.ModuleType
    hit: bool
    seconds: float
    classes: dict[str, type] = field(default_factory=dict)


def read_source(path: Path) -> str:
    import tokenize

    with tokenize.open(path) as f:  # honours a coding cookie / BOM
        return f.read()


def _model_modules(classes: list[type]) -> list[types.ModuleType]:
    mods: dict[str, types.ModuleType] = {}
    for cls in classes:
        modname = cls.__module__
        if modname.split(".")[0] in ("torch", "builtins") or modname.startswith("annot_jit."):
            continue
        mod = sys.modules.get(modname)
        if mod is None or getattr(mod, "__file__", None) is None:
            raise AnnotError(
                f"cannot rewrite {cls.__qualname__}: its module {modname!r} has no source file; "
                "define the model in a .py file (not a notebook cell or exec'd string)"
            )
        mods[modname] = mod
    return list(mods.values())


def _module_classes(mod: types.ModuleType) -> dict[str, type]:
    """nn.Module subclasses defined (not imported) at the top level of ``mod``."""
    out = {}
    for name, obj in vars(mod).items():
        if (
            isinstance(obj, type)
            and issubclass(obj, nn.Module)
            and obj.__module__ == mod.__name__
            and obj.__qualname__ == name
        ):
            out[name] = obj
    return out


def _load(original: types.ModuleType, text: str, cache_path: Path, name: str) -> types.ModuleType:
    ns = types.ModuleType(name)
    skip = {"__name__", "__file__", "__spec__", "__loader__", "__cached__", "__builtins__"}
    ns.__dict__.update({k: v for k, v in vars(original).items() if k not in skip})
    ns.__file__ = str(cache_path)
    ns.__dict__["__builtins__"] = __builtins__
    sys.modules[name] = ns
    wanted = set(_module_classes(original))
    tree = ast.parse(text, filename=str(cache_path))
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (
            isinstance(node, ast.ClassDef) and node.name in wanted
        ):
            code = compile(ast.Module(body=[node], type_ignores=[]), str(cache_path), "exec")
            exec(code, ns.__dict__)
    return ns


def _rewritten(value, mapping: dict[type, type]):
    """``value`` with the original classes it holds (itself, or one level inside a
    dict, list, tuple or ``functools.partial``) replaced by their rewritten ones;
    ``value`` itself when it holds none."""
    import functools

    def sub(v):
        return mapping.get(v, v) if isinstance(v, type) else v

    if isinstance(value, type):
        return sub(value)
    if type(value) is dict and any(isinstance(v, type) and v in mapping for v in value.values()):
        return {k: sub(v) for k, v in value.items()}
    if type(value) in (list, tuple) and any(isinstance(v, type) and v in mapping for v in value):
        return type(value)(sub(v) for v in value)
    if type(value) is functools.partial and isinstance(value.func, type) and value.func in mapping:
        return functools.partial(mapping[value.func], *value.args, **value.keywords)
    return value


def compile_classes(
    classes: list[type],
    *,
    key: str,
    transform: Callable[[str, str, types.ModuleType], str],
    directory: Optional[Path] = None,
) -> dict[type, type]:
    """Rewrite and load every module defining one of ``classes``.

    ``transform(source, path, module) -> rewritten source`` does the rewriting;
    ``key`` captures everything else the output depends on (mesh, hints, plan).
    Returns a map from each original class of those modules to its rewritten
    class, cross-module references patched. ``compile_classes.last`` holds the
    :class:`CompiledModule` records of the last call (for explain and tests).
    """
    directory = directory or cache_dir()
    records: list[CompiledModule] = []
    mapping: dict[type, type] = {}
    for mod in _model_modules(classes):
        t0 = time.perf_counter()
        src_path = Path(inspect.getfile(mod)).resolve()
        source = read_source(src_path)
        digest = hashlib.sha256(
            "\0".join([REWRITE_VERSION, key, str(src_path), source]).encode()
        ).hexdigest()[:20]
        stem = mod.__name__.replace(".", "_").strip("_") or "module"
        cache_path = directory / f"{stem}-{digest}.py"
        hit = cache_path.exists()
        if hit:
            text = cache_path.read_text(encoding="utf-8")
        else:
            try:
                text = transform(source, str(src_path), mod)
            except RewriteError:
                raise
            atomic_write(cache_path, text)
        ns = _load(mod, text, cache_path, f"annot_jit.{stem}_{digest}")
        new_classes = _module_classes(ns)
        for name, orig in _module_classes(mod).items():
            if name in new_classes:
                mapping[orig] = new_classes[name]
                if get_checkpoint(orig):  # also when applied as a call, not in the source
                    checkpoint(new_classes[name])
        records.append(
            CompiledModule(
                mod, src_path, cache_path, text, ns, hit, time.perf_counter() - t0, new_classes
            )
        )
    # A name that refers to an original class must build the rewritten one: a class
    # of another module (``from .blocks import Block``), and module-level registries
    # (GPT-J's ``GPTJ_ATTENTION_CLASSES = {"eager": GPTJAttention}``, a partial).
    for rec in records:
        d = rec.namespace.__dict__
        for k, v in list(d.items()):
            d[k] = _rewritten(v, mapping)
    compile_classes.last = records
    return mapping


compile_classes.last = []
