"""annot.rewriters.scopes against libcst's own providers: on model files annot
did not write (HF GPT-2, Llama, T5, Bloom) and on this repository's, every
name read in every method has the qualified names libcst's
``QualifiedNameProvider`` gives it, and every name the expression context
``ExpressionContextProvider`` gives it; analysed one method at a time, as the
rewriters ask."""

from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import (
    ExpressionContext,
    ExpressionContextProvider,
    MetadataWrapper,
    ParentNodeProvider,
    QualifiedNameProvider,
)

from annot.rewriters.scope_model import DEL, LOAD, STORE
from annot.rewriters.scopes import ModuleScopes

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = {ExpressionContext.LOAD: LOAD, ExpressionContext.STORE: STORE, ExpressionContext.DEL: DEL}


def _sources() -> list:
    files = [ROOT / "examples/gpt/model.py", ROOT / "tests/layer_styles_models.py"]
    try:
        import transformers
    except ImportError:
        return files
    models = Path(transformers.__file__).parent / "models"
    names = ("gpt2/modeling_gpt2", "llama/modeling_llama", "t5/modeling_t5", "bloom/modeling_bloom")
    return files + [models / f"{n}.py" for n in names]


class _Names(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[cst.Name] = []

    def visit_Name(self, node: cst.Name) -> None:
        self.found.append(node)


def _value(v):
    return v() if callable(v) else v  # libcst's lazy metadata values


def _mismatches(path: Path) -> tuple[int, list[str]]:
    text = path.read_text()
    module = cst.parse_module(text)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    qualified = wrapper.resolve(QualifiedNameProvider)
    contexts = wrapper.resolve(ExpressionContextProvider)
    parents = wrapper.resolve(ParentNodeProvider)
    scopes = ModuleScopes(module, text)
    seen, bad = 0, []

    for cls in scopes.classes:
        for method in cls.body.body:
            if not isinstance(method, cst.FunctionDef):
                continue
            scopes.prepare(cls, method)
            names = _Names()
            method.body.visit(names)
            for node in names.found:
                parent = parents[node]
                if isinstance(parent, (cst.FunctionDef, cst.ClassDef)) or (
                    isinstance(parent, cst.Arg) and parent.keyword is node
                ):
                    continue  # not expressions: a def's own name, a keyword's name
                seen += 1
                theirs = frozenset(q.name for q in _value(qualified.get(node, ())))
                context = CONTEXT.get(_value(contexts.get(node)))
                # scopes answers for a name read where no function rebinds it
                local = any("<locals>" in q or q.startswith(f"{cls.name.value}.") for q in theirs)
                where = f"{path.name}:{cls.name.value}.{method.name.value}: {node.value}"
                if context == LOAD and not local and scopes.qualified_names(node) != theirs:
                    bad.append(
                        f"{where}: {sorted(scopes.qualified_names(node))} != {sorted(theirs)}"
                    )
                if scopes.context(node) != context:
                    bad.append(f"{where}: context {scopes.context(node)} != {context}")
    return seen, bad


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_names_resolve_as_libcst_resolves_them(path):
    seen, bad = _mismatches(path)
    assert seen > 100, f"only {seen} names were compared in {path}"
    assert not bad, "\n".join(bad[:20])


CASES = """
import torch.nn as nn
from torch import nn as tnn
import torch.nn.functional as F

Linear = nn.Linear
alias = tnn


class Block(nn.Module):
    layer = nn.Linear  # a class-level name: not visible from the methods

    def forward(self, x):
        y = [F.relu(v) for v in x]
        layer = Linear(4, 4)
        f = lambda t: alias.GELU()(t)
        return layer, f, y, nn.functional.gelu
"""


def _names(source: str, cls: str, method: str) -> dict[str, frozenset[str]]:
    module = cst.parse_module(source)
    scopes = ModuleScopes(module, source)
    klass = next(c for c in scopes.classes if c.name.value == cls)
    fn = next(
        s for s in klass.body.body if isinstance(s, cst.FunctionDef) and s.name.value == method
    )
    scopes.prepare(klass, fn)
    out: dict[str, frozenset[str]] = {}

    class Reads(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> None:
            out[cst.Module([]).code_for_node(node)] = scopes.qualified_names(node)

        def visit_Name(self, node: cst.Name) -> None:
            if scopes.context(node) == LOAD:
                out.setdefault(node.value, scopes.qualified_names(node))

    fn.body.visit(Reads())
    return out


def test_aliases_comprehensions_lambdas_and_class_scope(tmp_path):
    names = _names(CASES, "Block", "forward")
    assert names["F.relu"] == {"torch.nn.functional.relu"}  # inside a comprehension
    assert names["nn.functional.gelu"] == {"torch.nn.functional.gelu"}
    assert names["Linear"] == {"Linear"}  # an assigned name is its own (libcst's rule)
    path = tmp_path / "cases.py"
    path.write_text(CASES * 40)  # the same corners, enough names to compare
    seen, bad = _mismatches(path)
    assert seen > 100 and not bad, bad
