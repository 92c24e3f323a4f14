"""LoRA (PEFT) on a transformers Llama, as users fine-tune: no hints (the
base model's tp plan reaches through the wrapper and the adapters are
sharded to match, :mod:`annot.hf.lora`), no ``split=``, no ``sample=``. Only
the adapters train: the loss, every adapter gradient (the frozen weights get
none), every parameter after AdamW steps against the single-device PEFT
model; ``annot.save_pretrained`` writes PEFT's layout, which
``PeftModel.from_pretrained`` reloads to the same logits."""

import pytest

from annot.testing import run_ranks

pytest.importorskip("peft")


def _make(dropout: float):
    import torch
    from peft import LoraConfig, get_peft_model

    from tests.tiny_hf import tiny_llama

    cls, cfg, _ = tiny_llama()
    targets = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # Col and Row layers
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout)
    model = get_peft_model(cls(cfg), lora)
    for name, p in model.named_parameters():  # lora_B starts at zero: let it count
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _run(pp: int, tp: int, dropout: float, cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    from peft import PeftModel

    import annot
    from tests.parity import assert_close, compare_state
    from tests.tiny_hf import tiny_llama

    torch.manual_seed(0)
    model = annot.parallelize(_make(dropout), mesh=annot.Mesh(pp=pp, tp=tp))
    torch.manual_seed(0)
    ref = _make(dropout)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)

    @annot.jit(model, microbatches=2)
    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    for i in range(2):
        ids = torch.randint(0, 128, (4, 8), generator=g)
        torch.manual_seed(10 + i)  # the same dropout masks, microbatch by microbatch
        loss = step(ids).reduce_mean()
        torch.manual_seed(10 + i)
        ref_loss = sum(
            ref(input_ids=ids[j : j + 2], labels=ids[j : j + 2]).loss / 2 for j in (0, 2)
        )
        ref_loss.backward()
        assert_close(loss, ref_loss, f"step {i} loss")
        grads = model.full_grads()
        for name, p in ref.named_parameters():
            if p.requires_grad:
                assert_close(grads[name], p.grad, f"step {i} grad {name}")
            else:
                assert grads.get(name) is None, f"{name} is frozen, but has a gradient"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    compare_state(model, ref, "after 2 AdamW steps")
    saved = annot.save_pretrained(model, os.path.join(cache, "adapters"))
    cls, cfg, _ = tiny_llama()
    torch.manual_seed(0)  # the base weights _make's model starts from
    reloaded = PeftModel.from_pretrained(cls(cfg), saved).eval()
    ids = torch.randint(0, 128, (2, 8), generator=g)
    assert_close(reloaded(input_ids=ids).logits, ref.eval()(input_ids=ids).logits, "reloaded")
    return sorted(os.listdir(saved)), len(trained)


def test_lora_llama_tp2_no_hints_saved_as_peft(tmp_path):
    files, trained = run_ranks(_run, 2, 1, 2, 0.0, str(tmp_path))[0]
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    assert trained == 4 * 5 * 2  # layers x targets x (lora_A, lora_B): only the adapters


@pytest.mark.slow
@pytest.mark.parametrize("pp, tp, dropout", [(2, 1, 0.0), (2, 2, 0.0), (1, 2, 0.1)])
def test_lora_llama_pp2_automatic_tp2_pp2_and_dropout(pp, tp, dropout, tmp_path):
    files, _ = run_ranks(_run, pp * tp, pp, tp, dropout, str(tmp_path), timeout=300)[0]
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
