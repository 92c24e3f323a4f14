"""Tensor-parallel layers, collectives and the vocab-parallel loss.

Every parallel result is compared with the torch layer it replaces (built from
the same seed, weights loaded with ``load_full_state_dict``): outputs, input
gradients and the parameter gradients gathered back to full size. Multi-rank
checks run on real gloo ranks, one spawn per test; cases are drawn inside the
ranks from a seeded generator, so every rank draws the same ones.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from annot.core.errors import HintError, MeshError
from annot.core.mesh import Mesh
from annot.runtime.process_groups import ParallelContext, use
from annot.runtime.tp.comm import (
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
    split_local,
)
from annot.runtime.tp.layers import (
    ColumnParallelConv1D,
    ColumnParallelEmbedding,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_parameter,
)
from annot.runtime.tp.vocab_loss import vocab_parallel_cross_entropy
from annot.testing import run_ranks

RTOL, ATOL = 1e-5, 4e-5  # float32, written down once
ALL_REDUCE = torch.ops.c10d.allreduce_
ALL_GATHER = torch.ops.c10d._allgather_base_


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- #
# Single process: errors, tp=1, slicing
# --------------------------------------------------------------------------- #


def test_col_not_divisible_names_layer_argument_and_product():
    with pytest.raises(HintError) as info:
        ColumnParallelLinear(8, 10, tp=4)
    assert str(info.value).startswith(
        "ColumnParallelLinear: out_features=10 is not divisible by tp(4) * chunks(1) = 4"
    )
    with pytest.raises(
        HintError, match=r"out_features=15 is not divisible by tp\(2\) \* chunks\(3\) = 6"
    ):
        ColumnParallelLinear(8, 15, chunks=3, tp=2)


def test_row_and_vocab_not_divisible():
    with pytest.raises(
        HintError, match=r"^RowParallelLinear: in_features=10 is not divisible by tp\(4\)"
    ):
        RowParallelLinear(10, 8, tp=4)
    with pytest.raises(
        HintError, match=r"^VocabParallelEmbedding: num_embeddings=51 is not divisible by tp\(2\)"
    ):
        VocabParallelEmbedding(51, 8, tp=2)
    with pytest.raises(HintError, match=r"^shard_parameter: dim 1 of shape \(4, 6\) has size 6"):
        shard_parameter(nn.Parameter(torch.zeros(4, 6)), dim=1, tp=4)


def test_vocab_refuses_options_that_need_the_whole_table():
    for kwargs in ({"max_norm": 1.0}, {"sparse": True}, {"scale_grad_by_freq": True}):
        ((arg, value),) = kwargs.items()
        with pytest.raises(HintError, match=f"{arg}={value!r} is not supported with tp > 1"):
            VocabParallelEmbedding(8, 4, tp=2, **kwargs)


def test_tp_mismatch_without_context_and_with_another_mesh():
    with pytest.raises(MeshError) as info:
        ColumnParallelLinear(8, 8, tp=2)
    assert str(info.value).startswith(
        "ColumnParallelLinear(tp=2): this code was rewritten for tp=2 but no parallel "
        "context is active (tp=1)"
    )
    assert "--tp 1" in str(info.value)
    with use(ParallelContext(mesh=Mesh(tp=2))):
        with pytest.raises(
            MeshError, match=r"rewritten for tp=4 but the current mesh is Mesh\(dp=1, pp=1, tp=2\)"
        ):
            RowParallelLinear(8, 8, tp=4)
        with pytest.raises(MeshError, match="--tp 2"):
            VocabParallelEmbedding(8, 8)  # tp=1 code under a tp=2 mesh


def test_bad_degree_and_chunks():
    with pytest.raises(HintError, match="tp=0 must be an int >= 1"):
        RowParallelLinear(4, 4, tp=0)
    with pytest.raises(HintError, match="chunks=0 must be an int >= 1"):
        ColumnParallelLinear(4, 4, chunks=0)


def test_tp1_layers_are_the_torch_layers():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 6)
    for layer, ref in (
        (ColumnParallelLinear(6, 9, chunks=3, gather=True), nn.Linear(6, 9)),
        (RowParallelLinear(6, 4, bias=False), nn.Linear(6, 4, bias=False)),
    ):
        layer.load_state_dict(ref.state_dict())
        assert torch.equal(layer(x), ref(x))
    emb = VocabParallelEmbedding(10, 4, padding_idx=-1, max_norm=1.0)
    ref = nn.Embedding(10, 4, padding_idx=-1, max_norm=1.0)
    emb.load_state_dict(ref.state_dict())
    ids = torch.tensor([[0, 9, 3], [9, 9, 1]])
    assert torch.equal(emb(ids), ref(ids))
    logits, target = torch.randn(6, 10), torch.tensor([1, -1, 3, 9, 0, -1])
    assert torch.equal(
        vocab_parallel_cross_entropy(logits, target, ignore_index=-1),
        F.cross_entropy(logits, target, ignore_index=-1),
    )
    # the comm functions are identities with no context
    assert all(f(x) is x for f in (copy_to_tp, reduce_from_tp, gather_from_tp, scatter_to_tp))


def test_init_distribution_and_repr():
    torch.manual_seed(0)
    col = ColumnParallelLinear(64, 32, chunks=2)
    bound = 1 / 64**0.5
    assert col.weight.abs().max() <= bound
    assert col.weight.abs().max() > 0.9 * bound
    emb = VocabParallelEmbedding(16, 4, padding_idx=3)
    assert torch.equal(emb.weight[3], torch.zeros(4))
    assert "chunks=2, tp=1, local_weight=(32, 64)" in repr(col)
    assert "tp=1, local_weight=(16, 4), rows=[0, 16)" in repr(emb)
    assert col.annot_shard_layout() == {"weight": (0, 2), "bias": (0, 2)}
    assert RowParallelLinear(4, 4).annot_shard_layout() == {"weight": (1, 1)}


@settings(derandomize=True, deadline=None, max_examples=40)
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    tp=st.sampled_from([1, 2, 4]),
    chunks=st.integers(1, 3),
    local=st.integers(1, 3),
    data=st.data(),
)
def test_split_local_takes_each_ranks_slice_of_every_chunk(lead, tp, chunks, local, data):
    shape = [*lead, chunks * tp * local]
    dim = data.draw(st.integers(0, len(shape) - 1))
    shape[dim], shape[-1] = shape[-1], shape[dim]  # the split dim may be any dim
    x = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for rank in range(tp):
        got = split_local(x, dim, chunks, tp, rank)
        for k in range(chunks):
            start = (k * tp + rank) * local
            assert torch.equal(got.narrow(dim, k * local, local), x.narrow(dim, start, local)), (
                rank,
                k,
            )


# --------------------------------------------------------------------------- #
# Multi-rank parity
# --------------------------------------------------------------------------- #


def _setup(mesh):
    from annot.runtime.process_groups import init

    ctx = init(mesh)
    torch.manual_seed(1234)  # the same reference weights and inputs on every rank
    return ctx


def _run_linear(ref, layer, x, *, in_split, out_chunks, ctx):
    """Run ``ref`` on the full input and ``layer`` on its (maybe sharded) input;
    compare output, input grad and full weight grads. ``out_chunks`` is None
    when the layer's output is full, else the chunks of its sharded output."""
    from annot.runtime.tp.state_dict import full_grads, load_full_state_dict

    tp, rank = ctx.mesh.tp, ctx.tp_rank
    load_full_state_dict(layer, ref.state_dict())
    xr = x.clone().requires_grad_(True)
    yr = ref(xr)
    grad_out = torch.randn_like(yr)
    yr.backward(grad_out)

    xl = (split_local(x, -1, 1, tp, rank) if in_split else x).clone().requires_grad_(True)
    y = layer(xl)
    if out_chunks is None:
        _close(y, yr, "output")
        y.backward(grad_out)
    else:
        _close(y, split_local(yr, -1, out_chunks, tp, rank), "local output")
        y.backward(split_local(grad_out, -1, out_chunks, tp, rank))
    expected_xgrad = split_local(xr.grad, -1, 1, tp, rank) if in_split else xr.grad
    _close(xl.grad, expected_xgrad, "input grad")
    grads = full_grads(layer)
    for name, p in ref.named_parameters():
        _close(grads[name], p.grad, f"grad of {name}")


def _linear_cases(tp):
    from annot.runtime.process_groups import use

    ctx = _setup(Mesh(tp=tp))
    rng = random.Random(tp)
    with use(ctx):
        for _ in range(4):
            lead = [rng.randint(1, 3) for _ in range(rng.randint(1, 2))]
            n_in, chunks = 4 * rng.randint(1, 3), rng.randint(1, 3)
            n_out = chunks * tp * rng.randint(1, 3)
            bias, gather = rng.random() < 0.7, rng.random() < 0.5
            x = torch.randn(*lead, n_in)
            col = ColumnParallelLinear(n_in, n_out, bias, chunks=chunks, gather=gather, tp=tp)
            _run_linear(
                nn.Linear(n_in, n_out, bias),
                col,
                x,
                in_split=False,
                out_chunks=None if gather else chunks,
                ctx=ctx,
            )
            n_in_row = tp * rng.randint(1, 4)
            x = torch.randn(*lead, n_in_row)
            row = RowParallelLinear(n_in_row, n_out, bias, tp=tp)
            _run_linear(
                nn.Linear(n_in_row, n_out, bias), row, x, in_split=True, out_chunks=None, ctx=ctx
            )

        # Fused QKV (chunks=3): local output is this rank's q|k|v; gathered is the full one.
        ref = nn.Linear(8, 3 * 4 * tp)
        x = torch.randn(2, 5, 8)
        for gather in (False, True):
            qkv = ColumnParallelLinear(8, 3 * 4 * tp, chunks=3, gather=gather, tp=tp)
            ref.zero_grad()
            _run_linear(ref, qkv, x, in_split=False, out_chunks=None if gather else 3, ctx=ctx)
            if not gather:
                q, k, v = qkv(x).split(4, dim=-1)  # the layout attention code relies on
                q_ref, k_ref, v_ref = ref(x).split(4 * tp, dim=-1)
                for got, full in ((q, q_ref), (k, k_ref), (v, v_ref)):
                    _close(got, full[..., 4 * ctx.tp_rank : 4 * (ctx.tp_rank + 1)], "q/k/v heads")
    return True


def test_linear_layers_match_nn_linear_tp2():
    assert run_ranks(_linear_cases, 2, 2, timeout=240) == [True, True]


class _Gated(nn.Module):
    """gate and up read one input, which a replicated path reads too; with
    ``change`` the input is changed in place between the two column layers."""

    def __init__(self, gate, up, down, change=False):
        super().__init__()
        self.gate, self.up, self.down, self.change = gate, up, down, change

    def forward(self, x):
        h = x * 1.0
        a = F.silu(self.gate(h))
        if self.change:
            h.mul_(3.0)
        return self.down(a * self.up(h)) + h.sum(-1, keepdim=True)


def _shared_input(tp):
    from torch.distributed.tensor.debug import CommDebugMode

    from annot.runtime.tp.state_dict import full_grads, load_full_state_dict

    ctx = _setup(Mesh(tp=tp))
    with use(ctx):
        for change, seq in ((False, False), (True, True)):
            # No bias on down: under sequence parallelism its gradient is partial per shard.
            ref = _Gated(
                nn.Linear(8, 8 * tp), nn.Linear(8, 8 * tp), nn.Linear(8 * tp, 8, bias=False), change
            )
            layers = [ColumnParallelLinear(8, 8 * tp, tp=tp) for _ in range(2)]
            par = _Gated(*layers, RowParallelLinear(8 * tp, 8, bias=False, tp=tp), change)
            if seq:  # sequence parallelism: column layers gather shards, the row one scatters
                for layer in (*layers, par.down):
                    layer.sequence_dim = 1
            load_full_state_dict(par, ref.state_dict())
            if change:  # a frozen gate keeps no input for its backward: the change is legal
                for gate in (ref.gate, par.gate):
                    gate.requires_grad_(False)
            x = torch.randn(2, 2 * tp, 8)
            xr = x.clone().requires_grad_(True)
            xt = (split_local(x, 1, 1, tp, ctx.tp_rank) if seq else x).clone().requires_grad_()
            y = par(xt)  # not under CommDebugMode: its module hooks give each layer a new x
            with CommDebugMode() as bwd:
                y.pow(2).sum().backward()
            y_ref = ref(xr)
            y_ref.pow(2).sum().backward()
            what = "in-place change, sequence shards" if change else "shared input"
            _close(y, split_local(y_ref, 1, 1, tp, ctx.tp_rank) if seq else y_ref, f"{what}: out")
            want = split_local(xr.grad, 1, 1, tp, ctx.tp_rank) if seq else xr.grad
            _close(xt.grad, want, f"{what}: input grad")
            grads = full_grads(par)
            for name, p in ref.named_parameters():
                if p.requires_grad:
                    _close(grads[name], p.grad, f"{what}: grad {name}")
            if not change:  # gate and up share one all-reduce of their summed input grad
                assert bwd.get_comm_counts() == {ALL_REDUCE: 1}, bwd.get_comm_counts()
        # An entry made while autograd is off is not reused once it records.
        col = ColumnParallelLinear(8, 8 * tp, tp=tp)
        xt = torch.randn(2, 8, requires_grad=True)
        with torch.no_grad():
            col(xt)
        col(xt).sum().backward()
        fresh = xt.detach().clone().requires_grad_(True)
        col(fresh).sum().backward()
        assert xt.grad is not None, "an input gradient cut off by an entry made under no_grad"
        _close(xt.grad, fresh.grad, "input grad after an evaluation on the same input")
    return True


def test_column_layers_reading_one_input_reduce_its_gradient_once_tp2():
    assert run_ranks(_shared_input, 2, 2, timeout=240) == [True, True]


class _Conv1D(nn.Module):
    """HF ``Conv1D``'s layout (weight ``(in, out)``), the reference of
    ``ColumnParallelConv1D``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return x @ self.weight + self.bias


def _entry_reductions(out):
    """The column entries' input-gradient reductions in ``out``'s graph."""
    seen, todo, found = set(), [out.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "reduction", None) is not None:
            found.append(node.reduction)
        todo.extend(n for n, _ in node.next_functions)
    return found


def _overlap(tp):
    """The last column layer reading an entry starts the entry's reduction
    before its weight gradient is computed (Megatron's overlap), for the
    all-reduce and for sequence parallelism's reduce-scatter; the gradients
    equal the reference's, each weight's hooks fire once; under
    torch.autograd.grad they are returned, not accumulated; under autocast
    they are bf16's."""
    from annot.runtime.tp.state_dict import full_grads, load_full_state_dict

    ctx = _setup(Mesh(tp=tp))
    with use(ctx):
        ref = _Gated(_Conv1D(8 * tp, 8), nn.Linear(8, 8 * tp), nn.Linear(8 * tp, 8, bias=False))
        par = _Gated(
            ColumnParallelConv1D(8 * tp, 8, tp=tp),
            ColumnParallelLinear(8, 8 * tp, tp=tp),
            RowParallelLinear(8 * tp, 8, bias=False, tp=tp),
        )
        load_full_state_dict(par, ref.state_dict())
        x = torch.randn(2, 2 * tp, 8)
        for seq, overlap in ((False, True), (True, True), (False, False)):
            for layer in (par.gate, par.up, par.down):
                layer.sequence_dim = 1 if seq else None
            par.gate.overlap_backward = par.up.overlap_backward = overlap
            for model in (par, ref):
                model.zero_grad(set_to_none=True)
            seen, entry = {}, []

            def record(name, seen=seen, entry=entry):
                def hook(p):
                    seen.setdefault(name, []).append(entry[0].started is not None)

                return hook

            handles = [
                p.register_post_accumulate_grad_hook(record(n)) for n, p in par.named_parameters()
            ]
            xr = x.clone().requires_grad_(True)
            xt = (split_local(x, 1, 1, tp, ctx.tp_rank) if seq else x).clone().requires_grad_()
            y = par(xt)
            entry[:] = _entry_reductions(y)
            (reduction,) = entry
            assert reduction.readers == (2 if overlap else 0), "gate and up read one entry"
            y.pow(2).sum().backward()
            for h in handles:
                h.remove()
            ref(xr).pow(2).sum().backward()
            assert all(len(v) == 1 for v in seen.values()), seen
            started = {name for name, (s,) in seen.items() if s}
            # gate was called first: its backward runs last and starts the reduction
            # (without the overlap: autograd's order, the reduction after every weight).
            assert started == ({"gate.weight", "gate.bias"} if overlap else set()), (seq, seen)
            want = split_local(xr.grad, 1, 1, tp, ctx.tp_rank) if seq else xr.grad
            _close(xt.grad, want, f"input grad (seq={seq})")
            grads = full_grads(par)
            for name, p in ref.named_parameters():
                _close(grads[name], p.grad, f"grad {name} (seq={seq})")
            assert reduction.started is None, "reset"
            assert reduction.arrived == 0, "reset"
        for layer in (par.gate, par.up, par.down):
            layer.sequence_dim = None

        # torch.autograd.grad: the gradients are returned, nothing accumulates.
        for model in (par, ref):
            model.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        ref(xr).pow(2).sum().backward()
        xt = x.clone().requires_grad_(True)
        gw, gx = torch.autograd.grad(par(xt).pow(2).sum(), [par.up.weight, xt])
        _close(gx, xr.grad, "autograd.grad input grad")
        _close(gw, split_local(ref.up.weight.grad, 0, 1, tp, ctx.tp_rank), "autograd.grad weight")
        assert all(p.grad is None for p in par.parameters()), "autograd.grad accumulated"

        # Autocast: bf16 matmuls, float32 gradients, close to the reference's.
        for model in (par, ref):
            model.zero_grad(set_to_none=True)
        outs = []
        for model in (par, ref):
            xb = x.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(xb)
            out.float().pow(2).sum().backward()
            outs.append((out, xb.grad))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert par.up(x.clone().requires_grad_()).dtype == torch.bfloat16
        bf16 = {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(outs[0][0], outs[1][0], **bf16)
        torch.testing.assert_close(outs[0][1], outs[1][1], **bf16)
        grads = full_grads(par)
        for name, p in ref.named_parameters():
            assert grads[name].dtype == torch.float32, name
            torch.testing.assert_close(grads[name], p.grad, **bf16, msg=f"bf16 grad {name}")
    return True


def test_column_weight_gradients_overlap_the_input_all_reduce_tp2():
    assert run_ranks(_overlap, 2, 2, timeout=240) == [True, True]


def _bookkeeping():
    """One real gloo rank: the hand-off of input gradients to an entry's
    reduction gives autograd's gradients whatever runs: a reader whose output
    gets no gradient, a second backward through the same graph, the
    zero-bubble split passes, a double backward; meta tensors pass."""
    import torch.distributed as dist

    from annot.runtime.pipeline.split_backward import backward_input, backward_weight
    from annot.runtime.tp.column_matmul import column_matmul
    from annot.runtime.tp.comm import CopyToTP

    group = dist.group.WORLD
    torch.manual_seed(0)
    w1, w2 = (nn.Parameter(torch.randn(6, 4)) for _ in range(2))
    b1 = nn.Parameter(torch.randn(6))
    x0 = torch.randn(3, 4)

    def run(handoff, loss_of, how):
        for p in (w1, w2, b1):
            p.grad = None
        x = x0.clone().requires_grad_(True)
        h = x * 2.0
        if handoff:
            e = CopyToTP.apply(h, group, True, True)
            y1, y2 = column_matmul(e, w1, b1, False), column_matmul(e, w2, None, False)
            assert e.grad_fn.reduction.readers == 2
        else:
            y1, y2 = F.linear(h, w1, b1), F.linear(h, w2)
        loss = loss_of(y1, y2)
        if how == "twice":
            loss.backward(retain_graph=True)
            loss.backward()
        elif how == "double":
            (gx,) = torch.autograd.grad(loss, [x], create_graph=True)
            gx.pow(2).sum().backward()
        elif how == "split":
            (gx,), work = backward_input([loss], None, [x], [w1, w2, b1])
            x.grad = gx
            backward_weight(work)
        else:
            loss.backward()
        return [t.grad for t in (x, w1, w2, b1)]

    losses = {
        "both": lambda y1, y2: (y1 * y2.sin()).sum(),
        "one unused": lambda y1, y2: y1.pow(2).sum(),
    }
    for name, loss_of in losses.items():
        for how in ("once", "twice", "double", "split"):
            got, want = run(True, loss_of, how), run(False, loss_of, how)
            for g, r, what in zip(got, want, ("x", "w1", "w2", "b1")):
                assert (g is None) == (r is None), (name, how, what)
                if r is not None:
                    _close(g, r, f"{name}, {how}: grad {what}")

    # Meta tensors (a pipeline stage's shapes): no collective, the right shape.
    xm = torch.empty(3, 4, device="meta", requires_grad=True)
    em = CopyToTP.apply(xm * 1.0, group, True, True)
    ym = column_matmul(em, w1.to("meta"), None, False)
    assert ym.shape == (3, 6)
    assert ym.is_meta
    return True


def test_input_grad_reduction_bookkeeping_one_rank():
    assert run_ranks(_bookkeeping, 1, timeout=120) == [True]


def _mlp_and_embedding(tp):
    from torch.distributed.tensor.debug import CommDebugMode

    from annot.runtime.process_groups import use
    from annot.runtime.tp.state_dict import full_grads, load_full_state_dict

    ctx = _setup(Mesh(tp=tp))
    rank = ctx.tp_rank
    with use(ctx):
        # Col -> GELU -> Row: one all-reduce forward, one backward.
        ref = nn.Sequential(nn.Linear(8, 8 * tp), nn.GELU(), nn.Linear(8 * tp, 8))
        mlp = nn.Sequential(
            ColumnParallelLinear(8, 8 * tp, tp=tp), nn.GELU(), RowParallelLinear(8 * tp, 8, tp=tp)
        )
        load_full_state_dict(mlp, ref.state_dict())
        x = torch.randn(2, 3, 8)
        xr, xt = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        with CommDebugMode() as fwd:
            y = mlp(xt)
        with CommDebugMode() as bwd:
            y.pow(2).sum().backward()
        assert fwd.get_comm_counts() == {ALL_REDUCE: 1}, fwd.get_comm_counts()
        assert bwd.get_comm_counts() == {ALL_REDUCE: 1}, bwd.get_comm_counts()
        ref(xr).pow(2).sum().backward()
        _close(y, ref(xr), "mlp output")
        _close(xt.grad, xr.grad, "mlp input grad")
        grads = full_grads(mlp)
        for name, p in ref.named_parameters():
            _close(grads[name], p.grad, f"mlp grad {name}")
        # Without an input that needs grad, the backward all-reduce is skipped.
        with CommDebugMode() as bwd:
            mlp(x).sum().backward()
        assert bwd.get_comm_counts() == {ALL_REDUCE: 1}, "forward only"

        # Vocab-parallel embedding; ids cover every shard, padding row included.
        vocab = 4 * tp
        ref = nn.Embedding(vocab, 6, padding_idx=vocab - 1)
        emb = VocabParallelEmbedding(vocab, 6, padding_idx=vocab - 1, tp=tp)
        load_full_state_dict(emb, ref.state_dict())
        ids = torch.cat([torch.arange(vocab), torch.randint(0, vocab, (24 - vocab,))]).view(3, -1)
        out, out_ref = emb(ids), ref(ids)
        _close(out, out_ref, "embedding output")
        g = torch.randn_like(out)
        out.backward(g)
        out_ref.backward(g)
        _close(full_grads(emb)["weight"], ref.weight.grad, "embedding grad")
        assert (emb.weight.grad[-1] == 0).all() or rank != tp - 1, "padding row gets no grad"
        with torch.no_grad():
            _close(emb(ids), ref(ids), "embedding output without grad")
            from_full = VocabParallelEmbedding(vocab, 6, _weight=ref.weight, _freeze=True, tp=tp)
            assert not from_full.weight.requires_grad
            _close(from_full(ids), ref(ids), "embedding from a full _weight")

        # Column-parallel embedding (a per-head table: its columns are heads).
        ref = nn.Embedding(5, 2 * tp, padding_idx=0)
        for gather in (False, True):
            emb = ColumnParallelEmbedding(5, 2 * tp, padding_idx=0, gather=gather, tp=tp)
            load_full_state_dict(emb, ref.state_dict())
            ids = torch.tensor([[0, 1, 4], [3, 2, 1]])
            out, out_ref = emb(ids), ref(ids)
            mine = out_ref if gather else out_ref[..., 2 * rank : 2 * rank + 2]
            _close(out, mine, f"column embedding output (gather={gather})")
            g = torch.randn_like(out_ref)
            out.backward(g if gather else g[..., 2 * rank : 2 * rank + 2])
            ref.weight.grad = None
            out_ref.backward(g)
            _close(full_grads(emb)["weight"], ref.weight.grad, f"column embedding grad ({gather})")

        # Heads(): a per-head argument made for all heads outside the module.
        from annot.core.specs import Heads
        from annot.runtime.tp.hint_hooks import slice_heads

        class Scores(nn.Module):
            def forward(self, x, bias=None):
                return x + bias

        batch, heads = 2, 2 * tp
        mod = Scores()
        slice_heads(mod, "bias", Heads(dim=0, heads=heads), tp)
        flat = torch.randn(batch * heads, 1, 3, requires_grad=True)  # Bloom's (b * h, 1, k)
        mine = flat.view(batch, heads, 1, 3)[:, 2 * rank : 2 * rank + 2].reshape(-1, 1, 3)
        out = mod(torch.zeros(batch * 2, 1, 3), flat)
        _close(out, mine, "Heads(dim=0, heads=) slice")
        out.sum().backward()
        _close(flat.grad, torch.ones_like(flat), "Heads() gradient (all-gathered)")
        mod = Scores()
        slice_heads(mod, "bias", Heads(dim=1), tp)
        full = torch.randn(1, heads, 3, 3)
        _close(mod(torch.zeros(1, 2, 3, 3), bias=full), full[:, 2 * rank : 2 * rank + 2], "dim=1")
        one = torch.randn(1, 1, 3, 3)  # broadcast over the heads: kept
        _close(mod(torch.zeros(1, 2, 3, 3), bias=one), one.expand(1, 2, 3, 3), "broadcast")

        # scatter / gather round trip and their backward.
        x = torch.randn(3, 4 * tp, requires_grad=True)
        with CommDebugMode() as comm:
            y = gather_from_tp(scatter_to_tp(x) * (rank + 1))
        assert comm.get_comm_counts() == {ALL_GATHER: 1}
        scale = torch.arange(1, tp + 1, dtype=torch.float32).repeat_interleave(4)
        _close(y, x * scale, "scatter/gather")
        y.sum().backward()
        _close(x.grad, scale.expand(3, -1), "scatter grad (all-gathered)")
        # copy / reduce: sums of per-rank contributions.
        x = torch.ones(2, requires_grad=True)
        z = reduce_from_tp(copy_to_tp(x) * (rank + 1))
        z.sum().backward()
        _close(z, torch.full((2,), tp * (tp + 1) / 2), "reduce_from_tp")
        _close(x.grad, torch.full((2,), tp * (tp + 1) / 2), "copy_to_tp grad")
    return True


@pytest.mark.slow
def test_mlp_block_counts_collectives_and_embedding_tp4():
    assert run_ranks(_mlp_and_embedding, 4, 4, timeout=240) == [True] * 4


def test_mlp_block_and_embedding_padding_idx_tp2():
    """The same checks at tp=2, in the fast set: the padding row sits in rank 1's block."""
    assert run_ranks(_mlp_and_embedding, 2, 2, timeout=240) == [True] * 2


def _cross_entropy(tp):
    from annot.runtime.process_groups import use
    from annot.runtime.tp.state_dict import full_grads, load_full_state_dict

    ctx = _setup(Mesh(tp=tp))
    rank = ctx.tp_rank
    rng = random.Random(7)
    with use(ctx):
        for case in range(6):
            n, classes = rng.randint(1, 9), tp * rng.randint(1, 5)
            smoothing = (0.0, 0.1)[case % 2]
            logits = torch.randn(n, classes) * 4
            target = torch.randint(0, classes, (n,))
            target[torch.rand(n) < 0.3] = -1  # nanoGPT's ignore_index
            if case == 0:
                target[:] = -1  # all ignored: mean is nan, as in torch
            for reduction in ("mean", "sum", "none"):
                lr = logits.clone().requires_grad_(True)
                lt = split_local(logits, -1, 1, tp, rank).clone().requires_grad_(True)
                kw = dict(ignore_index=-1, reduction=reduction, label_smoothing=smoothing)
                loss_ref = F.cross_entropy(lr, target, **kw)
                loss = vocab_parallel_cross_entropy(lt, target, **kw)
                what = f"case {case} {reduction} smoothing={smoothing}"
                if not (target != -1).any() and reduction == "mean":
                    assert loss.isnan(), what
                    assert loss_ref.isnan(), what
                    continue
                _close(loss, loss_ref, f"loss, {what}")
                g = torch.rand_like(loss_ref)
                loss_ref.backward(g)
                loss.backward(g)
                _close(lt.grad, split_local(lr.grad, -1, 1, tp, rank), f"logits grad, {what}")

        # An LM head: Col (not gathered) -> vocab-parallel CE, vs Linear -> CE.
        ref = nn.Linear(8, 4 * tp, bias=False)
        head = ColumnParallelLinear(8, 4 * tp, bias=False, tp=tp)
        load_full_state_dict(head, ref.state_dict())
        h = torch.randn(2, 5, 8)
        targets = torch.randint(0, 4 * tp, (2, 5))
        hr, ht = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
        loss_ref = F.cross_entropy(ref(hr).view(-1, 4 * tp), targets.view(-1))
        loss = vocab_parallel_cross_entropy(head(ht).view(-1, 4), targets.view(-1))
        loss_ref.backward()
        loss.backward()
        _close(loss, loss_ref, "lm loss")
        _close(ht.grad, hr.grad, "lm hidden grad")
        _close(full_grads(head)["weight"], ref.weight.grad, "lm head grad")
        # (N, C, d) input layout.
        x = torch.randn(3, 2 * tp, 4)
        t = torch.randint(0, 2 * tp, (3, 4))
        got = vocab_parallel_cross_entropy(split_local(x, 1, 1, tp, rank), t, reduction="none")
        _close(got, F.cross_entropy(x, t, reduction="none"), "(N, C, d) input")

        with pytest.raises(HintError, match="weight= .* not supported with tp > 1"):
            vocab_parallel_cross_entropy(lt, target, weight=torch.ones(classes))
        with pytest.raises(IndexError, match="target 99 is out of bounds"):
            vocab_parallel_cross_entropy(lt, torch.full_like(target, 99))
    return True


def test_vocab_parallel_cross_entropy_matches_f_cross_entropy_tp2():
    assert run_ranks(_cross_entropy, 2, 2, timeout=240) == [True, True]
