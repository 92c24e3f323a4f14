"""How many hint lines users still write at tp=2 (issue 45, item 5).

For each model, annot.parallelize(..., mesh=Mesh(tp=2)) with no hints, on two
gloo ranks, against the single-device model: one step, the loss and every
gradient. The lines a user still writes are 0 where that run is exact, else
the lines of the hand hints the test suite gives it (the model is refused,
never run wrong: the pre-flight or the first-call check names why).

    python benchmarks/hint_lines.py            # a table; about 3 minutes on 2 CPU cores
    python benchmarks/hint_lines.py bert       # the models whose name holds "bert"
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hf(name: str):
    import transformers as T

    causal = {
        "opt": lambda: (
            T.OPTForCausalLM,
            T.OPTConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                ffn_dim=64, word_embed_proj_dim=32, dropout=0.0,
            ),
        ),
        "gpt_neo": lambda: (
            T.GPTNeoForCausalLM,
            T.GPTNeoConfig(
                vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                attention_types=[[["global"], 2]], embed_dropout=0.0, resid_dropout=0.0,
                attention_dropout=0.0,
            ),
        ),
        "biogpt": lambda: (
            T.BioGptForCausalLM,
            T.BioGptConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            ),
        ),
        "mpt": lambda: (
            T.MptForCausalLM, T.MptConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4)
        ),
        "xglm": lambda: (
            T.XGLMForCausalLM,
            T.XGLMConfig(
                vocab_size=64, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            ),
        ),
        "gpt_bigcode": lambda: (
            T.GPTBigCodeForCausalLM,
            T.GPTBigCodeConfig(
                vocab_size=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0,
            ),
        ),
        "bert": lambda: (
            T.BertForMaskedLM,
            T.BertConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            ),
        ),
    }  # fmt: skip
    if name in causal:
        return causal[name]()
    from tests.e2e.test_hf_tp_models import _build

    return _build(name)


# name -> (builder () -> (class, args), kind, hand hint lines in the test suite)
MODELS = {
    "TinyLM (tests/thirdparty_models.py)": ("tiny", "lm_pair", 7),
    "XLM, x-transformers style (tests)": ("xlm", "loss", 4),
    "timm-style ViT (tests/nested_models.py)": ("vit", "image", 5),
    "torch DTensor test Transformer": ("torch_tf", "logits", 7),
    "HF OPT": ("hf:opt", "hf", None),
    "HF GPT-Neo": ("hf:gpt_neo", "hf", None),
    "HF BioGPT": ("hf:biogpt", "hf", None),
    "HF MPT (ALiBi)": ("hf:mpt", "hf", None),
    "HF XGLM": ("hf:xglm", "hf", None),
    "HF GPT-BigCode (multi-query)": ("hf:gpt_bigcode", "hf", None),
    "HF BERT (output projection in BertSelfOutput)": ("hf:bert", "hf_mlm", None),
    "HF Falcon": ("hf:falcon", "hf", 5),
    "HF Bloom (ALiBi)": ("hf:bloom", "hf", 6),
    "HF T5": ("hf:t5", "hf_t5", 6),
}


def _build(key: str):
    import torch

    if key.startswith("hf:"):
        cls, cfg = _hf(key[3:])
        return cls, (cfg,)
    if key == "tiny":
        from tests.thirdparty_models import TinyLM

        return TinyLM, ()
    if key == "xlm":
        from tests.thirdparty_models import XLM

        return XLM, ()
    if key == "vit":
        from tests.nested_models import TimmStyleViT

        return TimmStyleViT, ()
    if key == "torch_tf":
        from torch.testing._internal.distributed._tensor.common_dtensor import (
            ModelArgs,
            Transformer,
        )

        return Transformer, (ModelArgs(n_layers=2, vocab_size=32, dim=16, n_heads=4),)
    raise KeyError(key)
    del torch


def _loss(model, kind: str, g):
    import torch
    import torch.nn.functional as F

    if kind == "image":
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
        return F.cross_entropy(model(x), y)
    ids = torch.randint(0, 32, (2, 8), generator=g)
    if kind == "lm_pair":
        return model(ids, ids)[1]
    if kind == "loss":
        return model(ids, ids)
    if kind == "logits":
        return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    if kind == "hf_mlm":
        return model(input_ids=ids, labels=ids).loss
    if kind == "hf_t5":
        return model(input_ids=ids, labels=ids, decoder_input_ids=ids, use_cache=False).loss
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _rank(key: str, kind: str, cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot

    cls, args = _build(key)
    try:
        model = annot.parallelize(cls, *args, mesh=annot.Mesh(tp=2), seed=0)
        loss = _loss(model, kind, torch.Generator().manual_seed(1))
        model.backward(loss)
    except annot.AnnotError as err:
        return "refused", f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"
    torch.manual_seed(0)
    ref = cls(*args)
    ref_loss = _loss(ref, kind, torch.Generator().manual_seed(1))
    ref_loss.backward()
    grads = model.full_grads()
    worst = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-6)
    for name, p in ref.named_parameters():
        if p.grad is not None:
            scale = max(p.grad.abs().max().item(), 1e-6)
            worst = max(worst, (grads[name] - p.grad).abs().max().item() / scale)
    lines = len(model.report.inferred.hints) if model.report.inferred else 0
    status = "exact" if worst < 1e-4 else "WRONG"
    return status, f"{lines} hints read off the sources, worst relative error {worst:.1e}"


def main() -> None:
    import tempfile

    from annot.testing import run_ranks

    only = sys.argv[1] if len(sys.argv) > 1 else ""  # a part of a name: only those
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for name, (key, kind, hand) in MODELS.items():
            if only.lower() not in name.lower():
                continue
            t = time.perf_counter()
            status, detail = run_ranks(_rank, 2, key, kind, cache, timeout=300)[0]
            still = 0 if status == "exact" else hand if hand is not None else "?"
            rows.append((name, status, str(still), detail, time.perf_counter() - t))
            print(f"{name:40s} {status:8s} lines to write: {still!s:3s} {detail}", flush=True)
    exact = sum(r[1] == "exact" for r in rows)
    wrong = sum(r[1] == "WRONG" for r in rows)
    print(f"\n{exact} of {len(rows)} models exact at tp=2 with no hints; {wrong} wrong")


if __name__ == "__main__":
    main()
