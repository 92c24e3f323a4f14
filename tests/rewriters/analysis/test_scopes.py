"""annot.rewriters.analysis.scopes against libcst's own providers: on model files annot
did not write (HF GPT-2, Llama, T5, Bloom) and on this repository's, every
name read in every method has the qualified names libcst's
``QualifiedNameProvider`` gives it, and every name the expression context
``ExpressionContextProvider`` gives it; analysed one method at a time, as the
rewriters ask. And the other queries on small sources: the classes at any depth
with what encloses them, spans in statement order, ``global`` / ``nonlocal``
files, and the lazy analysis answering as the whole-file one."""

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

from annot.rewriters.analysis.scope_model import DEL, LOAD, STORE
from annot.rewriters.analysis.scopes import ModuleScopes

ROOT = Path(__file__).resolve().parents[3]
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
    assert seen > 100, bad
    assert not bad, bad


NESTED = """
import torch.nn as nn

class A(nn.Module):
    class Inner:
        pass

def make():
    class B(nn.Module):
        pass
    return B

if nn:
    class C(nn.Module):
        def forward(self, x):
            a = x + 1
            for i in range(3):
                a = a * i
            return a
try:
    class D:
        pass
except ImportError:
    class D:
        pass
"""


def test_classes_at_any_depth_with_what_encloses_them():
    module = cst.parse_module(NESTED)
    scopes = ModuleScopes(module, NESTED)
    by_name = {}
    for c in scopes.classes:
        by_name.setdefault(c.name.value, c)
    assert [c.name.value for c in scopes.classes] == ["A", "Inner", "B", "C", "D", "D"]
    assert scopes.enclosing(by_name["A"]) == ()
    assert [d.name.value for d in scopes.enclosing(by_name["Inner"])] == ["A"]
    assert [d.name.value for d in scopes.enclosing(by_name["B"])] == ["make"]
    assert scopes.enclosing(by_name["C"]) == ()  # an if is not a scope
    chain = scopes.ancestors(by_name["C"])
    assert chain[0] is module
    assert isinstance(chain[-1], cst.IndentedBlock)
    assert any(isinstance(n, cst.If) for n in chain)


def test_span_orders_the_statements_of_a_method():
    module = cst.parse_module(NESTED)
    scopes = ModuleScopes(module, NESTED)
    cls = next(c for c in scopes.classes if c.name.value == "C")
    forward = cls.body.body[0]
    line, loop, last = forward.body.body
    first, ret = line.body[0], last.body[0]  # `a = x + 1`, `return a`: small statements
    assert scopes.span(first) is None  # not analysed before prepare
    scopes.prepare(cls, forward)
    assert scopes.span(first)[1] <= scopes.span(loop)[0]
    assert scopes.span(loop)[1] <= scopes.span(ret)[0]
    returned = ret.value  # the Name `a` in `return a`
    start, end = scopes.span(ret)
    assert start <= scopes.span(returned)[0] < scopes.span(returned)[1] <= end
    assert scopes.parent(returned) is ret
    assert scopes.context(returned) == LOAD
    assert scopes.scope(returned) is scopes.scope(first.targets[0].target)


GLOBALS = """
import torch
import torch.nn as nn


def setup():
    global act  # the only binding of act: read in M.forward, analysed before
    act = torch.relu


def counter():
    n = 0
    def bump():
        nonlocal n
        n += 1
        return torch.tanh(n)
    return bump


class M(nn.Module):
    def forward(self, x):
        y = act(x) + nn.functional.gelu(x)
        del x
        return torch.sigmoid(y)
"""


def test_global_and_nonlocal_resolve_as_libcst_resolves_them(tmp_path):
    """A file with ``global`` or ``nonlocal`` is analysed whole (those statements
    add names to scopes analysed before); the answers are still libcst's."""
    path = tmp_path / "globals.py"
    path.write_text(GLOBALS * 20)
    seen, bad = _mismatches(path)
    assert seen > 100, bad
    assert not bad, bad
    names = _names(GLOBALS, "M", "forward")
    assert names["torch.sigmoid"] == {"torch.sigmoid"}
    assert names["nn.functional.gelu"] == {"torch.nn.functional.gelu"}
    assert names["act"] == {"act"}  # bound by setup's global statement, nowhere else


def test_one_method_at_a_time_answers_as_the_whole_file():
    """Analysed lazily (the source text given: one unit at a time) or at once
    (no text), every name in every method gets the same qualified names and
    expression context."""
    text = (ROOT / "examples/gpt/model.py").read_text()
    lazy = ModuleScopes(cst.parse_module(text), text)
    module = cst.parse_module(text)
    whole = ModuleScopes(module)
    compared = 0
    for lazy_cls, cls in zip(lazy.classes, whole.classes):
        methods = [m for m in cls.body.body if isinstance(m, cst.FunctionDef)]
        lazy_methods = [m for m in lazy_cls.body.body if isinstance(m, cst.FunctionDef)]
        for lazy_fn, fn in zip(lazy_methods, methods):
            lazy.prepare(lazy_cls, lazy_fn)
            ours, theirs = _Names(), _Names()
            lazy_fn.body.visit(ours)
            fn.body.visit(theirs)
            for a, b in zip(ours.found, theirs.found):
                assert a.value == b.value
                assert lazy.context(a) == whole.context(b), a.value
                assert lazy.qualified_names(a) == whole.qualified_names(b), a.value
                compared += 1
    assert compared > 100
