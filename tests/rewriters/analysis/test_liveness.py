"""Liveness (annot.rewriters.analysis.liveness) over the effects of libcst statements
(annot.rewriters.analysis.statement_effects): which names cross each point of a
function, checked on inline sources."""

from __future__ import annotations

import textwrap

from annot.rewriters.analysis.liveness import Crossing
from annot.rewriters.analysis.statement_effects import function_crossings


def crossing_names(src: str) -> list[tuple[str, ...]]:
    return [c.names for c in function_crossings(textwrap.dedent(src))]


def test_liveness_straight_line_and_self():
    assert function_crossings("def f(self, a, b):\n    c = self.w(a)\n    return c + b\n") == [
        Crossing(("a", "b")),
        Crossing(("c", "b")),
        Crossing(()),
    ]


def test_liveness_tuple_unpacking():
    assert crossing_names("""\
        def f(self, x):
            a, (b, *c) = x
            return a + c[0]
        """) == [("x",), ("a", "c"), ()]


def test_liveness_augmented_assignment_reads_and_writes():
    assert crossing_names("""\
        def f(self, x):
            s = 0
            s += x
            t = x
            t = 1
            return s + t
        """) == [("x",), ("s", "x"), ("x", "s"), ("s",), ("s", "t"), ()]


def test_liveness_branch_defined_names():
    cuts = function_crossings(
        textwrap.dedent("""\
        def f(self, x, flag):
            if flag:
                both = 1
                one = 2
            else:
                both = 3
            return both + one + x
        """)
    )
    assert cuts[1].names == ("both", "one", "x")
    assert cuts[1].maybe_unbound == {"one"}


def test_liveness_raise_in_a_branch_keeps_the_other_definite():
    cuts = function_crossings(
        textwrap.dedent("""\
        def f(self, x):
            if x is None:
                raise ValueError("x")
            else:
                y = x
            return y
        """)
    )
    assert cuts[1] == Crossing(("y",))


def test_liveness_loop_carried_and_loop_defined():
    assert crossing_names("""\
        def f(self, x, n):
            acc = x
            for i in range(n):
                last = acc
                acc = acc * i
            return acc, last
        """) == [("x", "n"), ("n", "acc"), ("acc", "last"), ()]
    cuts = function_crossings(
        "def f(self, n):\n    for i in range(n):\n        last = i\n    return last\n"
    )
    assert cuts[1].names == ("last",)
    assert cuts[1].maybe_unbound == {"last"}


def test_liveness_while_and_break_with_del():
    cuts = function_crossings(
        textwrap.dedent("""\
        def f(self, x, w):
            while x > 0:
                x -= 1
                if x == 3:
                    del w
                    break
            return x, w
        """)
    )
    assert cuts[1].names == ("x", "w")
    assert cuts[1].maybe_unbound == {"w"}  # deleted on the break path


def test_liveness_del_kills():
    assert crossing_names("""\
        def f(self, x):
            y = x
            del y
            return x
        """) == [("x",), ("y", "x"), ("x",), ()]


def test_liveness_comprehension_scope():
    assert crossing_names("""\
        def f(self, xs):
            t = 1
            ys = [t * 2 for t in xs if t]
            return ys, t
        """) == [("xs",), ("xs", "t"), ("ys", "t"), ()]
    # a walrus in a comprehension binds in the function
    cuts = function_crossings(
        "def f(self, xs):\n    ys = [(m := v) for v in xs]\n    return m, ys\n"
    )
    assert cuts[1].names == ("m", "ys")
    assert cuts[1].maybe_unbound == {"m"}


def test_liveness_closures_read_free_names():
    assert crossing_names("""\
        def f(self, x, k):
            g = lambda v: v * k
            def h(v):
                return g(v) + x
            return h(1)
        """) == [("k", "x"), ("g", "x"), ("h",), ()]


def test_liveness_globals_and_builtins_never_cross():
    assert crossing_names("""\
        def f(self, x):
            y = torch.relu(F.gelu(x))
            return len(y) + y
        """) == [("x",), ("y",), ()]


def test_liveness_target_only_the_last_stage_needs():
    assert crossing_names("""\
        def f(self, x, targets=None):
            x = self.a(x)
            x = self.b(x)
            return self.loss(x, targets)
        """) == [("x", "targets"), ("x", "targets"), ("x", "targets"), ()]


def test_liveness_with_try_match_import():
    cuts = function_crossings(
        textwrap.dedent("""\
        def f(self, x, p):
            with open(p) as fh:
                data = fh.read()
            try:
                v = int(data)
            except ValueError as err:
                v = 0
            match x:
                case [a, *rest]:
                    w = a
                case _:
                    w = v
            import math as m
            return m.sqrt(w), rest, err
        """)
    )
    assert [c.names for c in cuts] == [
        ("p", "x"),
        ("data", "x"),
        ("x", "v"),
        ("w", "rest"),  # err is deleted when its handler ends: never crosses
        ("m", "w", "rest"),
        (),
    ]
    assert cuts[3].maybe_unbound == {"rest"}  # `case _:` always matches; rest may not be set
