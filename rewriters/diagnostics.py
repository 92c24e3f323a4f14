"""Shared helpers for every rewriter: parse with positions, refuse with
``file:line:col``, show a unified diff.

A rewriter never returns partial output: it raises :class:`RewriteError`
instead, built here so that every refusal has the same shape::

    locate = Locator(wrapper, path)          # wrapper: libcst MetadataWrapper
    raise locate.error(node, "Col() applies to nn.Linear; ...")

Positions are 1-based lines and 1-based columns (what editors, ruff and
Python's own ``SyntaxError`` use), taken from libcst's ``PositionProvider``.
"""

from __future__ import annotations

import ast
import difflib
import re
from typing import Union

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from annot.errors import RewriteError

__all__ = [
    "Locator",
    "error_at",
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

    ``Locator(wrapper, path).error(node, reason)`` returns (does not raise) a
    ``RewriteError`` at ``node``'s first character. Nodes must come from
    ``wrapper.module`` (the tree the metadata was computed on).
    """

    def __init__(self, wrapper: MetadataWrapper, path: str = "<string>") -> None:
        self.path = path
        self._positions = wrapper.resolve(PositionProvider)

    def position(self, node: cst.CSTNode) -> CodeRange | None:
        """The code range of ``node``, or None for a node not in the module."""
        return self._positions.get(node)

    def line(self, node: cst.CSTNode) -> int:
        pos = self.position(node)
        return pos.start.line if pos is not None else 0

    def error(self, node: cst.CSTNode, reason: str) -> RewriteError:
        return error_at(reason, self.position(node), self.path)


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
