"""Tensor-parallel hints read off one ``forward``: the flow of each Linear's
output through the source, as a person reads an attention or an MLP.

- A Linear whose output is reshaped into heads (``q.view(B, T, self.n_head,
  -1)``, ``rearrange(q, "b n (h d) -> b h n d", h=h)``), or split first into
  equal parts (``qkv(x).split(self.dim, -1)``: ``Col(chunks=3)``), is
  column-parallel: each rank computes its own heads.
- The Linear that takes those heads merged back (``y.transpose(1, 2).reshape(B,
  T, -1)``) is row-parallel: its output is summed over the ranks.
- An MLP: a Linear whose output reaches another Linear through element-wise
  steps only (an activation, a gate's product, dropout) is column-parallel, the
  second row-parallel.
- The names the reshapes, splits and merges read for head counts and widths
  (``self.n_head``, ``self.config.num_heads``, a local ``C``) hold per-rank
  sizes at tp: ``Local(...)``. A module with weights applied per head (a
  ``q_norm`` over the head dim) gets partial gradients: ``Replicate(sum_grad=True)``.

What the reading cannot follow (a column output returned, stored, given to a
function it does not know, normalized over its sharded width, a raw parameter
read with the heads) leaves the Linears whose outputs meet it whole, with the
reason in :attr:`Flow.notes`: never a guessed split. The build checks what is
found (:mod:`annot.build.inferred_hints`).

    flow = read_flow(source_of_forward, Children(linears={"qkv", "out"}))
    flow.specs   # {"qkv": Col(chunks=3), "out": Row()}
    flow.local   # ("num_heads", "dim")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import libcst as cst

from annot.core.specs import Col, Replicate, Row
from annot.rewriters.analysis.flow_values import (
    CLEAN,
    COLUMNS,
    ELEMENTWISE,
    ELEMENTWISE_METHODS,
    HEADS,
    MERGED,
    METADATA,
    RESHAPES,
    SPLITS,
    Children,
    Flow,
    Split,
    Val,
    Value,
    flat,
)
from annot.rewriters.analysis.method_syntax import (
    Method,
    comprehensions,
    last_name,
    literal_length,
    params_of,
    parse_method,
    self_path,
    subexpressions,
)
from annot.rewriters.analysis.shape_reads import ShapeReads

__all__ = ["Children", "Flow", "read_flow"]

_C = Val()
INPUT = "<input>"  # the first argument, where forward is read with it sharded


class _Reader(ShapeReads):
    def __init__(self, m: Method, kids: Children, methods, seed_input: bool = False) -> None:
        params = params_of(m.fn)
        self.self_name = params[0].name.value if params else "self"
        self.kids = kids
        self.methods = methods  # name -> Method of this class, or None
        self.where = m.where  # node -> "file:line:col"
        self.shapes = m.shapes  # names bound to literal shapes (_Shapes)
        self.env: dict[str, Value] = {p.name.value: _C for p in params[1:]}
        for star in (m.fn.params.star_arg, m.fn.params.star_kwarg):
            if isinstance(star, cst.Param):
                self.env[star.name.value] = _C
        self.local_src: dict[str, str] = {}  # a local -> the self path it copies
        self.defs: dict[str, cst.BaseExpression] = {}  # a local -> the value it was bound to
        if seed_input and len(params) > 1:  # read as if the first argument came sharded
            self.env[params[1].name.value] = Val(MERGED, frozenset({INPUT}))
        self.outputs = {c[0]: c[1:] for c in kids.outputs}
        self.row_inputs = dict(kids.row_inputs)
        self.exported: Val = _C
        self.child_local: dict[str, tuple] = {}
        self.returns: Optional[list] = None  # in a method forward calls: what it returns
        self.depth = 0
        self.body = m.fn.body.body
        self.chunks: dict[str, int] = {}
        self.rows: dict[str, frozenset] = {}  # row Linear -> the column Linears feeding it
        self.cols: set[str] = set()
        self.local: dict[str, frozenset] = {}  # Local name -> the columns it sizes
        self.sums: dict[str, frozenset] = {}
        self.failed: dict[str, str] = {}  # column Linear -> why it stays whole
        self.replicated: set[str] = set()  # modules with weights called on replicated values

    # ---- failures and records ---------------------------------------------------
    def fail(self, v: Value, why: str, node: cst.CSTNode) -> None:
        for s in flat(v).src:
            self.failed.setdefault(s, f"{why} at {self.where(node)}")

    # ---- statements --------------------------------------------------------------
    def run(self, body) -> None:
        """A suite: its statements (a one-line suite's small statements too)."""
        if isinstance(body, cst.SimpleStatementSuite):
            for small in body.body:
                self.small(small)
            return
        for stmt in body.body if isinstance(body, cst.BaseSuite) else body:
            self.statement(stmt)

    def branches(self, suites: list) -> None:
        """Each suite read from the same bindings, the results joined (either may run)."""
        start, ends = dict(self.env), []
        for suite in suites:
            self.env = dict(start)
            self.run(suite)
            ends.append(self.env)
        self.env = {}
        for env in ends:
            for name, v in env.items():
                seen = self.env.get(name)
                self.env[name] = v if seen is None or seen is v else flat(seen).join(flat(v))

    def statement(self, stmt: cst.CSTNode) -> None:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                self.small(small)
        elif isinstance(stmt, cst.If):
            self.expr(stmt.test)
            suites, orelse = [stmt.body], stmt.orelse
            while isinstance(orelse, cst.If):  # elif: one more branch
                self.expr(orelse.test)
                suites.append(orelse.body)
                orelse = orelse.orelse
            suites.append(orelse.body if orelse is not None else cst.IndentedBlock(body=[]))
            self.branches(suites)
        elif isinstance(stmt, (cst.For, cst.While)):
            if isinstance(stmt, cst.For):
                self.bind(stmt.target, self.iterated(self.expr(stmt.iter)), stmt)
            else:
                self.expr(stmt.test)
            for _ in range(2):  # a value carried round the loop
                self.run(stmt.body)
            if stmt.orelse is not None:
                self.run(stmt.orelse.body)
        elif isinstance(stmt, cst.With):
            for item in stmt.items:
                self.expr(item.item)
            self.run(stmt.body)
        elif isinstance(stmt, (cst.Try, cst.TryStar)):
            self.branches([stmt.body, *(h.body for h in stmt.handlers)])
            for extra in (stmt.orelse, stmt.finalbody):
                if extra is not None:
                    self.run(extra.body)
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            pass  # a closure: its calls are read where they happen
        else:  # (match, ...): what it does to a sharded value is not read
            for v in self.env.values():
                if flat(v).state != CLEAN:
                    self.fail(
                        v, f"a {type(stmt).__name__.lower()} statement it does not read", stmt
                    )

    def small(self, node: cst.CSTNode) -> None:
        if isinstance(node, cst.Assign):
            v = self.expr(node.value)
            for t in node.targets:
                self.bind(t.target, v, node, value=node.value)
        elif isinstance(node, cst.AnnAssign) and node.value is not None:
            self.bind(node.target, self.expr(node.value), node, value=node.value)
        elif isinstance(node, cst.AugAssign):
            v = flat(self.expr(node.target)).join(flat(self.expr(node.value)))
            if v.state != CLEAN and v.param:
                self.fail(v, "a raw parameter is read with a sharded value", node)
            self.bind(node.target, v, node)
        elif isinstance(node, cst.Return) and self.returns is not None:
            self.returns.append(self.expr(node.value) if node.value is not None else _C)
        elif isinstance(node, cst.Return) and node.value is not None:
            v = self.expr(node.value)
            first = flat(v[0] if isinstance(v, tuple) and v else v)
            if first.state in (COLUMNS, MERGED) and INPUT not in first.src:
                self.exported = self.exported.join(first)  # the caller may take it back
            elif first.state != CLEAN:
                self.fail(first, "a sharded value is returned", node)
            for rest in v[1:] if isinstance(v, tuple) else ():  # (per-head attention
                if flat(rest).state in (COLUMNS, MERGED):  # weights: as hand hints do)
                    self.fail(rest, "a sharded value is returned", node)
        elif isinstance(node, cst.Expr):
            self.expr(node.value)

    def bind(self, target, v: Value, node, value=None) -> None:
        if isinstance(target, cst.Name):
            self.env[target.value] = v
            if value is not None:
                self.defs[target.value] = value
            path = self_path(value, self.self_name) if value is not None else None
            if path is not None:
                self.local_src[target.value] = path
        elif isinstance(target, (cst.Tuple, cst.List)):
            elts = [e.value for e in target.elements]
            if isinstance(v, Split):
                self.chunks.update({s: len(elts) for s in v.val.src if v.val.state == COLUMNS})
                v = tuple(v.val for _ in elts)
            parts = v if isinstance(v, tuple) and len(v) == len(elts) else [flat(v)] * len(elts)
            for e, p in zip(elts, parts):
                self.bind(e, p, node)
        elif isinstance(target, (cst.Attribute, cst.Subscript)) and flat(v).state != CLEAN:
            self.fail(v, "a sharded value is stored", node)

    def iterated(self, v: Value) -> Value:
        return flat(v) if isinstance(v, (tuple, Split)) else v

    # ---- expressions -------------------------------------------------------------
    def expr(self, node: cst.BaseExpression) -> Value:
        if isinstance(node, cst.Name):
            return self.env.get(node.value, _C)
        if isinstance(node, cst.Attribute):
            path = self_path(node, self.self_name)
            if path is not None:  # a raw parameter, its own or a child's (self.rz.alpha)
                return Val(param=self.learned(path))
            if node.attr.value in METADATA:
                return _C
            return flat(self.expr(node.value))
        if isinstance(node, (cst.Tuple, cst.List)):
            return tuple(self.expr(e.value) for e in node.elements)
        if isinstance(node, cst.Call):
            return self.call(node)
        if isinstance(node, cst.BinaryOperation):
            a, b = flat(self.expr(node.left)), flat(self.expr(node.right))
            out = a.join(b)
            if out.state != CLEAN and out.param:
                self.fail(out, "a raw parameter is read with a sharded value", node)
            return out
        if isinstance(node, cst.Subscript):
            return flat(self.expr(node.value))
        if isinstance(node, (cst.GeneratorExp, cst.ListComp)):
            for comp in comprehensions(node.for_in):
                self.bind(comp.target, self.iterated(self.expr(comp.iter)), node)
            elt = self.expr(node.elt)
            n = literal_length(node.for_in.iter)
            return tuple(elt for _ in range(n)) if n else flat(elt)
        if isinstance(node, cst.IfExp):
            return flat(self.expr(node.body)).join(flat(self.expr(node.orelse)))
        if isinstance(node, (cst.UnaryOperation,)):
            return self.expr(node.expression)
        if isinstance(node, (cst.Comparison, cst.BooleanOperation)):
            for child in subexpressions(node):
                self.expr(child)
            return _C
        if isinstance(node, cst.StarredElement):
            return self.expr(node.value)
        if isinstance(node, cst.Dict):
            out = _C
            for el in node.elements:
                out = out.join(flat(self.expr(el.value)))
            return out
        if isinstance(node, cst.NamedExpr):
            v = self.expr(node.value)
            self.bind(node.target, v, node, value=node.value)
            return v
        return _C

    def learned(self, path: str) -> bool:
        """Whether ``self.<path>`` may be a parameter: the module's own, or one of
        a child with weights (a value whose gradient a split would leave partial)."""
        head = path.split(".")[0]
        kids = self.kids
        return path in kids.params or any(
            path.startswith(k + ".") or k == head for k in kids.weighted | kids.linears
        )

    def call(self, node: cst.Call) -> Value:
        func = node.func
        args = [self.expr(a.value) for a in node.args]
        joined = _C
        for a in args:
            joined = joined.join(flat(a))
        path = self_path(func, self.self_name)
        method = self.method_of(path)
        if method is not None:
            return self.inline(method, node, args)
        if path is not None and path in self.outputs | self.row_inputs:
            return self.child_call(path, args, node)
        kids = self.kids
        known = kids.linears | kids.elementwise | kids.weighted | kids.sequences
        if path is not None and "." in path and path not in known:
            assert isinstance(func, cst.Attribute)  # self.alpha.exp(): a method of a value
            return self.method(flat(self.expr(func.value)), func.attr.value, node, joined)
        if path is not None:
            return self.module_call(path, joined, node)
        if isinstance(func, cst.Attribute) and not self.is_namespace(func.value):
            # a method of a value: x.view(...), t.split(...)
            return self.method(flat(self.expr(func.value)), func.attr.value, node, joined)
        name = last_name(func)
        if name == "apply_chunking_to_forward" and len(node.args) > 3:
            # transformers' (forward_fn, chunk_size, chunk_dim, *inputs): forward_fn(*inputs)
            method = self.method_of(self_path(node.args[0].value, self.self_name))
            if method is not None:
                return self.inline(method, node.with_changes(args=node.args[3:]), args[3:])
        if name == "rearrange" and node.args:
            return self.rearrange(flat(args[0]), node)
        if name in ("split", "chunk") and node.args and flat(args[0]).state == COLUMNS:
            return self.split(flat(args[0]), node.args[1:], node, name)
        return self.function(name, joined, node)

    def is_namespace(self, node: cst.BaseExpression) -> bool:
        """``F``, ``torch.nn.functional``: a name forward does not bind (an import)."""
        while isinstance(node, cst.Attribute):
            node = node.value
        return (
            isinstance(node, cst.Name)
            and node.value not in self.env
            and node.value != self.self_name
        )

    def method_of(self, path: Optional[str]) -> Optional[Method]:
        kids = self.kids
        if path is None or self.methods is None or self.depth >= 3 or "." in path:
            return None
        if path in kids.linears | kids.elementwise | kids.weighted | kids.sequences:
            return None
        return self.methods(path)

    def inline(self, m: Method, node: cst.Call, args: list) -> Value:
        """A method of the class forward calls (``self._split_heads(q, self.n)``):
        read where it is called, its parameters bound to the call's values."""
        params = params_of(m.fn)[1:]
        bound: dict[str, Value] = {p.name.value: _C for p in params}
        sources: dict[str, str] = {}
        for i, (a, v) in enumerate(zip(node.args, args)):
            name = (
                a.keyword.value if a.keyword else params[i].name.value if i < len(params) else None
            )
            if name is None or a.star:
                continue
            bound[name] = v
            keys = self.size_keys(a.value)
            if keys and len(keys) == 1 and (self.depth == 0 or keys[0] in self.local_src.values()):
                sources[name] = keys[0]
        saved = (self.env, self.local_src, self.shapes, self.where, self.returns, self.self_name)
        defs, self.defs = self.defs, {}
        self.env, self.local_src, self.shapes, self.where = bound, sources, m.shapes, m.where
        self.returns, self.depth = [], self.depth + 1
        first = params_of(m.fn)
        self.self_name = first[0].name.value if first else "self"
        try:
            self.run(m.fn.body.body)
            returns = self.returns
        finally:
            self.env, self.local_src, self.shapes, self.where, self.returns, self.self_name = saved
            self.defs = defs
            self.depth -= 1
        if len(returns) == 1:
            return returns[0]
        out = _C
        for r in returns:
            out = out.join(flat(r))
        return out

    def child_call(self, path: str, args: list, node: cst.Call) -> Value:
        """A child whose forward returns its columns' sharded output, or takes
        a sharded first argument back through a Linear (its summary in
        :class:`Children`)."""
        first = flat(args[0]) if args else _C
        rest = _C
        for a in args[1:]:
            rest = rest.join(flat(a))
        if path in self.row_inputs and first.state in (COLUMNS, MERGED) and rest.state == CLEAN:
            row = f"{path}.{self.row_inputs[path]}"
            self.rows[row] = self.rows.get(row, frozenset()) | first.src
            return _C
        if path in self.outputs and first.state == CLEAN and rest.state == CLEAN:
            cols, state, local = self.outputs[path]
            srcs = frozenset(f"{path}.{c}" for c, _ in cols)
            self.cols |= srcs
            self.chunks.update({f"{path}.{c}": n for c, n in cols if n > 1})
            self.child_local[path] = (tuple(local), srcs)
            # its first output; any other is at most per head (attention weights: its
            # reading refused anything else), so a tuple target splits them so
            return (Val(state, srcs), Val(HEADS, srcs) if state == MERGED else _C)
        self.fail(first.join(rest), f"self.{path} is applied to a sharded value", node)
        return _C

    def module_call(self, path: str, arg: Val, node: cst.Call) -> Value:
        kids = self.kids
        if path in kids.linears:
            if arg.state == CLEAN:
                self.cols.add(path)
                return Val(COLUMNS, frozenset({path}))
            if arg.state in (COLUMNS, MERGED):
                self.rows[path] = self.rows.get(path, frozenset()) | arg.src
                return _C
            self.fail(arg, f"self.{path} takes a value still split into heads", node)
            return _C
        if path in kids.sequences and arg.state in (COLUMNS, MERGED):
            self.rows[f"{path}.0"] = self.rows.get(f"{path}.0", frozenset()) | arg.src
            return _C
        if arg.state == CLEAN:
            if path in kids.weighted:  # its output carries its weights' gradient
                self.replicated.add(path)
                return Val(param=True)
            return _C
        if path in kids.elementwise:
            return arg
        if path in kids.weighted and arg.state == HEADS:  # per head: its gradient is partial
            self.sums[path] = self.sums.get(path, frozenset()) | arg.src
            return arg
        if arg.state == HEADS and path not in kids.weighted:
            return arg  # weightless, per head (a rotary table, softmax)
        self.fail(arg, f"self.{path} is applied to a sharded value", node)
        return _C

    def method(self, v: Val, name: str, node: cst.Call, args: Val) -> Value:
        if v.state == CLEAN:  # a cache's update(k, v): per head in, per head out
            if args.state == HEADS:
                return Val(HEADS, args.src, v.param or args.param)
            return Val(param=v.param or args.param)  # self.alpha.exp(): still learned
        if args.param:
            self.fail(v, "a raw parameter is read with a sharded value", node)
        if name in METADATA:
            return _C
        if name in SPLITS and v.state == COLUMNS:
            return self.split(v, node.args, node, name)
        if name in RESHAPES:
            return self.reshape(v, node)
        if v.state == HEADS or name in ELEMENTWISE_METHODS:
            return Val(max(v.state, args.state), v.src | args.src)
        self.fail(v, f".{name}() on a sharded value", node)
        return _C

    def function(self, name: Optional[str], args: Val, node: cst.Call) -> Value:
        if args.state == CLEAN:
            return Val(param=args.param)  # torch.exp(self.a): still learned
        if args.state == HEADS or name in ELEMENTWISE:
            if args.param and args.state != CLEAN:
                self.fail(args, "a raw parameter is read with a sharded value", node)
            return Val(args.state, args.src)
        self.fail(args, f"{name or 'a call'}() on a sharded value", node)
        return _C

    # ---- the result ----------------------------------------------------------------
    def result(self) -> Flow:
        failed = dict(self.failed)
        for path in self.replicated & set(self.sums):  # a summed gradient would count its
            for col in self.sums[path]:  # replicated use tp times
                failed.setdefault(col, f"self.{path} runs on its heads and on a replicated value")
        exported = self.exported.src - set(failed)
        for col in self.cols - exported:  # a column output no Linear takes back stays whole
            if col not in failed and not any(col in src for src in self.rows.values()):
                failed[col] = "its output reaches no row-parallel Linear"
        changed = True
        while changed:  # a row fed by a whole column is whole, and so are its other columns
            changed = False
            for row, src in self.rows.items():
                bad = [s for s in src if s in failed]
                for s in src:
                    if bad and s not in failed:
                        failed[s] = f"it feeds self.{row} with self.{bad[0]}, left whole"
                        changed = True
        flow = Flow()
        exported -= set(failed)
        flow.exports = tuple((c, self.chunks.get(c, 1)) for c in sorted(exported))
        flow.export_state = self.exported.state
        flow.export_local = tuple(n for n, src in self.local.items() if src and src <= exported)
        row_input = [r for r, src in self.rows.items() if INPUT in src]
        if len(row_input) == 1 and INPUT not in failed:
            flow.row_input = row_input[0]
        for child, (names, srcs) in self.child_local.items():
            if names and not (srcs & set(failed)):
                flow.child_local[child] = names
        for col in sorted(self.cols - set(failed) - exported):
            n = self.chunks.get(col, 1)
            flow.specs[col] = Col(chunks=n) if n > 1 else Col()
        for row, src in sorted(self.rows.items()):
            if src and INPUT not in src and not (src & set(failed)):
                flow.specs[row] = Row()
        for path, src in sorted(self.sums.items()):
            if src and not (src & set(failed)):
                flow.specs[path] = Replicate(sum_grad=True)
        flow.local = tuple(
            n for n, src in self.local.items() if src and not (src & (set(failed) | exported))
        )
        flow.notes = [f"self.{c}: left whole: {why}" for c, why in sorted(failed.items())]
        unseen = self.kids.linears - self.cols - set(self.rows)
        flow.notes += [
            f"self.{c}: left whole: forward never calls it (annot reads forward itself, "
            "not the methods it calls)"
            for c in sorted(unseen)
        ]
        return flow


def read_flow(
    source: str,
    kids: Children,
    path: str = "<forward>",
    first_line: int = 1,
    methods: Optional[Callable[[str], Optional[Method]]] = None,
    seed_input: bool = False,
) -> Flow:
    """The hints one ``forward`` (``source``: the method's text, dedented)
    shows for the module's attributes ``kids``; positions in notes count from
    ``first_line`` of ``path``. ``methods``: the class's other methods by name
    (:func:`parse_method`), read where forward calls them. ``seed_input``:
    read with the first argument sharded, for :attr:`Flow.row_input`."""
    reader = _Reader(parse_method(source, path, first_line), kids, methods, seed_input)
    reader.run(reader.body)
    return reader.result()
