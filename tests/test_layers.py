"""annot's layers, read off the imports (DESIGN.md, "Layout"): a vocabulary
that imports nothing else of annot; rewriters and runtime above it, neither
importing the other; the orchestration on top. Everything installs under the
one ``annot`` namespace, and no module imports another's private names."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder in the repository -> package it installs as (pyproject's package-dir)
PACKAGES = {
    "annot": "annot",
    "rewriters": "annot.rewriters",
    "runtime": "annot.runtime",
}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if folder == "annot" and parts[0] in ("rewriters", "runtime"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every absolute import, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [a.name for a in node.names]
            # `from annot import runtime` imports the subpackage, not a name
            for n in names:
                if f"{node.module}.{n}" in MODULES or f"{node.module}.{n}" in PACKAGES.values():
                    found.append((node.lineno, f"{node.module}.{n}", []))
            found.append((node.lineno, node.module, names))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
    return found


def layer(module: str) -> str:
    if module == "annot" or module == "annot.core" or module.startswith("annot.core."):
        return "vocabulary"  # annot/__init__ re-exports it; the rest loads lazily
    for package in ("annot.rewriters", "annot.runtime"):
        if module == package or module.startswith(package + "."):
            return package.split(".")[1]
    return "orchestration"


ALLOWED = {
    "vocabulary": {"vocabulary"},
    "rewriters": {"vocabulary", "rewriters"},
    "runtime": {"vocabulary", "runtime"},
    "orchestration": {"vocabulary", "rewriters", "runtime", "orchestration"},
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layers(module):
    path = MODULES[module]
    mine = layer(module)
    bad = []
    for line, target, names in _imports(path):
        top = target.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line}"
        if top in ("runtime", "rewriters"):
            bad.append(f"{where}: imports {target!r}; it installs as 'annot.{target}'")
        if top != "annot":
            continue
        theirs = layer(target)
        if theirs not in ALLOWED[mine]:
            bad.append(f"{where}: {mine} module imports {target} ({theirs})")
        private = [n for n in names if n.startswith("_")]
        if private and target != module:
            bad.append(f"{where}: imports private names {private} from {target}")
    assert not bad, "\n".join(bad)


def test_every_module_is_in_a_layer():
    """The vocabulary is the annot.core subpackage, importing nothing above it,
    and each package has its modules."""
    assert {m for m in MODULES if layer(m) == "vocabulary"} >= {
        "annot.core.errors",
        "annot.core.specs",
        "annot.core.hints",
        "annot.core.mesh",
    }
    top = [m for m, path in MODULES.items() if path.parent == ROOT / "annot" and m != "annot"]
    assert top
    assert all(layer(m) == "orchestration" for m in top)
    assert {layer(m) for m in MODULES} == set(ALLOWED)


def test_the_installed_names_are_under_annot():
    """What the package installs: only ``annot`` at the top, and the source
    annot generates imports from ``annot.runtime``."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {p.split(".")[0] for p in config["packages"]} == {"annot"}
    assert config["package-dir"] == {"annot.rewriters": "rewriters", "annot.runtime": "runtime"}

    from annot.rewriters.tp.rewrite import rewrite_tensor_parallel

    src = (
        "import torch.nn as nn\nfrom annot import shard, Col, Row\n\n"
        "@shard(fc1=Col(), fc2=Row())\nclass MLP(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.fc1 = nn.Linear(4, 8)\n        self.fc2 = nn.Linear(8, 4)\n"
    )
    out = rewrite_tensor_parallel(src, tp=2)
    assert "from annot.runtime.tp.layers import" in out
    assert "\nfrom runtime" not in out


# Tests mirror the layout: tests/<folder>/test_<name>.py tests the module <name>
# of the package in that folder (or a topic of it: test_<module>_<topic>.py).
def source_folder(tests_folder: str) -> str:
    """tests/ mirrors annot/; tests/rewriters/... and tests/runtime/... mirror the
    folders installed as annot.rewriters and annot.runtime."""
    parts = tests_folder.split("/")[1:]
    if parts and parts[0] in ("rewriters", "runtime"):
        return "/".join(parts)
    return "/".join(["annot", *parts])


# folders of tests that span the layers, and top-level files that do
CROSS_MODULE_FOLDERS = {"tests/e2e", "tests/fixtures"}
CROSS_MODULE = {
    "tests/test_errors.py": "the errors users see, raised by every layer before any rank works",
    "tests/test_examples.py": "examples/ run against their single-device models",
    "tests/test_external_hints.py": "hints from outside: hint_checks, build and hf together",
    "tests/test_fsdp.py": "parallelize(fsdp=True) composed with tp and pp",
    "tests/test_fuzz_structures.py": "the fuzzer of model structures, through every layer",
    "tests/test_layers.py": "the layers, read off every module's imports",
    "tests/plan/test_memory_model.py": "planner and runtime.memory_model on the meta device",
    "tests/test_printed_stages.py": "what `annot rewrite --pp` prints, run on ranks",
    "tests/test_readme.py": "the README's commands and code, run as written",
    "tests/test_runners.py": "the two stage runners on one plan, through build and explain",
}


def test_tests_mirror_the_layout():
    """Every test_*.py names a module of the package its folder mirrors, or is
    listed as a test that spans modules."""
    wrong = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT)
        folder, name = rel.parent.as_posix(), path.stem.removeprefix("test_")
        if rel.as_posix() in CROSS_MODULE or folder in CROSS_MODULE_FOLDERS:
            continue
        source = source_folder(folder)
        if not (ROOT / source / "__init__.py").exists():
            wrong.append(f"{rel}: {folder} mirrors {source}/, which is not a package")
            continue
        modules = {p.stem for p in (ROOT / source).glob("*.py")}
        if not any(name == m or name.startswith(f"{m}_") for m in modules):
            wrong.append(
                f"{rel}: no module {source}/{name}.py; name the file after the "
                "module it tests (test_<module>.py or test_<module>_<topic>.py), or list it in "
                "CROSS_MODULE with the reason it spans modules"
            )
    assert not wrong, "\n".join(wrong)


def _runtime_imports(module: str) -> set[str]:
    """The annot modules ``module`` imports at run time, at any depth (a
    function's lazy import counts; an ``if TYPE_CHECKING:`` block does not)."""
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in MODULES and m != module}


def unit(module: str) -> str:
    """The folder a module belongs to (``annot.runtime.tp``), or the module
    itself where it sits at the top of annot, annot.runtime or annot.rewriters."""
    parts = module.split(".")
    if module == "annot" or parts[1] == "core":
        return "annot.core"
    depth = 3 if parts[1] in ("runtime", "rewriters") else 2
    return ".".join(parts[:depth])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_modules():
    graph = {m: _runtime_imports(m) for m in MODULES}
    assert _cycles(graph) == [], "import cycles between modules"


def test_no_import_cycles_between_folders():
    """The folders form layers: none imports, at any depth, from a folder that
    imports it back. A package's ``__init__`` is its public face (``annot.hf``
    loads the Trainer from annot.integrations on first use) and is left out."""
    graph: dict[str, set[str]] = {}
    for m, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        graph.setdefault(unit(m), set()).update(
            unit(t) for t in _runtime_imports(m) if unit(t) != unit(m)
        )
    assert _cycles(graph) == [], "import cycles between folders"


def test_a_cycle_between_folders_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _code_lines(node: ast.AST) -> int:
    """A function's lines without its docstring."""
    body = node.body  # type: ignore[attr-defined]
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def test_modules_and_functions_stay_short():
    """A module is one idea (at most 600 lines); a function reads on a screen or
    two (at most 100 lines of code); ``parallelize`` is its named steps (60)."""
    long = []
    for module, path in MODULES.items():
        source = path.read_text()
        if len(source.splitlines()) > 600:
            long.append(f"{path.relative_to(ROOT)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = (
                    60 if (module, node.name) == ("annot.build.parallelize", "parallelize") else 100
                )
                if _code_lines(node) > limit:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    long.append(f"{where} {node.name}: {_code_lines(node)} lines (limit {limit})")
    assert not long, "\n".join(long)
