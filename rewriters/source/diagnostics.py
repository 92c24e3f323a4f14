"""Shared helpers for every rewriter: parse with positions, refuse with
``file:line:col``, walk a tree fast, show a unified diff.

A rewriter never returns partial output: it raises :class:`RewriteError`
instead, built here so that every refusal has the same shape::

    locate = Locator(module, path)           # a libcst Module or MetadataWrapper
    raise locate.error(node, "Col() applies to nn.Linear; ...")

Positions are 1-based lines and 1-based columns (what editors, ruff and
Python's own ``SyntaxError`` use), taken from libcst's ``PositionProvider``,
computed only when the first position is asked for (a refusal): on a large
file that pass costs more than parsing it.

:func:`children` is libcst's ``node.children`` without the formatting
(whitespace, commas, parentheses, operators), in the same source order, and
several times faster per node (libcst's runs a visitor over the node).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import operator
import re
from collections.abc import Callable, Mapping
from typing import Union

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from annot.core.errors import RewriteError

__all__ = [
    "Locator",
    "children",
    "error_at",
    "is_a",
    "node_source",
    "parse_source",
    "syntax_error",
    "unified_diff",
]

Source = Union[str, bytes]

_EMPTY = cst.Module(body=[])


def syntax_error(
    exc: cst.ParserSyntaxError, path: str = "<string>", source: Source | None = None
) -> RewriteError:
    """Turn libcst's ``ParserSyntaxError`` into a ``RewriteError`` at its position.

    Given the ``source``, Python's own compiler is asked too: its position and
    message are usually the more precise (libcst often points past the error).
    """
    if source is not None:
        try:
            compile(source, path, "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
        except SyntaxError as py:
            if py.lineno:
                return RewriteError(
                    f"syntax error: {py.msg}; annot rewrites only code Python can parse",
                    path,
                    py.lineno,
                    py.offset or 1,
                )
        except (ValueError, UnicodeDecodeError):
            pass
    message = re.sub(r"^parser error: error at \d+:\d+: ", "", exc.message)
    return RewriteError(
        f"syntax error: {message}; annot rewrites only code Python can parse",
        path,
        exc.editor_line,
        exc.editor_column,
    )


def parse_source(source: Source, path: str = "<string>") -> cst.Module:
    """Parse ``source`` (text, or bytes honouring its coding cookie / BOM) into a
    libcst ``Module``; every parse failure becomes a ``RewriteError``.

    Parse bytes when the result must be written back byte for byte
    (``Module.bytes`` keeps the encoding, the BOM and the line endings).
    """
    try:
        return cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        raise syntax_error(exc, path, source) from None
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        # bad coding cookie or bytes that do not decode
        line = getattr(exc, "lineno", None) or 1
        raise RewriteError(
            f"cannot decode the file: {exc}; save it as UTF-8 or fix its coding declaration",
            path,
            line,
            1,
        ) from None


def error_at(reason: str, where: CodeRange | None, path: str = "<string>") -> RewriteError:
    """A ``RewriteError`` at the start of ``where`` (or ``path:0:0`` when unknown)."""
    if where is None:
        return RewriteError(reason, path, 0, 0)
    return RewriteError(reason, path, where.start.line, where.start.column + 1)


def node_source(node: cst.CSTNode) -> str:
    """The source text of ``node`` as written (for error messages)."""
    return _EMPTY.code_for_node(node)


class Locator:
    """Positions of the nodes of one parsed module, for refusals.

    ``Locator(module, path).error(node, reason)`` returns (does not raise) a
    ``RewriteError`` at ``node``'s first character. Nodes must come from that
    module (``wrapper.module`` for a ``MetadataWrapper``). Positions are
    computed on the first call, over the whole module.
    """

    def __init__(self, tree: Union[cst.Module, MetadataWrapper], path: str = "<string>") -> None:
        self.path = path
        self._tree = tree
        self._positions: Mapping[cst.CSTNode, CodeRange] | None = None

    def position(self, node: cst.CSTNode) -> CodeRange | None:
        """The code range of ``node``, or None for a node not in the module."""
        if self._positions is None:
            wrapper = self._tree
            if isinstance(wrapper, cst.Module):  # the tree is not copied: nodes keep their identity
                wrapper = MetadataWrapper(wrapper, unsafe_skip_copy=True)
            self._positions = wrapper.resolve(PositionProvider)
        return self._positions.get(node)

    def line(self, node: cst.CSTNode) -> int:
        pos = self.position(node)
        return pos.start.line if pos is not None else 0

    def error(self, node: cst.CSTNode, reason: str) -> RewriteError:
        return error_at(reason, self.position(node), self.path)


# Fields that hold only formatting, and the few node types whose fields are
# not declared in source order (libcst's codegen order).
_FORMATTING = frozenset(
    {
        "lpar", "rpar", "comma", "leading_lines", "lines_after_decorators", "semicolon",
        "header", "footer", "equal", "lbracket", "rbracket", "lbrace", "rbrace", "colon",
        "first_colon", "second_colon", "trailing_whitespace", "newline", "dot", "operator",
        "asynchronous", "relative", "posonly_ind", "separator", "trailing_comma", "star",
        "indent", "encoding", "default_indent", "default_newline", "has_trailing_newline",
    }
)  # fmt: skip
_SOURCE_ORDER: dict[type, tuple[str, ...]] = {
    cst.Arg: ("keyword", "value"),
    cst.ClassDef: ("decorators", "name", "type_parameters", "bases", "keywords", "body"),
    cst.FunctionDef: ("decorators", "name", "type_parameters", "params", "returns", "body"),
    cst.ExceptHandler: ("type", "name", "body"),
    cst.ExceptStarHandler: ("type", "name", "body"),
    cst.IfExp: ("body", "test", "orelse"),
    cst.Parameters: ("posonly_params", "params", "star_arg", "kwonly_params", "star_kwarg"),
    cst.MatchCase: ("pattern", "guard", "body"),
    cst.TypeAlias: ("name", "type_parameters", "value"),
}
_FIELDS: dict[type, Callable[[cst.CSTNode], tuple]] = {}
_IS_NODE: dict[type, bool] = {}  # isinstance(x, CSTNode) is an ABC check: slow


def _fields(kind: type) -> Callable[[cst.CSTNode], tuple]:
    names = _SOURCE_ORDER.get(kind)
    if names is None:
        names = tuple(
            f.name
            for f in dataclasses.fields(kind)
            if f.name not in _FORMATTING and "whitespace" not in f.name
        )
    get: Callable[[cst.CSTNode], tuple]
    if len(names) > 1:
        get = operator.attrgetter(*names)
    elif names:
        one = operator.attrgetter(names[0])
        get = lambda node: (one(node),)  # noqa: E731
    else:
        get = lambda node: ()  # noqa: E731
    _FIELDS[kind] = get
    return get


_KINDS: dict[tuple[type, tuple[type, ...]], bool] = {}


def is_a(node: cst.CSTNode, kinds: tuple[type, ...]) -> bool:
    """``isinstance(node, kinds)``, cached by the node's type (for walks:
    libcst's node classes are ABCs, and isinstance on them is slow)."""
    key = (type(node), kinds)
    found = _KINDS.get(key)
    if found is None:
        found = _KINDS[key] = isinstance(node, kinds)
    return found


def children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The child nodes of ``node`` in source order, formatting left out
    (whitespace, comments, commas, parentheses, brackets, operators, colons)."""
    out: list[cst.CSTNode] = []
    kind = type(node)
    for value in (_FIELDS.get(kind) or _fields(kind))(node):
        vkind = type(value)
        if vkind is tuple or vkind is list:
            out.extend(value)  # libcst's sequence fields hold nodes only
            continue
        is_node = _IS_NODE.get(vkind)
        if is_node is None:
            is_node = _IS_NODE[vkind] = issubclass(vkind, cst.CSTNode)
        if is_node:
            out.append(value)
    return out


def unified_diff(before: str, after: str, path: str, label: str = "annot") -> str:
    """A unified diff like ``black --diff``: ``--- PATH`` / ``+++ PATH (LABEL)``.

    Returns ``""`` when nothing changed. Lines without a final newline get the
    ``\\ No newline at end of file`` marker so the diff applies with ``patch``.
    """
    if before == after:
        return ""
    a = before.splitlines(keepends=True)
    b = after.splitlines(keepends=True)
    out = []
    for line in difflib.unified_diff(a, b, fromfile=path, tofile=f"{path} ({label})", n=3):
        out.append(line)
        if not line.endswith(("\n", "\r")):
            out.append("\n\\ No newline at end of file\n")
    return "".join(out)
