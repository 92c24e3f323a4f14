"""Step 4 of the tensor-parallel rewrite (annot.rewriters.tp.loss, with the sharded
outputs of annot.rewriters.tp.outputs): the vocab-parallel loss, also in a parent
class (Hugging Face's layout), and the sharded logits it refuses."""

from __future__ import annotations

import pytest

from annot.rewriters.tp.rewrite import rewrite_tensor_parallel
from tests.rewriters.tp.cases import assert_rewrite, refusal


def test_gpt_vocab_embedding_col_head_and_vocab_parallel_loss():
    assert_rewrite(
        """
        import torch.nn as nn
        from torch.nn import functional as F
        from annot import shard, Col, Vocab


        @shard(wte=Vocab(), lm_head=Col())
        class GPT(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.wte = nn.Embedding(config.vocab_size, config.n_embd)
                self.wpe = nn.Embedding(config.block_size, config.n_embd)
                self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
                self.wte.weight = self.lm_head.weight  # tied

            def forward(self, idx, targets=None):
                x = self.wte(idx)
                if targets is not None:
                    logits = self.lm_head(x)
                    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
                else:
                    logits = self.lm_head(x[:, [-1], :])  # sharded output
                    loss = None
                return logits, loss

            def loss_of_floats(self, x, y):
                z = self.lm_head(x)
                z = z.float()
                return F.cross_entropy(z[:, :-1].contiguous().flatten(0, 1), y.flatten())

            def loss_of_something_else(self, x, y):
                z = self.lm_head(x)
                z = postprocess(z)
                return F.cross_entropy(z, y) + F.cross_entropy(self.wpe(x), y)
        """,
        """
        import torch.nn as nn
        from torch.nn import functional as F
        from annot import shard, Col, Vocab
        from annot.runtime.tp.layers import ColumnParallelLinear, VocabParallelEmbedding
        from annot.runtime.tp.vocab_loss import vocab_parallel_cross_entropy


        # annot: @shard(wte=Vocab(), lm_head=Col()) applied for tp=2
        class GPT(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, tp=2)
                self.wpe = nn.Embedding(config.block_size, config.n_embd)
                self.lm_head = ColumnParallelLinear(config.n_embd, config.vocab_size, bias=False, tp=2)
                self.wte.weight = self.lm_head.weight  # tied

            def forward(self, idx, targets=None):
                x = self.wte(idx)
                if targets is not None:
                    logits = self.lm_head(x)
                    loss = vocab_parallel_cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
                else:
                    logits = self.lm_head(x[:, [-1], :])  # sharded output
                    loss = None
                return logits, loss

            def loss_of_floats(self, x, y):
                z = self.lm_head(x)
                z = z.float()
                return vocab_parallel_cross_entropy(z[:, :-1].contiguous().flatten(0, 1), y.flatten())

            def loss_of_something_else(self, x, y):
                z = self.lm_head(x)
                z = postprocess(z)
                return F.cross_entropy(z, y) + F.cross_entropy(self.wpe(x), y)
        """,
    )


def test_gathered_col_keeps_plain_loss():
    assert_rewrite(
        """
        from torch import nn
        import torch.nn.functional as F
        from annot import shard, Col


        @shard(head=Col(gather=True))
        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.head = nn.Linear(8, 16)

            def forward(self, x, y):
                return F.cross_entropy(self.head(x), y)
        """,
        """
        from torch import nn
        import torch.nn.functional as F
        from annot import shard, Col
        from annot.runtime.tp.layers import ColumnParallelLinear


        # annot: @shard(head=Col(gather=True)) applied for tp=2
        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.head = ColumnParallelLinear(8, 16, gather=True, tp=2)

            def forward(self, x, y):
                return F.cross_entropy(self.head(x), y)
        """,
    )


HF_HEAD = """import torch
import torch.nn as nn
import torch.nn.functional as F
from annot import shard, Col


@shard(decoder=Col())
class Head(nn.Module):
    def __init__(self, d, v):
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.decoder = nn.Linear(d, v)

    def forward(self, x):
        return self.decoder(torch.tanh(self.dense(x)))


class Top(nn.Module):
    def __init__(self, d, v):
        super().__init__()
        self.body = nn.Linear(d, d)
        self.cls = Head(d, v)

    def forward(self, x, labels):
        logits = self.cls(self.body(x))
"""


def test_head_submodule_loss_in_parent_is_vocab_parallel():
    assert_rewrite(
        """
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        from annot import shard, Col


        @shard(decoder=Col())
        class Head(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.dense = nn.Linear(d, d)
                self.decoder = nn.Linear(d, v)

            def forward(self, x):
                return self.decoder(torch.tanh(self.dense(x)))


        class Top(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.body = nn.Linear(d, d)
                self.cls = Head(d, v)

            def forward(self, x, labels):
                logits = self.cls(self.body(x))
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
                return logits, loss  # sharded logits may be returned


        class Plain(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.body = nn.Linear(d, v)

            def forward(self, x, labels):
                return F.cross_entropy(self.body(x), labels)
        """,
        """
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        from annot import shard, Col
        from annot.runtime.tp.layers import ColumnParallelLinear
        from annot.runtime.tp.vocab_loss import vocab_parallel_cross_entropy


        # annot: @shard(decoder=Col()) applied for tp=2
        class Head(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.dense = nn.Linear(d, d)
                self.decoder = ColumnParallelLinear(d, v, tp=2)

            def forward(self, x):
                return self.decoder(torch.tanh(self.dense(x)))


        class Top(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.body = nn.Linear(d, d)
                self.cls = Head(d, v)

            def forward(self, x, labels):
                logits = self.cls(self.body(x))
                loss = vocab_parallel_cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
                return logits, loss  # sharded logits may be returned


        class Plain(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.body = nn.Linear(d, v)

            def forward(self, x, labels):
                return F.cross_entropy(self.body(x), labels)
        """,
    )


def test_nested_two_level_head_and_tuple_outputs():
    # BertForMaskedLM's shape: cls -> predictions -> decoder, the loss two levels up,
    # and a wrapper that takes the logits out of the parent's tuple output
    before = """
        import torch.nn as nn
        from torch.nn import functional as G
        import annot


        @annot.shard(decoder=annot.Col())
        class Predictions(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.transform = nn.Linear(d, d)
                self.decoder = nn.Linear(d, v)

            def forward(self, h):
                h = self.transform(h)
                h = self.decoder(h)
                return h


        class MLMHead(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.predictions = Predictions(d, v)

            def forward(self, h):
                scores = self.predictions(h)
                return scores


        class ForMaskedLM(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.bert = nn.Linear(d, d)
                self.cls = MLMHead(d, v)

            def forward(self, x, labels):
                outputs = (self.bert(x),)
                scores = self.cls(outputs[0])
                loss = G.cross_entropy(scores.flatten(0, -2), labels.flatten())
                direct = G.cross_entropy(self.cls.predictions(outputs[0]).float(), labels)
                return (loss + direct,) + (scores,)


        class Wrapper(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.model = ForMaskedLM(d, v)

            def forward(self, x, labels):
                loss, logits = self.model(x, labels)
                out = self.model(x, labels)
                return G.cross_entropy(logits[:, 1:], labels) + G.cross_entropy(out[-1], labels)
        """
    after = before.replace(
        "@annot.shard(decoder=annot.Col())",
        "# annot: @shard(decoder=Col()) applied for tp=2",
    ).replace("self.decoder = nn.Linear(d, v)", "self.decoder = ColumnParallelLinear(d, v, tp=2)")
    after = after.replace("G.cross_entropy(", "vocab_parallel_cross_entropy(").replace(
        "        import annot\n",
        "        import annot\n"
        "        from annot.runtime.tp.layers import ColumnParallelLinear\n"
        "        from annot.runtime.tp.vocab_loss import vocab_parallel_cross_entropy\n",
    )
    assert after.count("vocab_parallel_cross_entropy(") == 4
    assert_rewrite(before, after)


def test_cross_entropy_loss_modules_are_rewritten_with_their_arguments():
    before = """
        import torch
        import torch.nn as nn
        from torch.nn import CrossEntropyLoss
        from annot import shard, Col


        @shard(decoder=Col())
        class Head(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.decoder = nn.Linear(d, v)

            def forward(self, x):
                return self.decoder(x)


        class Top(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.cls = Head(d, v)
                self.loss_fct = nn.CrossEntropyLoss(ignore_index=-1, reduction="sum")

            def forward(self, x, labels):
                logits = self.cls(x)
                loss_fct = CrossEntropyLoss()  # -100 index = padding token
                a = loss_fct(logits.view(-1, logits.size(-1)), labels.view(-1))
                b = self.loss_fct(logits, labels)
                c = nn.CrossEntropyLoss(label_smoothing=self.smoothing)(input=logits, target=labels)
                d = torch.nn.CrossEntropyLoss(None, None, 0)(logits, labels)
                return a + b + c + d
        """
    after = (
        before.replace(
            "from annot import shard, Col\n",
            "from annot import shard, Col\n"
            "        from annot.runtime.tp.layers import ColumnParallelLinear\n"
            "        from annot.runtime.tp.vocab_loss import vocab_parallel_cross_entropy\n",
        )
        .replace("@shard(decoder=Col())", "# annot: @shard(decoder=Col()) applied for tp=2")
        .replace(
            "self.decoder = nn.Linear(d, v)", "self.decoder = ColumnParallelLinear(d, v, tp=2)"
        )
        .replace(
            "a = loss_fct(logits.view(-1, logits.size(-1)), labels.view(-1))",
            "a = vocab_parallel_cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))",
        )
        .replace(
            "b = self.loss_fct(logits, labels)",
            'b = vocab_parallel_cross_entropy(logits, labels, ignore_index=-1, reduction="sum")',
        )
        .replace(
            "c = nn.CrossEntropyLoss(label_smoothing=self.smoothing)(input=logits, target=labels)",
            "c = vocab_parallel_cross_entropy(input=logits, target=labels, "
            "label_smoothing=self.smoothing)",
        )
        .replace(
            "d = torch.nn.CrossEntropyLoss(None, None, 0)(logits, labels)",
            "d = vocab_parallel_cross_entropy(logits, labels, weight=None, size_average=None, "
            "ignore_index=0)",
        )
    )
    assert after.count("vocab_parallel_cross_entropy(") == 4
    assert_rewrite(before, after)


def test_cross_entropy_loss_import_alias_is_matched():
    # the HF_HEAD source has no CrossEntropyLoss import: add one for this case
    source = (
        HF_HEAD.replace(
            "import torch.nn as nn\n",
            "import torch.nn as nn\nfrom torch.nn import CrossEntropyLoss as CE\n",
        )
        + "        return CE(reduction='none')(logits, labels)\n"
    )
    out = rewrite_tensor_parallel(source, 2, path="model.py")
    assert "return vocab_parallel_cross_entropy(logits, labels, reduction='none')\n" in out
    compile(out, "model.py", "exec")


def test_a_gathered_head_keeps_the_parent_loss_plain():
    source = HF_HEAD.replace("@shard(decoder=Col())", "@shard(decoder=Col(gather=True))") + (
        "        return F.cross_entropy(logits, labels), logits.softmax(-1)\n"
    )
    out = rewrite_tensor_parallel(source, 2, path="model.py")
    assert "return F.cross_entropy(logits, labels), logits.softmax(-1)\n" in out
    assert "vocab_parallel_cross_entropy" not in out


_FIX = (
    "compute the loss with F.cross_entropy on it (annot makes that "
    "vocab_parallel_cross_entropy), or hint decoder=Col(gather=True) on Head so that every "
    "rank has the full logits"
)


_SHARDED = (
    "is vocab-sharded (Col() without gather on Head.decoder: each rank holds 1/2 of its last dim)"
)


@pytest.mark.parametrize(
    "line, col, reason",
    [
        (
            "loss = self.loss_function(logits, labels, vocab_size=8)",
            16,
            f"logits {_SHARDED}, and annot cannot tell what self.loss_function(...) computes, "
            f"so it cannot make it correct on a sharded value; {_FIX}",
        ),
        (
            "loss = F.nll_loss(logits.float(), labels)",
            16,
            f"logits.float() {_SHARDED}, and annot cannot tell what F.nll_loss(...) computes, "
            f"so it cannot make it correct on a sharded value; {_FIX}",
        ),
        (
            "loss = nn.NLLLoss()(logits, labels)",
            16,
            f"logits {_SHARDED}, and annot cannot tell what nn.NLLLoss()(...) computes, so it "
            f"cannot make it correct on a sharded value; {_FIX}",
        ),
        (
            "loss = self.my_loss((logits, labels))",
            16,
            f"(logits, labels) {_SHARDED}, and annot cannot tell what self.my_loss(...) "
            f"computes, so it cannot make it correct on a sharded value; {_FIX}",
        ),
        (
            "probs = F.softmax(logits, dim=-1)",
            17,
            f"logits {_SHARDED}, and F.softmax(...) over its last dim would see only this "
            f"rank's slice; {_FIX}",
        ),
        (
            "lp = torch.log_softmax(logits[:, 0], -1)",
            14,
            f"logits[:, 0] {_SHARDED}, and torch.log_softmax(...) over its last dim would see "
            f"only this rank's slice; {_FIX}",
        ),
        (
            "best = logits.argmax(-1)",
            16,
            f"logits {_SHARDED}, and .argmax(...) over its last dim would see only this "
            f"rank's slice; {_FIX}",
        ),
        (
            "v, i = torch.topk(logits, 5)",
            16,
            f"logits {_SHARDED}, and torch.topk(...) over its last dim would see only this "
            f"rank's slice; {_FIX}",
        ),
        (
            "loss = F.cross_entropy(logits.view(-1, self.vocab_size), labels.view(-1))",
            32,
            "logits.view(-1, self.vocab_size) feeds a loss, but logits "
            f"{_SHARDED}, and annot cannot prove the result keeps that per-rank last dim; "
            "write the last dim as logits.size(-1) (logits.view(-1, logits.size(-1))), or hint "
            "decoder=Col(gather=True) on Head so that every rank has the full logits",
        ),
        (
            "loss = nn.CrossEntropyLoss()(logits.flatten(), labels)",
            38,
            "logits.flatten() feeds a loss, but logits "
            f"{_SHARDED}, and annot cannot prove the result keeps that per-rank last dim; "
            "flatten only the leading dims (logits.flatten(0, -2)), or hint "
            "decoder=Col(gather=True) on Head so that every rank has the full logits",
        ),
        (
            "loss = nn.CrossEntropyLoss()(logits, labels, 3)",
            16,
            "the input of nn.CrossEntropyLoss()(...) is vocab-sharded (Col() without gather "
            "on Head.decoder); annot rewrites the call to vocab_parallel_cross_entropy(input, "
            "target, ...) but cannot map its arguments; call it as loss(input, target), or "
            "call F.cross_entropy(input, target) directly (annot makes that vocab-parallel)",
        ),
    ],
)
def test_refuses_sharded_logits_where_it_cannot_prove_the_loss(line, col, reason):
    err = refusal(HF_HEAD + f"        {line}\n        return logits\n")
    assert (err.line, err.col) == (26, col)
    assert err.reason == reason


def test_refuses_a_loss_module_whose_arguments_cannot_move():
    err = refusal(
        HF_HEAD.replace(
            "self.cls = Head(d, v)\n",
            "self.cls = Head(d, v)\n        self.loss_fct = nn.CrossEntropyLoss(ignore_index=self.pad)\n",
        )
        + "        return self.loss_fct(logits, labels)\n"
    )
    assert (err.line, err.col) == (27, 16)
    assert err.reason == (
        "self.loss_fct is nn.CrossEntropyLoss(ignore_index=self.pad) and its input is "
        "vocab-sharded (Col() without gather on Head.decoder); annot rewrites the call to "
        "vocab_parallel_cross_entropy(input, target, <the constructor's arguments>) but its "
        "argument ignore_index=self.pad is not a literal, so annot cannot move it to the call; "
        "call F.cross_entropy(input, target, ignore_index=...) directly (annot makes that "
        "vocab-parallel), or hint decoder=Col(gather=True) on Head"
    )


def test_sharded_values_it_does_not_follow_are_left_alone():
    # helpers, arithmetic and names with other definitions are documented as not seen
    source = HF_HEAD + (
        "        scaled = logits / 2.0\n"
        "        probs = F.softmax(scaled, -1)\n"
        "        other = postprocess(logits)\n"
        "        return F.cross_entropy(other, labels), probs\n"
    )
    out = rewrite_tensor_parallel(source, 2, path="model.py")
    assert "return F.cross_entropy(other, labels), probs\n" in out
    assert "probs = F.softmax(scaled, -1)\n" in out
