"""``annot verify``: run a model at tp=N on gloo ranks against the single-device run.

    annot verify model.py:GPT --tp 2 --init 'GPTConfig(n_layer=2)' \
        --input idx=int64[2,16]:64 --hints hints.py:HINTS

Every rank builds ``torch.manual_seed(seed); CLASS(...)`` and its shard of it
(``annot.parallelize(model, hints=..., verify=True)``), runs one forward and
backward on the same random inputs, and compares with the single-device model:
every floating output and every parameter's gradient. A hint that is wrong
without crashing (a head count left global where forward reshapes with
``-1``) shows here as a mismatch; a gradient that is partial on each tp rank
as a :class:`annot.VerifyError`. Both models run in eval mode (dropout off).

The scalar differentiated is the model's own loss when it returns one (a
0-dim output), else a fixed random projection of its outputs. An output
sharded on its last dim (vocab-parallel logits) is gathered to compare.
Exit status: 0 when everything matches, 1 on a mismatch or an error on a
rank, 2 on a command-line mistake.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from annot.cli.inputs import (
    Refusal,
    add_target_arguments,
    import_target,
    parse_inputs,
    target_model,
)

__all__ = ["add_verify"]

RTOL, ATOL = 1e-4, 1e-5  # float32; reduction order differs between tp and one device


def add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="run a model at tp=N on gloo ranks and compare with the single-device run",
        description=__doc__.split("\n\n")[2],
    )
    add_target_arguments(p)
    p.add_argument("--tp", type=int, default=2, metavar="N", help="tensor-parallel degree")
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=DTYPE[SHAPE][:HIGH]",
        help="a forward argument (as annot plan); a transformers model defaults to token ids",
    )
    p.add_argument(
        "--hints",
        metavar="FILE:NAME",
        help="a dict of path-pattern hints in FILE (default: @shard, or the model's tp plan)",
    )
    p.add_argument("--seed", type=int, default=0, help="the seed both models are built from")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from annot.testing import RanksFailed, run_ranks

    try:
        path, sep, name = args.target.rpartition(":")
        if not sep or not path or not name:
            raise Refusal(f"{args.target!r}: expected FILE:CLASS, e.g. model.py:GPT")
        if args.tp < 2:
            raise Refusal(f"--tp {args.tp}: verify compares tp >= 2 with one device")
        # command-line mistakes show here, before any rank starts
        target_model(args.target, args.init, args.config_json)
        if args.hints is not None:
            _hints(args.hints)
    except Refusal as exc:
        print(f"annot verify: {exc}", file=sys.stderr)
        return 2
    print(
        f"annot verify: {args.target} at tp={args.tp} against the single-device model "
        f"(seed {args.seed}, eval mode: dropout off)"
    )
    try:
        rows = run_ranks(_rank, args.tp, vars(args), timeout=600)[0]
    except RanksFailed as exc:
        print(f"annot verify: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    if rows and rows[0][0].startswith("refused: "):
        print(f"annot verify: {rows[0][0]}")
        return 1
    width = max(len(r[0]) for r in rows)
    bad = [r for r in rows if not r[2]]
    print(f"  {'what':<{width}}  {'max |diff|':>10}  status")
    for what, diff, ok in rows:
        shown = "-" if diff is None else f"{diff:.1e}"
        print(f"  {what:<{width}}  {shown:>10}  {'ok' if ok else 'MISMATCH'}")
    if bad:
        print(f"{len(bad)} of {len(rows)} checks differ from the single-device run")
        return 1
    print(f"all {len(rows)} checks equal the single-device run (rtol {RTOL}, atol {ATOL})")
    return 0


def _hints(spec: str) -> dict:
    path, sep, name = spec.rpartition(":")
    if not sep:
        raise Refusal(f"--hints {spec!r}: expected FILE:NAME, e.g. hints.py:HINTS")
    value = getattr(import_target(path), name, None)
    if callable(value):
        value = value()
    if not isinstance(value, dict):
        raise Refusal(f"--hints {spec!r}: {name} is not a dict of path patterns to specs")
    return value


def _sample(args: Any, cls: type, model) -> dict:
    import torch

    sample = parse_inputs(args.input, cls)
    if sample is not None:
        return sample
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise Refusal(f"{cls.__name__}.forward needs inputs: give --input NAME=DTYPE[SHAPE]")
    ids = torch.randint(0, vocab, (2, 8))
    out = {"input_ids": ids}
    if getattr(model.config, "is_encoder_decoder", False):
        out["decoder_input_ids"] = ids
    return out


def _leaves(out: Any) -> list:
    from annot.runtime.trees import tensors

    if hasattr(out, "to_tuple"):  # a transformers ModelOutput
        out = out.to_tuple()
    return [t for t in tensors(out) if t.is_floating_point()]


def _scalar(out: Any, seed: int):
    import torch

    leaves = _leaves(out)
    losses = [t for t in leaves if t.dim() == 0]  # the model's own loss
    if losses:
        return losses[0]
    g = torch.Generator().manual_seed(seed)
    return sum((t * torch.randn(t.shape, generator=g)).sum() for t in leaves)


def _rank(arguments: dict) -> list[tuple[str, Optional[float], bool]]:
    import copy

    import torch

    import annot

    args = argparse.Namespace(**arguments)
    torch.manual_seed(args.seed)
    cls, model = target_model(args.target, args.init, args.config_json)
    ref = copy.deepcopy(model)
    hints = _hints(args.hints) if args.hints else None
    torch.manual_seed(args.seed + 1)
    sample = _sample(args, cls, ref)
    try:  # annot's refusals (the pre-flight's among them) come before any step
        par = annot.parallelize(model, mesh=annot.Mesh(tp=args.tp), hints=hints, verify=True)
        par.eval()
        out = par(**sample)
    except annot.AnnotError as exc:
        return [(f"refused: {type(exc).__name__}: {exc}", None, False)]
    ref.eval()
    ref_out = ref(**sample)
    rows = []
    mine, theirs = _leaves(out), _leaves(ref_out)
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a.dim() and a.shape[:-1] == b.shape[:-1] and a.shape[-1] * args.tp == b.shape[-1]:
            from annot.runtime.tp.comm import gather_full  # sharded logits: compare them whole

            a = gather_full(a.detach(), -1, 1, args.tp, par.ctx.tp_group)
        rows.append(_row(f"output {i} {tuple(b.shape)}", a, b))
    if len(mine) != len(theirs):
        rows.append((f"outputs: {len(mine)} here, {len(theirs)} single-device", None, False))
    par.backward(_scalar(out, args.seed))
    _scalar(ref_out, args.seed).backward()
    grads = par.full_grads()
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        got = grads.get(name)
        rows.append(_row(f"grad {name}", got, p.grad) if got is not None else (name, None, False))
    return rows


def _row(what: str, got, want) -> tuple[str, Optional[float], bool]:
    import torch

    got = got.detach().to(want.dtype)
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)}", None, False
    diff = (got - want.detach()).abs()
    ok = bool((diff <= ATOL + RTOL * want.detach().abs()).all())
    return what, float(diff.max()) if diff.numel() else 0.0, ok and not torch.isnan(got).any()
