"""Shared parity checks: a parallel run against the single-device reference.

Tolerances are written down once, per dtype (float32 here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

RTOL = {torch.float32: 1e-5}
ATOL = {torch.float32: 4e-5}


def assert_close(actual, expected, what: str, dtype=torch.float32) -> None:
    torch.testing.assert_close(
        actual.detach().cpu().to(expected.dtype),
        expected.detach().cpu(),
        rtol=RTOL[dtype],
        atol=ATOL[dtype],
        msg=lambda m: f"{what}: {m}",
    )


def gather_last_dim(t: torch.Tensor, group) -> torch.Tensor:
    """All-gather a tensor sharded on its last dim over ``group``."""
    n = dist.get_world_size(group) if group is not None else 1
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def compare_state(model, ref, what: str) -> None:
    full = model.full_state_dict()
    for k, v in ref.state_dict().items():
        assert k in full, f"{what}: key {k} missing from the parallel model's state dict"
        assert_close(full[k], v, f"{what}: {k}")


def compare_grads(model, ref, what: str) -> None:
    grads = model.full_grads()
    for k, p in ref.named_parameters():
        assert p.grad is not None, f"reference {k} has no grad"
        assert k in grads, f"{what}: no gradient for {k} in the parallel model"
        assert_close(grads[k], p.grad, f"{what}: grad {k}")


def step_both(*opts) -> None:
    """One optimizer step of the parallel model and of its reference, grads cleared."""
    for opt in opts:
        opt.step()
        opt.zero_grad()


def train_against_reference(model, ref, batches, run, what: str, lr: float) -> None:
    """Step a parallel model and its single-device reference together with
    AdamW. For each batch ``run(m, batch)`` returns ``(loss, {name: output})``
    for either model; the loss, every named output and every gradient are
    compared at each step, every parameter after the last."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    step = -1
    for step, batch in enumerate(batches):
        loss, outputs = run(model, batch)
        model.backward(loss)
        ref_loss, ref_outputs = run(ref, batch)
        ref_loss.backward()
        assert_close(loss, ref_loss, f"{what} step {step}: loss")
        for name, value in outputs.items():
            assert_close(value, ref_outputs[name], f"{what} step {step}: {name}")
        compare_grads(model, ref, f"{what} step {step}")
        step_both(opt, ref_opt)
    compare_state(model, ref, f"{what} after {step + 1} AdamW steps")


def train_mse_against_reference(model, ref, what: str, width: int = 16, steps: int = 2) -> None:
    """Two AdamW steps of a model of ``(B, T, width)`` tensors under a mean
    squared error, in an ``@annot.jit`` step of two microbatches (a pipeline
    or not), against its single-device reference on the same halves: the
    loss and every gradient at each step, every parameter after the last."""
    import annot

    @annot.jit(model, microbatches=2)
    def step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        model.backward(loss)
        return loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(4, 5, width, generator=g), torch.randn(4, 5, width, generator=g)
        loss = step(x, y).reduce_mean()
        ref_loss = sum(((ref(a) - b) ** 2).mean() / 2 for a, b in zip(x.chunk(2), y.chunk(2)))
        ref_loss.backward()
        assert_close(loss, ref_loss, f"{what} step {i}: loss")
        compare_grads(model, ref, f"{what} step {i}")
        step_both(opt, ref_opt)
    compare_state(model, ref, f"{what}: after {steps} AdamW steps")


def _cross_entropy_of_logits(m, tokens, labels):
    import torch.nn.functional as F

    return F.cross_entropy(m(tokens).flatten(0, 1), labels.flatten())


def train_lm_against_reference(
    model, ref, what: str, vocab: int, steps: int = 2, loss_of=None, eps: float = 1e-8
):
    """Two AdamW steps of a language model under ``loss_of(m, tokens, labels)``
    (default: ``model(tokens)`` gives the logits, cross-entropy), in an
    ``@annot.jit`` step of two microbatches (a pipeline or not), against its
    single-device reference on the whole batch: the loss and every gradient at
    each step, every parameter after the last. Returns the step and the last
    batch (for ``step.explain``)."""
    import annot

    loss_of = loss_of or _cross_entropy_of_logits

    @annot.jit(model, microbatches=2)
    def step(tokens, labels):
        loss = loss_of(model, tokens, labels)
        model.backward(loss)
        return loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=eps)
    g = torch.Generator().manual_seed(2)
    for i in range(steps):
        x = torch.randint(0, vocab, (4, 6), generator=g)
        y = torch.randint(0, vocab, (4, 6), generator=g)
        loss = step(x, y).reduce_mean()
        ref_loss = loss_of(ref, x, y)
        ref_loss.backward()
        assert_close(loss, ref_loss, f"{what} step {i}: loss")
        compare_grads(model, ref, f"{what} step {i}")
        step_both(opt, ref_opt)
    compare_state(model, ref, f"{what}: after {steps} AdamW steps")
    return step, (x, y)


def train_pair_lm_against_reference(model, ref, what: str, vocab: int = 32):
    """:func:`train_lm_against_reference` for a model whose forward takes
    ``(tokens, labels)`` and returns ``(logits, loss)``. AdamW's eps at 1e-6:
    a key bias's true gradient is zero (softmax ignores a constant added to
    every key), and Adam's m / sqrt(v) turns its float noise into updates of
    ~lr unless eps dominates the noise."""
    return train_lm_against_reference(
        model, ref, what, vocab, loss_of=lambda m, x, y: m(x, y)[1], eps=1e-6
    )


def gpt_step(model, schedule: str = "1f1b", microbatches: int = 2):
    """The example GPT's ``@annot.jit`` training step: ``model(x, x)``'s loss,
    ``model.backward``."""
    import annot

    @annot.jit(model, microbatches=microbatches, schedule=schedule)
    def step(x):
        _, loss = model(x, x)
        model.backward(loss)
        return loss

    return step


def gpt_dp_step(model, ref, step, x: torch.Tensor, microbatches: int, what: str) -> None:
    """One step of a dp replica of the example GPT on its part of the global
    batch ``x`` (``step``: its jit step, ``model(x, x)`` inside), and of the
    reference on all of it in the same microbatches, accumulated; checks the
    dp-mean loss against the reference's (gradients are the caller's)."""
    dp = model.ctx.mesh.dp
    loss = step(x.chunk(dp)[model.ctx.dp_rank]).reduce_mean()  # this replica's part
    ref_loss = 0.0
    n = dp * microbatches  # dp replicas x microbatches, averaged
    for part in x.chunk(n):
        _, r = ref(part, part)
        (r / n).backward()
        ref_loss += r.detach() / n
    mean = loss.detach().clone()
    if dp > 1:
        dist.all_reduce(mean, group=model.ctx.dp_group)
    assert_close(mean / dp, ref_loss, f"{what}: loss")
