"""annot.runtime.init.deferred: each rank's slice of the initial weights, bit-exactly
the eager build's, without ever holding the whole model.

Every value test compares against ``torch.manual_seed(s); Model(...)`` built
eagerly: values with ``torch.equal`` (bit-exact), and the CPU generator's
state afterwards.
"""

import contextlib
import os

import pytest
import torch
import torch.nn as nn

from annot.runtime.init.deferred import (
    DeferredInitError,
    deferred_reference,
    materialize_,
    named_tensors,
    shard_slicers,
)
from annot.testing import run_ranks
from examples.gpt.model import GPT, GPTConfig

CFG = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.1)


def whole(name):
    return lambda t: t


def first_half(name):
    return lambda t: t.narrow(0, 0, t.shape[0] // 2)


class Odd(nn.Module):
    """Every way of making initial values we know of, in one __init__."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.ln = nn.LayerNorm(4)
        self.emb = nn.Embedding(8, 4, padding_idx=1)  # normal_ then a partial fill_
        self.lin = nn.Linear(4, 6)
        self.lin2 = nn.Linear(4, 6)
        self.lin2.weight = self.lin.weight  # tied; lin2's own weight is orphaned
        self.register_buffer("mask", torch.tril(torch.ones(6, 6)).view(1, 1, 6, 6))
        self.register_buffer("consts", torch.tensor([1.0, 2.0, 3.0, 4.0]))  # Python data
        self.register_buffer("steps", torch.arange(6.0) * 0.5, persistent=False)
        self.plain = torch.linspace(0, 1, 6)  # a tensor attribute, not a buffer
        self.q = nn.Parameter(torch.empty(6, 8))
        nn.init.orthogonal_(self.q)  # QR of a full random matrix; skips meta tensors
        self.tn = nn.Parameter(torch.empty(8, 4))
        nn.init.trunc_normal_(self.tn, std=0.02)  # rejection loop on bool(mask.any())
        with torch.no_grad():
            self.w.mul_(0.5)  # reads the previous values
            self.lin.bias.data *= 2
            self.ln.weight.copy_(self.w[0])  # from another parameter's row
            self.x = nn.Parameter(self.w.t().contiguous() + 1)
        self.k = nn.Parameter(torch.empty(4, 6))
        nn.init.kaiming_normal_(self.k)
        nn.init.xavier_uniform_(self.lin2.weight)
        self.d = nn.Parameter(torch.rand(4, 2).double())


class Zoo(nn.Module):
    """torch's own layers and init functions (buffers, flat RNN weights, MHA)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)  # running stats and an int64 counter
        self.lstm = nn.LSTM(8, 16, num_layers=2)
        self.enc = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32)
        self.bag = nn.EmbeddingBag(10, 4)
        self.sp = nn.Parameter(torch.empty(6, 4))
        nn.init.sparse_(self.sp, 0.5)  # randperm per column, index_put_
        self.di = nn.Parameter(torch.empty(4, 4, 3))
        nn.init.dirac_(self.di)
        self.perm = nn.Parameter(torch.randperm(10).float())
        self.bern = nn.Parameter(torch.bernoulli(torch.full((5, 5), 0.3)))
        self.mn = nn.Parameter(torch.multinomial(torch.rand(3, 6), 2).float())


class DataDependent(nn.Module):
    """__init__ reads a random value to pick a size (``.item()``)."""

    def __init__(self):
        super().__init__()
        n = int(torch.randint(2, 6, (1,)).item()) * 2
        self.w = nn.Parameter(torch.randn(n, 3))
        self.v = nn.Parameter(torch.randn(4, n))


def eager(build, seed):
    torch.manual_seed(seed)
    model = build()
    return model, torch.get_rng_state()


def check_same(build, wanted, seed=0):
    ref, state = eager(build, seed)
    torch.manual_seed(seed)
    meta, values = deferred_reference(build, wanted)
    assert torch.equal(torch.get_rng_state(), state), "the generator ended elsewhere"
    expected = named_tensors(ref)
    assert set(values) == {n for n in expected if wanted(n) is not None}
    for name, t in expected.items():
        if name in values:
            want = wanted(name)(t.detach())
            assert values[name].shape == want.shape, name
            assert torch.equal(values[name], want), f"{name} differs from the eager build"
    assert all(t.is_meta for t in meta.parameters())
    assert set(named_tensors(meta)) == set(expected)
    return meta, values


@pytest.mark.parametrize("wanted", [whole, first_half], ids=["whole", "half"])
def test_gpt_bit_exact(wanted):
    meta, values = check_same(lambda: GPT(CFG), wanted, seed=3)
    assert meta.wte.weight is meta.lm_head.weight  # the tie survives
    assert {"wte.weight", "lm_head.weight"} <= set(values)


@pytest.mark.parametrize("wanted", [whole, first_half], ids=["whole", "half"])
def test_every_kind_of_init_bit_exact(wanted):
    check_same(Odd, wanted, seed=5)


def _half_or_scalar(name):
    return lambda t: t.narrow(0, 0, max(1, t.shape[0] // 2)) if t.dim() else t


@pytest.mark.parametrize("wanted", [whole, _half_or_scalar], ids=["whole", "half"])
def test_torch_layers_bit_exact(wanted):
    check_same(Zoo, wanted, seed=9)


def test_materialized_torch_layers_run_like_eager():
    torch.manual_seed(9)
    ref = Zoo().eval()
    torch.manual_seed(9)
    meta, values = deferred_reference(Zoo, whole)
    model = materialize_(meta, values).eval()
    x = torch.randn(5, 2, 8)
    assert torch.equal(model.lstm(x)[0], ref.lstm(x)[0])  # flat weights follow the swap
    src = torch.randn(5, 2, 16)
    assert torch.equal(model.enc(src), ref.enc(src))


def test_value_read_inside_init():
    check_same(DataDependent, whole, seed=11)
    check_same(DataDependent, whole, seed=12)


def test_unwanted_are_dropped_and_the_generator_still_advances():
    def some(name):
        return None if name.startswith("h.0") or name == "wte.weight" else first_half(name)

    _, values = check_same(lambda: GPT(CFG), some, seed=7)
    assert not any(n.startswith("h.0") for n in values)
    assert "wte.weight" not in values
    assert "lm_head.weight" in values


def test_never_written_empty_is_zeros():
    class E(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Parameter(torch.empty(4, 2))

    _, values = deferred_reference(E, first_half)
    assert torch.equal(values["e"], torch.zeros(2, 2))


def test_resize_is_refused_with_the_line():
    class R(nn.Module):
        def __init__(self):
            super().__init__()
            t = torch.zeros(4)
            t.resize_(8)  # the line the error names
            self.t = nn.Parameter(t)

    with pytest.raises(DeferredInitError, match=r"test_deferred.py:\d+ \(t.resize_\(8\)"):
        deferred_reference(R, whole)


def test_meta_tensor_from_outside_is_refused():
    outside = torch.empty(3, device="meta")

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(outside * 2)

    with pytest.raises(DeferredInitError, match="not made inside build"):
        deferred_reference(M, whole)


def test_materialize_copies_values_and_keeps_ties():
    wanted = shard_slicers(GPT(CFG).to("meta"))  # no mesh: everything whole
    torch.manual_seed(0)
    ref = GPT(CFG)
    torch.manual_seed(0)
    meta, values = deferred_reference(lambda: GPT(CFG), wanted)
    materialize_(meta, values)
    assert meta.wte.weight is meta.lm_head.weight
    for name, t in ref.state_dict().items():
        assert torch.equal(meta.state_dict()[name], t), name
    x = torch.randint(0, CFG.vocab_size, (2, 8))
    meta.eval(), ref.eval()
    assert torch.equal(meta(x, x)[1], ref(x, x)[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_materialize_onto_cuda():
    torch.manual_seed(0)
    meta, values = deferred_reference(lambda: GPT(CFG), whole)
    model = materialize_(meta, values, "cuda")
    assert model.wte.weight is model.lm_head.weight
    assert all(t.is_cuda for t in model.state_dict().values())
    for name, t in model.state_dict().items():
        assert torch.equal(t.cpu(), values[name]), name


def test_materialize_names_what_is_missing():
    with torch.device("meta"):
        lin = nn.Linear(2, 2)
    with pytest.raises(DeferredInitError, match=r"missing values for \['bias'\]"):
        materialize_(lin, {"weight": torch.zeros(2, 2)})
    with pytest.raises(DeferredInitError, match=r"weight: value \(1, 2\), model \(2, 2\)"):
        materialize_(lin, {"weight": torch.zeros(1, 2), "bias": torch.zeros(2)})


# --------------------------------------------------------------------------- #
# Peak memory, each build in a fresh process
# --------------------------------------------------------------------------- #

LAYERS, WIDTH = 8, 2048  # 8 x 16 MiB of fp32 weights


def _big():
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _quarter(name):
    return lambda t: t.narrow(0, 0, t.shape[0] // 4)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_increase(deferred: bool) -> tuple[int, int]:
    """(peak RSS increase in bytes while building, bytes kept).

    ``ru_maxrss`` would be the high-water mark of the whole process, and in a
    spawned child it starts at the size of the parent it was forked from;
    Linux resets the mark (``VmHWM``) on writing 5 to ``/proc/self/clear_refs``.
    glibc serves blocks under its *dynamic* mmap threshold (it grows to 32 MiB
    after the first free of a large block) from a heap it keeps: the mark would
    then measure fragmentation, not what was alive. A fixed 1 MiB threshold
    returns every large block to the OS when freed."""
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    torch.manual_seed(0)
    deferred_reference(lambda: nn.Linear(4, 4), whole)  # warm up imports and the dispatcher
    nn.Linear(4, 4)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    if deferred:
        _, values = deferred_reference(_big, _quarter)
        kept = sum(v.numel() * v.element_size() for v in values.values())
    else:
        model = _big()
        kept = sum(p.numel() * p.element_size() for p in model.parameters())
    return _status("VmHWM") - before, kept


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_memory_is_the_shard_not_the_model():
    full = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    ((eager_peak, eager_kept),) = run_ranks(_peak_increase, 1, False, timeout=300)
    ((deferred_peak, kept),) = run_ranks(_peak_increase, 1, True, timeout=300)
    assert eager_kept == full
    assert kept == full // 4
    mib = 2**20
    report = (
        f"eager +{eager_peak / mib:.0f} MiB, deferred +{deferred_peak / mib:.0f} MiB "
        f"(full model {full / mib:.0f} MiB, kept {kept / mib:.0f} MiB)"
    )
    assert eager_peak > 0.95 * full, report  # the measurement sees a full build
    assert deferred_peak < 0.5 * full, report


# --------------------------------------------------------------------------- #
# Wiring into a parallel model: pp=2 x tp=2 on 4 gloo ranks
# --------------------------------------------------------------------------- #


def _deferred_equals_parallelize(cache: str) -> int:
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from annot.runtime import process_groups
    from annot.runtime.pipeline.layout import build_layout

    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=4, n_embd=16)
    pm = annot.parallelize(GPT, cfg, mesh=annot.Mesh(pp=2, tp=2), seed=4)  # the eager path
    ctx, plan = pm.ctx, pm.pipeline

    # What parallelize would do instead: this rank's stage and shard only.
    with process_groups.use(ctx), torch.device("meta"):
        local = type(pm.module)(cfg)
    build_layout(local, plan.split, ctx, chunks=1, boundaries=plan.boundaries)
    with process_groups.use(ctx):
        wanted = shard_slicers(local)
    torch.manual_seed(4)
    _, values = deferred_reference(lambda: GPT(cfg), wanted)
    materialize_(local, values)

    expected = pm.module.state_dict()
    got = local.state_dict()
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    assert got, (sorted(got), sorted(expected))
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    full = sum(p.numel() for p in GPT(cfg).parameters())
    return sum(p.numel() for p in local.parameters()) * 1000 // full


@pytest.mark.slow
def test_deferred_matches_parallelize_on_pp2_tp2(tmp_path):
    shares = run_ranks(_deferred_equals_parallelize, 4, str(tmp_path), timeout=400)
    assert all(s < 500 for s in shares), shares  # each rank holds well under half
