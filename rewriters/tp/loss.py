"""Step 4 of the tensor-parallel rewrite: the vocab-parallel loss.

:meth:`LossEdits.plan_losses` computes, to a fixpoint over the classes of
the file, which classes have a *sharded output* (``forward`` returns a
sharded value on every return), so that ``self.cls(...)`` gives a sharded
value in any class (Hugging Face's layout: the ``Col()`` in a head, the loss
in the parent). Then in every method of every class:
``F.cross_entropy(x, ...)`` on a sharded ``x`` becomes
``vocab_parallel_cross_entropy(x, ...)``; a call of an
``nn.CrossEntropyLoss(...)`` instance becomes
``vocab_parallel_cross_entropy(x, y, <its constructor arguments>)``; a
sharded value passed to another loss, to ``softmax / log_softmax / argmax /
argmin / topk``, or reshaped on its way to a loss without provably keeping its
last dim is refused.
"""

from __future__ import annotations

from typing import Optional

import libcst as cst

from annot.core.errors import RewriteError
from annot.rewriters.source.diagnostics import node_source
from annot.rewriters.tp.outputs import CROSS_ENTROPY_LOSS, ShardedOutputs
from annot.rewriters.tp.sharded import Env, Shard, Sharded, contained
from annot.rewriters.tp.syntax import calls, self_path, with_args

__all__ = ["LossEdits"]

VOCAB_LOSS = "annot.runtime.tp.vocab_loss"
CROSS_ENTROPY = frozenset({"torch.nn.functional.cross_entropy"})
# nn.CrossEntropyLoss's constructor parameters, in order: also F.cross_entropy's keywords
_LOSS_PARAMS = ("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
# Functions over a row of logits that are wrong on one rank's slice of it.
_NEEDS_FULL_ROW = frozenset(
    f"{mod}.{fn}"
    for mod in ("torch", "torch.nn.functional", "torch.special")
    for fn in ("softmax", "log_softmax", "argmax", "argmin", "topk")
)
_NEEDS_FULL_ROW_METHODS = frozenset({"softmax", "log_softmax", "argmax", "argmin", "topk"})


class LossEdits(ShardedOutputs):
    """Plans the vocab-parallel loss rewrites and refusals of every class of the file."""

    def plan_losses(self, cols: dict[int, dict[tuple[str, ...], Sharded]]) -> None:
        """Find the sharded values of every class of the file and plan the
        loss rewrites and refusals of every method.

        A class has a *sharded output* when its ``forward`` returns (as is, or
        as a tuple element) a value derived from a sharded source; computed to
        a fixpoint so heads nested in heads count too. A class none of whose
        sources holds a sharded tensor has nothing to rewrite or refuse.
        """
        assert self.scopes is not None
        classes = self.scopes.classes
        counts: dict[str, int] = {}
        for c in classes:
            counts[c.name.value] = counts.get(c.name.value, 0) + 1
        by_name = {c.name.value: c for c in classes if counts[c.name.value] == 1}
        infos = [self.class_info(c, cols.get(id(c), {}), by_name) for c in classes]
        unique = {i.name: i for i in infos if i.name in by_name}
        outputs: dict[str, Shard] = {}
        # only the outputs of classes built in some __init__ are read
        children = {name for i in infos for name in i.children.values()}
        built = [i for i in unique.values() if i.name in children]
        for _ in range(len(infos) + 1):
            changed = False
            for info in built:
                out = self.forward_output(info, unique, outputs)
                if out != outputs.get(info.name):
                    outputs[info.name] = out
                    changed = True
            if not changed:
                break
        for info in infos:
            sources = self.sources(info, unique, outputs)
            if all(contained(s) is None for s in sources.values()):
                continue  # no value of this class can be sharded
            for fn in info.methods:
                self_name = self.self_name(fn)
                if self_name is None:
                    continue
                env = Env(self_name, sources, info.loss_attrs)
                self.at = (info.node, fn)
                for call in calls(fn.body):
                    self._plan_call(call, env)

    def _plan_call(self, call: cst.Call, env: Env) -> None:
        """Rewrite ``call`` to the vocab-parallel loss, refuse it, or leave it."""
        func = call.func
        if self.qualified(func, CROSS_ENTROPY):
            s = self._input_sharding(call, env)
            if s is not None:
                self._check_view(s)
                self.needed_imports.add((VOCAB_LOSS, "vocab_parallel_cross_entropy"))
                self.edit(
                    call, lambda n: n.with_changes(func=cst.Name("vocab_parallel_cross_entropy"))
                )
            return
        ctor = self._loss_module(func, env)
        if ctor is not None:
            s = self._input_sharding(call, env)
            if s is not None:
                self._check_view(s)
                self._plan_loss_module(call, ctor, s)
            return
        name = _terminal_name(func)
        if name is not None and "loss" in name.lower():
            for arg in call.args:
                s = contained(self.eval(arg.value, env, set()))
                if s is not None:
                    raise self._refusal(
                        call,
                        s,
                        node_source(arg.value),
                        f"annot cannot tell what {node_source(func)}(...) computes, so it "
                        "cannot make it correct on a sharded value",
                    )
            return
        if self.qualified(func, _NEEDS_FULL_ROW):
            first = _input_arg(call)
            value = first.value if first is not None else None
            shown = node_source(func)
        elif isinstance(func, cst.Attribute) and func.attr.value in _NEEDS_FULL_ROW_METHODS:
            value, shown = func.value, f".{func.attr.value}"
        else:
            return
        if value is None:
            return
        shard = self.eval(value, env, set())
        if isinstance(shard, Sharded):
            raise self._refusal(
                call,
                shard,
                node_source(value),
                f"{shown}(...) over its last dim would see only this rank's slice",
            )

    def _input_sharding(self, call: cst.Call, env: Env) -> Optional[Sharded]:
        arg = _input_arg(call)
        if arg is None:
            return None
        s = self.eval(arg.value, env, set())
        return s if isinstance(s, Sharded) else None

    def _refusal(self, call: cst.Call, s: Sharded, what: str, why: str) -> RewriteError:
        return self.locate.error(
            call,
            f"{what} is vocab-sharded (Col() without gather on {s.origin}: each rank holds "
            f"1/{self.tp} of its last dim), and {why}; compute the loss with F.cross_entropy "
            "on it (annot makes that vocab_parallel_cross_entropy), or hint "
            f"{s.hint}=Col(gather=True) on {s.cls} so that every rank has the full logits",
        )

    def _check_view(self, s: Sharded) -> None:
        """Refuse a loss input reshaped so its last dim is no longer the per-rank slice."""
        if s.view is None:
            return
        view = s.view
        assert isinstance(view.func, cst.Attribute)
        recv = node_source(view.func.value)
        if view.func.attr.value == "flatten":
            fix = f"flatten only the leading dims ({recv}.flatten(0, -2))"
        else:
            fix = (
                f"write the last dim as {recv}.size(-1) "
                f"({recv}.{view.func.attr.value}(-1, {recv}.size(-1)))"
            )
        raise self.locate.error(
            view,
            f"{node_source(view)} feeds a loss, but {recv} is vocab-sharded (Col() without "
            f"gather on {s.origin}: each rank holds 1/{self.tp} of its last dim), and annot "
            f"cannot prove the result keeps that per-rank last dim; {fix}, or hint "
            f"{s.hint}=Col(gather=True) on {s.cls} so that every rank has the full logits",
        )

    def _loss_module(self, func: cst.BaseExpression, env: Env) -> Optional[cst.Call]:
        """The ``nn.CrossEntropyLoss(...)`` call that built the module ``func``
        calls: inline (``nn.CrossEntropyLoss()(x, y)``), a local variable assigned
        once, or an attribute ``__init__`` assigns once."""
        if isinstance(func, cst.Call) and self.qualified(func.func, CROSS_ENTROPY_LOSS):
            return func
        path = self_path(func, env.self_name)
        if path is not None:
            return env.loss_attrs.get(path[0]) if len(path) == 1 else None
        if not isinstance(func, cst.Name) or not self.loss_modules:
            return None
        refs = self.reaching(func)
        if refs is None or len(refs) != 1:
            return None
        value = self.assigned_value(refs[0].target)
        if isinstance(value, cst.Call) and self.qualified(value.func, CROSS_ENTROPY_LOSS):
            return value
        return None

    def _plan_loss_module(self, call: cst.Call, ctor: cst.Call, s: Sharded) -> None:
        """``loss_fct(x, y)`` with ``loss_fct = nn.CrossEntropyLoss(ignore_index=0)``
        -> ``vocab_parallel_cross_entropy(x, y, ignore_index=0)``."""
        inline = call.func is ctor
        shown = node_source(ctor)
        subject = (
            f"the input of {shown}(...)"
            if inline
            else f"{node_source(call.func)} is {shown} and its input"
        ) + f" is vocab-sharded (Col() without gather on {s.origin})"
        positional = [a for a in call.args if a.keyword is None]
        if (
            any(a.star for a in call.args)
            or len(positional) > 2
            or any(
                a.keyword is not None and a.keyword.value not in ("input", "target")
                for a in call.args
            )
        ):
            raise self.locate.error(
                call,
                f"{subject}; annot rewrites the call to vocab_parallel_cross_entropy(input, "
                "target, ...) but cannot map its arguments; call it as loss(input, target), or "
                "call F.cross_entropy(input, target) directly (annot makes that vocab-parallel)",
            )
        keywords: list[str] = []
        for i, a in enumerate(ctor.args):
            key = a.keyword.value if a.keyword is not None else None
            if key is None and not a.star and i < len(_LOSS_PARAMS):
                key = _LOSS_PARAMS[i]
            why = None
            if a.star or key not in _LOSS_PARAMS:
                why = (
                    f"its argument {node_source(a).strip().rstrip(',')} does not map to a parameter"
                )
            elif not inline and not _literal(a.value):
                why = (
                    f"its argument {key}={node_source(a.value)} is not a literal, so annot "
                    "cannot move it to the call"
                )
            if why is not None:
                fix = f"input, target, {key}=..." if key in _LOSS_PARAMS else "input, target"
                raise self.locate.error(
                    call,
                    f"{subject}; annot rewrites the call to vocab_parallel_cross_entropy(input, "
                    f"target, <the constructor's arguments>) but {why}; call "
                    f"F.cross_entropy({fix}) directly (annot makes that vocab-parallel), or "
                    f"hint {s.hint}=Col(gather=True) on {s.cls}",
                )
            keywords.append(key)  # type: ignore[arg-type]
        self.needed_imports.add((VOCAB_LOSS, "vocab_parallel_cross_entropy"))
        literal_args = [a.value for a in ctor.args]

        def rewrite(n: cst.CSTNode) -> cst.CSTNode:
            assert isinstance(n, cst.Call)
            if inline:  # nn.CrossEntropyLoss(...)(x, y): the constructor's call is the func
                assert isinstance(n.func, cst.Call)
                values = [a.value for a in n.func.args]
            else:
                values = literal_args
            func = cst.Name("vocab_parallel_cross_entropy")
            if not keywords:
                return n.with_changes(func=func)
            extra = [_kwarg_node(k, v) for k, v in zip(keywords, values)]
            return with_args(n, func, extra)

        self.edit(call, rewrite)


def _literal(expr: cst.BaseExpression) -> bool:
    """A constant that means the same anywhere it is moved to."""
    if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString)):
        return True
    if isinstance(expr, cst.Name):
        return expr.value in ("None", "True", "False")
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        return isinstance(expr.expression, (cst.Integer, cst.Float))
    return False


def _input_arg(call: cst.Call) -> Optional[cst.Arg]:
    """The first positional argument, or ``input=``."""
    return next(
        (
            a
            for a in call.args
            if (a.keyword is None and not a.star)
            or (a.keyword is not None and a.keyword.value == "input")
        ),
        None,
    )


def _terminal_name(func: cst.BaseExpression) -> Optional[str]:
    """``loss_fct`` / ``self.loss_function`` / ``nn.NLLLoss()`` -> the last name."""
    if isinstance(func, cst.Name):
        return func.value
    if isinstance(func, cst.Attribute):
        return func.attr.value
    if isinstance(func, cst.Call):
        return _terminal_name(func.func)
    return None


def _kwarg_node(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(
        keyword=cst.Name(name),
        value=value,
        equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
        ),
    )
