"""What the ``annot`` commands build from their arguments: the model
(``FILE:CLASS`` or an installed module, ``--init EXPR``, ``--config-json``),
sample inputs for its forward (``--input NAME=DTYPE[SHAPE][:HIGH]``) and the
parallel degrees (``--tp N``, ``--pp N``).

``--init`` is parsed, never ``eval``-ed: it may call only classes and
functions defined in FILE, with literal arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, Optional

__all__ = [
    "Refusal",
    "add_target_arguments",
    "build_model",
    "degree",
    "describe",
    "import_target",
    "parse_inputs",
    "target_model",
]


class Refusal(Exception):
    """A command-line mistake: printed as ``annot <command>: <message>``, exit 2."""


def degree(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "float64": "float64",
    "double": "float64",
    "int64": "int64",
    "long": "int64",
    "int32": "int32",
    "int": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
}

_INPUT = re.compile(
    r"^(?P<name>[A-Za-z_]\w*)=(?P<dtype>\w+)\[(?P<shape>[\d,\s]*)\]"
    r"(?::(?:(?P<label>[A-Za-z_]\w*)=)?(?P<high>\d+))?$"
)


def _import_file(path: str):
    """FILE as a fresh module (its top-level code runs), registered in sys.modules."""
    import hashlib
    import importlib.util

    if not os.path.isfile(path):
        raise Refusal(f"{path}: no such file")
    real = os.path.realpath(path)
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(real))[0])
    name = f"annot_plan_{stem}_{hashlib.sha256(real.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, real)
    if spec is None or spec.loader is None:
        raise Refusal(f"{path}: cannot import it as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = os.path.dirname(real)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file: whatever it raises is refused
        sys.modules.pop(name, None)
        raise Refusal(f"{path}: importing it raised {describe(exc)}") from None
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    return module


def import_target(path: str):
    """FILE, or an installed module by its dotted name
    (``transformers.models.llama.modeling_llama``): its source is read, never
    written."""
    import importlib

    if os.path.isfile(path) or path.endswith(".py"):
        return _import_file(path)
    try:
        return importlib.import_module(path)
    except ImportError as exc:
        raise Refusal(f"{path}: no such file, and importing it as a module failed: {exc}") from None


def describe(exc: BaseException) -> str:
    """``TypeError: message (at model.py:12)``: the innermost frame of the
    user's code (not of torch or annot); in a planned stage, its line."""
    import traceback

    import annot

    root = os.path.dirname(os.path.dirname(os.path.abspath(annot.__file__)))
    skip = [os.path.join(root, pkg) + os.sep for pkg in ("annot", "runtime", "rewriters")]
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if torch_file:
        skip.append(os.path.dirname(os.path.abspath(torch_file)) + os.sep)
    frames = traceback.extract_tb(exc.__traceback__)
    theirs = [f for f in frames if not os.path.abspath(f.filename).startswith(tuple(skip))]
    chosen = theirs or frames
    frame = chosen[-1] if chosen else None
    if frame is None:
        where = ""
    elif frame.filename.startswith("<annot plan"):
        where = f" (in forward, at `{(frame.line or '').strip()}`)"
    else:
        where = f" (at {frame.filename}:{frame.lineno})"
    return f"{type(exc).__name__}: {exc}{where}"


def _defined_names(module) -> set[str]:
    """Classes and functions defined by top-level statements of the module's file
    (and still bound to them): what --init may call."""
    import ast

    with open(module.__file__, "rb") as f:
        tree = ast.parse(f.read(), module.__file__)
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    return {
        n for n in names if getattr(getattr(module, n, None), "__module__", None) == module.__name__
    }


def _literal(node, text: str):
    import ast

    try:
        return ast.literal_eval(node)
    except ValueError:
        raise Refusal(
            f"--init {text!r}: {ast.unparse(node)!r} is not a literal; arguments may be "
            "numbers, strings, True/False/None, tuples, lists, dicts, or calls of classes "
            "defined in FILE"
        ) from None


def _init_value(node, module, allowed: set[str], text: str):
    """Evaluate a checked --init node: calls of allowed names, literal arguments."""
    import ast

    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name):
            raise Refusal(
                f"--init {text!r}: refused {ast.unparse(node.func)!r}: --init may only call "
                "classes and functions defined at the top level of FILE, by their plain name "
                f"({', '.join(sorted(allowed)) or 'FILE defines none'})"
            )
        if node.func.id not in allowed:
            raise Refusal(
                f"--init {text!r}: refused {node.func.id!r}: it is not a class or function "
                f"defined in FILE; --init may call {', '.join(sorted(allowed)) or 'nothing'}"
            )
        if any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords
        ):
            raise Refusal(f"--init {text!r}: *args and **kwargs are not accepted")
        args = [_init_value(a, module, allowed, text) for a in node.args]
        kwargs = {
            k.arg: _init_value(k.value, module, allowed, text)
            for k in node.keywords
            if k.arg is not None  # none is: **kwargs was refused above
        }
        return getattr(module, node.func.id)(*args, **kwargs)
    return _literal(node, text)


def _check_tree(root, allowed: set[str], text: str) -> None:
    """Refuse, before anything is called, any call that is not of an allowed name."""
    import ast

    for node in ast.walk(root):
        if isinstance(node, ast.Call) and not (
            isinstance(node.func, ast.Name) and node.func.id in allowed
        ):
            raise Refusal(
                f"--init {text!r}: refused {ast.unparse(node.func)!r}: --init may only call "
                "classes and functions defined at the top level of FILE "
                f"({', '.join(sorted(allowed)) or 'FILE defines none'})"
            )
        if isinstance(node, (ast.Lambda, ast.NamedExpr, ast.Attribute, ast.Subscript)):
            raise Refusal(
                f"--init {text!r}: {ast.unparse(node)!r} is not accepted; use calls of "
                "classes defined in FILE with literal arguments"
            )


def _config_json(text: str) -> dict:
    import json

    raw = text
    if not text.lstrip().startswith("{"):
        try:
            with open(text, encoding="utf-8") as f:
                raw = f.read()
        except OSError as exc:
            raise Refusal(f"--config-json {text}: cannot read: {exc.strerror or exc}") from None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise Refusal(f"--config-json: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise Refusal("--config-json: expected a JSON object of keyword arguments")
    return value


def add_target_arguments(p) -> None:
    """``FILE:CLASS``, ``--init`` and ``--config-json``: how a command names and
    builds the model (``annot verify``, ``annot hints``)."""
    p.add_argument("target", metavar="FILE:CLASS", help="the model file (or module) and class")
    p.add_argument("--init", metavar="EXPR", help="how to build the model (as annot plan)")
    p.add_argument("--config-json", metavar="JSON", help="keyword arguments as a JSON object")


def target_model(target: str, init: Optional[str], config: Optional[str]):
    """``(class, model)`` for ``FILE:CLASS`` built as ``--init`` / ``--config-json`` say."""
    path, _, name = target.rpartition(":")
    module = import_target(path)
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise Refusal(f"{path} defines no class {name!r}")
    return cls, build_model(module, cls, init, config)


def build_model(module, cls: type, init: Optional[str], config: Optional[str]):
    import ast

    kwargs = _config_json(config) if config is not None else None
    allowed = _defined_names(module)
    if init is None:
        config_class = getattr(cls, "config_class", None)  # a transformers model
        if isinstance(config_class, type):
            return cls(config_class(**(kwargs or {})))
        return cls(**(kwargs or {}))
    try:
        tree = ast.parse(init.strip(), mode="eval").body
    except SyntaxError as exc:
        raise Refusal(f"--init {init!r}: not a Python expression: {exc.msg}") from None
    _check_tree(tree, allowed, init)
    if isinstance(tree, ast.Name):  # --init GPTConfig [--config-json ...]
        if tree.id not in allowed:
            raise Refusal(
                f"--init {init!r}: {tree.id!r} is not a class or function defined in FILE; "
                f"--init may call {', '.join(sorted(allowed)) or 'nothing'}"
            )
        value = getattr(module, tree.id)(**(kwargs or {}))
    elif isinstance(tree, ast.Call):
        if kwargs is not None:
            raise Refusal(
                "--init with a call and --config-json both give arguments; use --init NAME "
                "--config-json JSON, or put the arguments in the --init call"
            )
        value = _init_value(tree, module, allowed, init)
    else:
        raise Refusal(
            f"--init {init!r}: expected a call such as 'Config(n_layer=8)' or a class name"
        )
    return value if isinstance(value, cls) else cls(value)


def parse_inputs(specs: Sequence[str], cls: type[Any]) -> Optional[dict]:
    import inspect

    import torch

    if not specs:
        return None
    sig = inspect.signature(cls.forward)
    params = list(sig.parameters.values())[1:]
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    open_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    sample: dict = {}
    for spec in specs:
        m = _INPUT.match(spec.strip())
        if m is None:
            raise Refusal(
                f"--input {spec!r}: expected NAME=DTYPE[D0,D1,...] with an optional :HIGH for "
                "ints, e.g. x=float32[4,16] or idx=int64[8,256]:vocab=50304"
            )
        name, dtype = m["name"], _DTYPES.get(m["dtype"].lower())
        if dtype is None:
            raise Refusal(
                f"--input {spec!r}: unknown dtype {m['dtype']!r}; expected one of "
                f"{', '.join(sorted(set(_DTYPES.values())))}"
            )
        if name not in named and not open_kw:
            raise Refusal(
                f"--input {spec!r}: {cls.__name__}.forward has no argument {name!r}; its "
                f"arguments: {', '.join(p.name for p in params) or 'none'}"
            )
        if name in sample:
            raise Refusal(f"--input {name}= is given twice")
        shape = [int(d) for d in m["shape"].replace(" ", "").split(",") if d]
        dt = getattr(torch, dtype)
        high = int(m["high"]) if m["high"] else None
        if dt.is_floating_point:
            if high is not None:
                raise Refusal(f"--input {spec!r}: a range (:{high}) is for integer inputs")
            sample[name] = torch.randn(shape, dtype=dt)
        elif dt is torch.bool:
            sample[name] = torch.randint(0, 2, shape).bool()
        else:
            if high is not None and high < 1:
                raise Refusal(f"--input {spec!r}: HIGH must be >= 1 (ints in [0, HIGH))")
            sample[name] = torch.randint(0, high or 2, shape, dtype=dt)
    missing = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name not in sample
    ]
    if missing:
        raise Refusal(
            f"{cls.__name__}.forward needs {', '.join(missing)}: add --input "
            + " --input ".join(f"{n}=DTYPE[SHAPE]" for n in missing)
        )
    return sample
