"""``annot hints``: the tp hints annot reads off a model's sources, as the dict
a user writes, to review and keep (``annot.parallelize`` uses them itself when
nothing is hinted and the model ships no tp plan).

    annot hints model.py:GPT --init 'GPTConfig(n_layer=2)'
    annot hints transformers.models.gptj.modeling_gptj:GPTJForCausalLM \\
        --config-json '{"n_layer": 2}' -o hints.py

The model is built on the meta device (no memory, no FLOPs). Each Linear the
reading left whole is listed after the dict, with the reason, as a comment.
Exit status: 0 when something is split, 1 when nothing is, 2 on a
command-line mistake.
"""

from __future__ import annotations

import argparse
import sys

from annot.cli.inputs import Refusal, add_target_arguments, target_model

__all__ = ["add_hints"]


def add_hints(sub) -> None:
    p = sub.add_parser(
        "hints",
        help="print the tp hints annot reads off a model's sources",
        description=__doc__.split("\n\n")[0],
    )
    add_target_arguments(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the hints to FILE, not stdout")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import torch

    from annot.plan.inferred_hints import infer_hints

    try:
        with torch.device("meta"):
            _, model = target_model(args.target, args.init, args.config_json)
    except Refusal as exc:
        print(f"annot hints: {exc}", file=sys.stderr)
        return 2
    found = infer_hints(model)
    text = f"# annot hints {args.target}: read off the sources\n{found.source()}\n"
    if found.notes:
        text += "\n# left whole:\n" + "".join(f"#   {n}\n" for n in found.notes)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"annot hints: {len(found.hints)} hints written to {args.output}")
    else:
        sys.stdout.write(text)
    return 0 if found.hints else 1
