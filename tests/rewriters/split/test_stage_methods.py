"""What each stage method of a split says about its inputs
(annot.rewriters.split.stage_methods.StageMethod)."""

import textwrap

from annot.rewriters.split.stage_split import split_stages

SOURCE = textwrap.dedent(
    """
    import torch.nn as nn

    class M(nn.Module):
        def forward(self, x, y, z=None, *args, **kw):
            h = self.a(x + z)
            y2 = y
            h = self.b(h)
            w = kw.get("w")
            return self.c(h) + len(args), y2, w
    """
)


def test_untouched_names_the_inputs_a_stage_only_hands_on():
    stages = split_stages(SOURCE, "M", ["b", "c"]).stages
    assert [(s.inputs, s.untouched) for s in stages] == [
        (("x", "y", "z", "args", "kw"), ("args", "kw")),  # x, z, y are read (y2 = y)
        (("h", "kw", "args", "y2"), ("args", "y2")),  # kw is read (kw.get)
        (("h", "args", "y2", "w"), ()),
    ]


def test_a_target_read_in_the_last_stage_is_untouched_before_it():
    source = textwrap.dedent(
        """
        import torch.nn as nn

        class M(nn.Module):
            def forward(self, x, y):
                for block in self.blocks:
                    x = block(x)
                return ((x - y) ** 2).mean()
        """
    )
    stages = split_stages(source, "M", ["blocks.1", "blocks.2"]).stages
    assert [s.untouched for s in stages] == [("y",), ("y",), ()]
