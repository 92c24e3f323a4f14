"""The decorators: ``@shard``, ``@stage``, ``@recompute``, ``boundary()``.

They only *record* a validated spec on the class and return it unchanged, so
an annotated model still runs single-device with plain PyTorch. Checking the
hints against a built model happens separately (:mod:`annot.build.hint_checks`).

Hints can also be given from outside the source, keyed by module-path
patterns (:func:`resolve_external_hints`), for a model the user cannot edit.
"""

from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional, Union, cast

from annot.core.errors import HintError
from annot.core.specs import LOCAL_NAMES, SPEC_TYPES, Heads, Local, Spec, local_name_problem

__all__ = [
    "ShardSpec",
    "StageSpec",
    "shard",
    "stage",
    "boundary",
    "checkpoint",
    "recompute",
    "get_shard_spec",
    "get_stage_spec",
    "get_recompute",
    "recomputed_classes",
    "stage_recompute",
    "path_matches",
    "resolve_external_hints",
    "resolve_hints",
    "hinted_paths",
]

SHARD_ATTR = "__annot_shard__"
STAGE_ATTR = "__annot_stage__"
RECOMPUTE_ATTR = "__annot_recompute__"


@dataclass(frozen=True)
class ShardSpec:
    """What ``@shard`` recorded on one class: a spec per submodule / parameter
    attribute name, and the names of per-rank sizes."""

    specs: dict[str, Spec] = field(default_factory=dict)
    local: tuple[str, ...] = ()

    def __repr__(self) -> str:
        args = [f"{k}={v!r}" for k, v in self.specs.items()]
        if self.local:
            args.append(f"local={self.local!r}")
        return f"shard({', '.join(args)})"


@dataclass(frozen=True)
class StageSpec:
    """What ``@stage`` recorded: where stages begin (module paths) or ``auto``."""

    split: tuple[str, ...] = ()
    auto: bool = False
    cost: Optional[str] = None
    memory: Optional[int] = None
    recompute: bool = False  # @stage(recompute=True): every stage recomputed in backward


def _is_module_class(cls: object) -> bool:
    import torch.nn as nn

    return isinstance(cls, type) and issubclass(cls, nn.Module)


def _check_spec(where: str, arg: str, spec: object) -> None:
    if not isinstance(spec, SPEC_TYPES):
        raise HintError(
            f"{where}: argument {arg}={spec!r} is a {type(spec).__name__}; expected a spec: "
            "Col(), Row(), Vocab(), Replicate(), P(...), Partial(), Heads() or Experts() — e.g. "
            f"@shard({arg}=Col())"
        )


def _check_local(where: str, local: object) -> tuple[str, ...]:
    if isinstance(local, str):
        local = (local,)
    if not isinstance(local, (tuple, list)):
        raise HintError(
            f"{where}: argument local={local!r}; expected a tuple of attribute names, "
            'e.g. local=("n_head", "config.n_embd")'
        )
    for name in local:
        why = local_name_problem(name)
        if why is not None:
            raise HintError(f"{where}: argument local={local!r}: {why}; {LOCAL_NAMES}")
    return tuple(local)


def shard(*, local: Union[tuple[str, ...], list[str], str] = (), **specs: Spec):
    """Record tensor-parallel hints on an ``nn.Module`` class.

    ``@shard(c_attn=Col(chunks=3), c_proj=Row(), local=("n_head", "n_embd"))``

    Each keyword names a submodule (or ``nn.Parameter``) attribute set in
    ``__init__``; ``local`` names sizes that become per-rank (divided by tp)
    where ``forward`` reads them: attributes, forward locals, or dotted paths
    from the module (``"config.n_head"``: reads of ``self.config.n_head``;
    the config object itself is not changed). The class is returned unchanged.
    """

    def decorate(cls):
        name = getattr(cls, "__name__", repr(cls))
        if not _is_module_class(cls):
            raise HintError(
                f"@shard on {name}: expected an nn.Module subclass, got {type(cls).__name__}"
            )
        where = f"@shard on {name}"
        for arg, spec in specs.items():
            _check_spec(where, arg, spec)
        loc = _check_local(where, local)
        setattr(cls, SHARD_ATTR, ShardSpec(dict(specs), loc))
        return cls

    return decorate


def stage(
    *,
    split: Union[tuple[str, ...], list[str]] = (),
    auto: bool = False,
    cost: Optional[Literal["time", "flops", "params"]] = None,
    memory: Union[int, str, None] = None,
    recompute: bool = False,
    checkpoint: Optional[bool] = None,
):
    """Record pipeline-stage hints on the ``nn.Module`` class whose forward is split.

    ``@stage(split=["h.4", "h.8"])``: a new stage begins before each of these
    calls. ``@stage(auto=True)``: annot chooses balanced boundaries. Boundaries
    can also be marked inside forward with :func:`boundary`.
    ``recompute=True`` recomputes each stage's activations in backward
    (``checkpoint=`` is its old name).
    """
    if checkpoint is not None:
        warnings.warn(
            "@stage(checkpoint=...) is now @stage(recompute=...) (activation recompute; "
            "'checkpoint' names saved checkpoints in annot)",
            DeprecationWarning,
            stacklevel=2,
        )
        recompute = checkpoint

    def decorate(cls):
        name = getattr(cls, "__name__", repr(cls))
        where = f"@stage on {name}"
        if not _is_module_class(cls):
            raise HintError(f"{where}: expected an nn.Module subclass, got {type(cls).__name__}")
        sp = split
        if isinstance(sp, str):
            sp = (sp,)
        if not isinstance(sp, (tuple, list)) or not all(isinstance(s, str) and s for s in sp):
            raise HintError(
                f"{where}: argument split={split!r}; expected a list of module paths, "
                'e.g. split=["h.4", "h.8"]'
            )
        if not isinstance(auto, bool):
            raise HintError(f"{where}: argument auto={auto!r}; expected True or False")
        if auto and sp:
            raise HintError(f"{where}: give split=[...] or auto=True, not both")
        if cost not in (None, "time", "flops", "params"):
            raise HintError(
                f"{where}: argument cost={cost!r}; expected 'time', 'flops' or 'params'"
            )
        mem = parse_bytes(memory, where) if memory is not None else None
        if not isinstance(recompute, bool):
            raise HintError(f"{where}: argument recompute={recompute!r}; expected a bool")
        setattr(cls, STAGE_ATTR, StageSpec(tuple(sp), auto, cost, mem, recompute))
        return cls

    return decorate


def recompute(cls=None):
    """Recompute this module's activations during backward instead of keeping
    them (activation checkpointing, as torch calls it), wherever an instance runs::

        @recompute
        class Block(nn.Module): ...

    Records ``__annot_recompute__ = True`` on the class and returns it
    unchanged (``@recompute()`` works too). ``@stage(recompute=True)``
    recomputes every pipeline stage instead.
    """
    if cls is None:
        return recompute
    if not _is_module_class(cls):
        name = getattr(cls, "__name__", repr(cls))
        raise HintError(
            f"@recompute on {name}: expected an nn.Module subclass, got {type(cls).__name__}; "
            "put it on the class of the blocks to recompute, e.g.\n"
            "    @recompute\n"
            "    class Block(nn.Module): ..."
        )
    setattr(cls, RECOMPUTE_ATTR, True)
    return cls


def checkpoint(cls=None):
    """The old name of :func:`recompute` ("checkpoint" names saved checkpoints
    in annot); warns."""
    warnings.warn(
        "annot.checkpoint is now annot.recompute (activation recompute; 'checkpoint' names "
        "saved checkpoints in annot)",
        DeprecationWarning,
        stacklevel=2,
    )
    return recompute(cls)


def boundary() -> None:
    """Mark a pipeline-stage boundary inside ``forward``. Single-device it does
    nothing; the stage-split rewriter starts a new stage here."""
    return None


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: Union[int, str], where: str = "memory") -> int:
    """``16GiB`` -> 17179869184. Ints are bytes."""
    if isinstance(value, bool):
        raise HintError(f"{where}: memory={value!r}; expected bytes as an int or '16GiB'")
    if isinstance(value, int):
        if value <= 0:
            raise HintError(f"{where}: memory={value!r}; expected a positive number of bytes")
        return value
    if isinstance(value, str):
        s = value.strip().lower().replace(" ", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num) :]
        if unit in _UNITS and num:
            try:
                n = float(num)
            except ValueError:
                pass
            else:
                if n > 0:
                    return int(n * _UNITS[unit])
    raise HintError(
        f"{where}: memory={value!r}; expected bytes as an int or a string like '16GiB', '512MB'"
    )


def get_shard_spec(cls: type) -> Optional[ShardSpec]:
    """The ``@shard`` spec declared on exactly this class (not inherited)."""
    return cls.__dict__.get(SHARD_ATTR)


def get_stage_spec(cls: type) -> Optional[StageSpec]:
    """The ``@stage`` spec declared on exactly this class (not inherited)."""
    return cls.__dict__.get(STAGE_ATTR)


def get_recompute(cls: type) -> bool:
    """Whether ``@checkpoint`` is declared on exactly this class (not inherited)."""
    return bool(cls.__dict__.get(RECOMPUTE_ATTR, False))


def recomputed_classes(model) -> set[type]:
    """The classes of ``model``'s modules that carry ``@checkpoint``."""
    return {type(m) for m in model.modules() if get_recompute(type(m))}


def stage_recompute(cls: type) -> bool:
    """Whether ``@stage(recompute=True)`` is on ``cls`` or a base class of it."""
    spec = next((s for c in cls.__mro__ if (s := get_stage_spec(c)) is not None), None)
    return spec is not None and spec.recompute


def path_matches(pattern: str, path: str) -> bool:
    """``*`` matches exactly one path component; ``**`` any number."""
    pat = pattern.split(".")
    parts = path.split(".")

    def go(i: int, j: int) -> bool:
        if i == len(pat):
            return j == len(parts)
        if pat[i] == "**":
            return any(go(i + 1, k) for k in range(j, len(parts) + 1))
        return j < len(parts) and fnmatch.fnmatchcase(parts[j], pat[i]) and go(i + 1, j + 1)

    return go(0, 0)


def resolve_external_hints(model, hints: dict[str, object]) -> dict[type, ShardSpec]:
    """Turn ``{"h.*.attn.c_attn": Col(chunks=3), "h.*.attn": Local("n_head")}``
    into one :class:`ShardSpec` per class of ``model``: the hints its source
    rewrite applies. See :func:`resolve_hints`."""
    return resolve_hints(model, hints)[0]


def resolve_hints(model, hints: dict[str, object]) -> tuple[dict[type, ShardSpec], dict[str, Spec]]:
    """Resolve module-path patterns against a built ``model``.

    A spec pattern names the submodule or parameter to shard; every pattern
    must match something. Returns ``(class_specs, path_specs)``:

    - ``path_specs``: every matched path and its spec (the truth: a layer
      converted after construction uses it, whatever its parent);
    - ``class_specs``: the specs the parent's *class* can carry, for rewriting
      its source: an entry given identically at every instance of the class
      in ``model``. An entry that differs between instances (x-transformers'
      ``nn.Sequential`` feed-forwards hinted at different indexes) or whose
      parent is a torch container stays path-only. ``Local(...)`` names change
      the class's forward, so they must be the same at every instance.
    """
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        raise HintError(f"hints need a built nn.Module, got {type(model).__name__}")
    modules = dict(model.named_modules())
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    paths: dict[str, Spec] = {}
    given: dict[str, str] = {}  # path -> the pattern that gave it its spec
    local: dict[str, tuple[str, ...]] = {}  # module path -> Local names
    for pattern, value in hints.items():
        if not isinstance(pattern, str):
            raise HintError(f"hints: key {pattern!r} must be a module-path pattern string")
        if isinstance(value, Local):
            hits = [p for p in modules if p and path_matches(pattern, p)]
            if not hits:
                raise HintError(_no_match(pattern, modules))
            for p in hits:
                local[p] = local.get(p, ()) + value.names
            continue
        _check_spec("hints", repr(pattern), value)
        if isinstance(value, Heads):  # names an argument of the module's forward
            owner, _, arg = pattern.rpartition(".")
            hits = [f"{p}.{arg}" for p in modules if p and path_matches(owner, p)]
        else:
            hits = [p for p in list(modules) + sorted(params) if p and path_matches(pattern, p)]
        if not hits:
            raise HintError(_no_match(pattern, modules))
        for p in hits:
            if p in paths and paths[p] != value:
                raise HintError(
                    f"hints: {given[p]!r} gives {p} {paths[p]!r} but {pattern!r} gives it "
                    f"{value!r}; make the patterns agree"
                )
            paths[p] = cast(Spec, value)  # _check_spec checked it
            given[p] = pattern
    instances: dict[type, list[str]] = {}
    for path, mod in modules.items():
        instances.setdefault(type(mod), []).append(path)
    per_parent: dict[str, dict[str, Spec]] = {}
    for p, value in paths.items():
        parent, _, attr = p.rpartition(".")
        per_parent.setdefault(parent, {})[attr] = value
    out: dict[type, ShardSpec] = {}
    for cls, where in instances.items():
        names = [tuple(dict.fromkeys(local.get(w, ()))) for w in where]
        if cls.__module__.split(".")[0] == "torch" and not any(names):
            continue  # torch's own (a container): its entries are converted by path
        at = [per_parent.get(w, {}) for w in where]  # each instance's entries
        specs = {k: v for k, v in at[0].items() if all(a.get(k) == v for a in at[1:])}
        if any(n != names[0] for n in names[1:]):
            odd = next(w for w, n in zip(where, names) if n != names[0])
            raise HintError(
                f"hints: instances of {cls.__name__} get different Local(...) sizes "
                f"({names[0]!r} at {where[0] or '<root>'}, "
                f"{names[where.index(odd)]!r} at {odd or '<root>'}); per-rank sizes change "
                f"the class's forward, so give every instance of {cls.__name__} the same ones"
            )
        if specs or names[0]:
            out[cls] = ShardSpec(specs, names[0])
    return out, paths


def _no_match(pattern: str, modules: dict) -> str:
    sample = [p for p in modules if p][:8]
    return (
        f"hints: pattern {pattern!r} matches no submodule or parameter; module paths look "
        f"like {sample}. '*' matches one path component, '**' any number"
    )


def hinted_paths(model, class_specs: dict[type, ShardSpec]) -> dict[str, Spec]:
    """Every entry of ``class_specs`` at the full path it applies to in
    ``model``: ``{"h.0.attn.c_attn": Col(chunks=3), ...}``. A name that is no
    child of its module but a key of one of its ``nn.ModuleDict`` children
    (nanoGPT's ``self.transformer = nn.ModuleDict(dict(wte=...))``) is found
    there."""
    import torch.nn as nn

    out: dict[str, Spec] = {}
    for path, mod in model.named_modules():
        spec = class_specs.get(type(mod))
        if spec is None:
            continue
        prefix = f"{path}." if path else ""
        for name, s in spec.specs.items():
            if name not in mod._modules and name not in mod._parameters:
                holder = next(
                    (
                        k
                        for k, c in mod.named_children()
                        if isinstance(c, nn.ModuleDict) and name in c
                    ),
                    None,
                )
                if holder is not None:
                    name = f"{holder}.{name}"
            out[prefix + name] = s
    return out
