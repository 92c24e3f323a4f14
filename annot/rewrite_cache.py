"""Just-in-time rewriting of a model's source, cached on disk.

For every Python module that defines a class of the model, the module's
source is rewritten (tensor-parallel, then pipeline stages) and the result is
written to a cache file keyed by the source hash, the hints and the mesh. A
second process with the same model and mesh finds the file and skips the
rewrite.

Loading re-executes only the ``nn.Module`` class definitions of the rewritten
file that the rewrite changed (or that read a changed class), compiled with
the cache file's name (so tracebacks point at real lines of a real file), in
a copy of the original module's namespace. The module's other top-level code
(a training script's body, say) never runs twice, and its constants and
helpers are shared with the original. A class the rewrite leaves alone stays
itself, so a built layer keeps its runtime type.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import os
import sys
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch.nn as nn

from annot.core.errors import AnnotError, RewriteError
from annot.core.files import atomic_write
from annot.core.hints import checkpoint, get_recompute

__all__ = ["RewrittenModule", "cache_dir", "last_rewritten", "rewrite_classes"]


def _rewriter_fingerprint() -> str:
    """A hash of the rewriters' own source: a cache entry written by another
    version of the rewriters is never reused."""
    from annot import rewriters

    h = hashlib.sha256()
    folder = Path(rewriters.__file__).parent
    for f in sorted(folder.rglob("*.py")):
        h.update(str(f.relative_to(folder)).encode())
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
class RewrittenModule:
    """One rewritten module: where it came from, where it lives, its classes."""

    original: types.ModuleType
    source_path: Path
    cache_path: Path
    source: str  # the rewritten source
    namespace: types.ModuleType
    hit: bool
    seconds: float
    classes: dict[str, type] = field(default_factory=dict)


def read_source(path: Union[str, Path]) -> str:
    import tokenize

    with tokenize.open(path) as f:  # honours a coding cookie / BOM
        return f.read()


def _model_modules(classes: list[type], needed: frozenset[type]) -> list[types.ModuleType]:
    """The modules whose source is rewritten: every module defining one of
    ``classes``, but torch's own only where it defines a class of ``needed``
    (a hinted class, the class split into stages: torch's test Transformer),
    never a rewritten copy's."""
    mods: dict[str, types.ModuleType] = {}
    for cls in classes:
        modname = cls.__module__
        if modname == "builtins" or modname.startswith("annot_jit."):
            continue
        if modname.split(".")[0] == "torch" and cls not in needed:
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


def _load(
    original: types.ModuleType, text: str, cache_path: Path, name: str, wanted: set[str]
) -> types.ModuleType:
    """The rewritten module: a copy of ``original``'s namespace in which the
    imports of ``text`` and its definitions of the classes ``wanted`` are run."""
    ns = types.ModuleType(name)
    skip = {"__name__", "__file__", "__spec__", "__loader__", "__cached__", "__builtins__"}
    ns.__dict__.update({k: v for k, v in vars(original).items() if k not in skip})
    ns.__file__ = str(cache_path)
    ns.__dict__["__builtins__"] = __builtins__
    sys.modules[name] = ns
    tree = ast.parse(text, filename=str(cache_path))
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (
            isinstance(node, ast.ClassDef) and node.name in wanted
        ):
            code = compile(ast.Module(body=[node], type_ignores=[]), str(cache_path), "exec")
            exec(code, ns.__dict__)
    return ns


def _held(value) -> list:
    """The classes ``value`` holds: itself, or one level inside a dict, list,
    tuple or ``functools.partial`` (GPT-J's ``{"eager": GPTJAttention}``)."""
    import functools

    if isinstance(value, type):
        return [value]
    if type(value) is dict:
        return [v for v in value.values() if isinstance(v, type)]
    if type(value) in (list, tuple):
        return [v for v in value if isinstance(v, type)]
    if type(value) is functools.partial and isinstance(value.func, type):
        return [value.func]
    return []


def _rewritten(value, mapping: dict[type, type]):
    """``value`` with the original classes it holds (:func:`_held`) replaced by
    their rewritten ones; ``value`` itself when it holds none."""
    import functools

    if not any(c in mapping for c in _held(value)):
        return value

    def sub(v):
        return mapping.get(v, v) if isinstance(v, type) else v

    if isinstance(value, type):
        return sub(value)
    if type(value) is dict:
        return {k: sub(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(sub(v) for v in value)
    return functools.partial(mapping[value.func], *value.args, **value.keywords)


def _class_defs(text: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(text).body if isinstance(n, ast.ClassDef)}


def _changed(rewrites: list[tuple[types.ModuleType, str, str]]) -> set[type]:
    """The classes a rewrite changes, of ``(module, source, rewritten source)``:
    those whose definition differs, and those whose definition reads a name
    bound to a changed class (a base, a class it builds, a registry holding
    one), until no more change. Only these are re-run from the rewritten
    source; every other class stays itself, so a built layer keeps its
    runtime type (transformers' ``Conv1D`` is still ``Conv1D``) and the
    model's own ``isinstance`` checks still hold."""
    changed: set[type] = set()
    reads: dict[type, tuple[types.ModuleType, set[str]]] = {}
    for mod, source, text in rewrites:
        old, new = _class_defs(source), _class_defs(text)
        for name, cls in _module_classes(mod).items():
            node = new.get(name)
            if node is None:
                continue  # not defined at the top level: never re-run
            if name not in old or ast.dump(old[name]) != ast.dump(node):
                changed.add(cls)
            else:
                reads[cls] = (mod, {n.id for n in ast.walk(node) if isinstance(n, ast.Name)})
    grew = True
    while grew:
        grew = False
        for cls, (mod, names) in reads.items():
            if cls in changed:
                continue
            g = vars(mod)
            if any(c in changed for n in names for c in _held(g.get(n))):
                changed.add(cls)
                grew = True
    return changed


def rewrite_classes(
    classes: list[type],
    *,
    key: str,
    transform: Callable[[str, str, types.ModuleType], str],
    directory: Optional[Path] = None,
    needed: Iterable[type] = (),
) -> dict[type, type]:
    """Rewrite and load every module defining one of ``classes`` (torch's own
    modules only where they define a class of ``needed``: the classes whose
    rewrite a hint or the stage split asks for).

    ``transform(source, path, module) -> rewritten source`` does the rewriting;
    ``key`` captures everything else the output depends on (mesh, hints, plan).
    Returns a map from each original class the rewrite changes (:func:`_changed`)
    to its rewritten class, cross-module references patched; a class it leaves
    as it was is not in the map and stays itself. :func:`last_rewritten`
    gives the :class:`RewrittenModule` records of the last call (for explain
    and tests).
    """
    directory = directory or cache_dir()
    rewrites = []  # (module, source, rewritten source, source path, cache path, its name, hit, s)
    for mod in _model_modules(classes, frozenset(needed)):
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
        name = f"annot_jit.{stem}_{digest}"
        seconds = time.perf_counter() - t0
        rewrites.append((mod, source, text, src_path, cache_path, name, hit, seconds))
    changed = _changed([(mod, source, text) for mod, source, text, *_ in rewrites])
    records: list[RewrittenModule] = []
    mapping: dict[type, type] = {}
    for mod, _, text, src_path, cache_path, name, hit, seconds in rewrites:
        t0 = time.perf_counter()
        originals = _module_classes(mod)
        wanted = {k for k, cls in originals.items() if cls in changed}
        ns = _load(mod, text, cache_path, name, wanted)
        new_classes = _module_classes(ns)
        for k, orig in originals.items():
            if k in new_classes:
                mapping[orig] = new_classes[k]
                if get_recompute(orig):  # also when applied as a call, not in the source
                    checkpoint(new_classes[k])
        seconds += time.perf_counter() - t0
        records.append(
            RewrittenModule(mod, src_path, cache_path, text, ns, hit, seconds, new_classes)
        )
    # A name that refers to an original class must build the rewritten one: a class
    # of another module (``from .blocks import Block``), and module-level registries
    # (GPT-J's ``GPTJ_ATTENTION_CLASSES = {"eager": GPTJAttention}``, a partial).
    for rec in records:
        d = rec.namespace.__dict__
        for k, v in list(d.items()):
            d[k] = _rewritten(v, mapping)
    _LAST[:] = records
    return mapping


_LAST: list[RewrittenModule] = []  # rewrite_classes' records of its last call


def last_rewritten() -> list[RewrittenModule]:
    """The :class:`RewrittenModule` records of the last :func:`rewrite_classes` call."""
    return list(_LAST)
