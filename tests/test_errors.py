"""Bad input gets a clear error before any rank does work: each names the
numbers, the class, the argument or the module path, and says what was expected."""

import pytest
import torch
import torch.nn as nn

import annot
from annot import Col, HintError, Local, MeshError, PipelineError, Row, Vocab
from annot.build.hint_checks import check_shard_hints
from annot.core.hints import resolve_external_hints, resolve_hints, shard, stage
from annot.testing import RanksFailed, run_ranks
from annot.training.microbatch import split_microbatches


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)
        self.emb = nn.Embedding(10, 8)
        self.scale = nn.Parameter(torch.ones(6, 8))
        self.n_head = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Attn() for _ in range(2)])


def _verify(**specs):
    local = specs.pop("local", ())
    from annot.core.hints import ShardSpec

    check_shard_hints(Net(), {Attn: ShardSpec(specs, tuple(local))}, tp=2)


def test_world_size_must_equal_the_mesh():
    with pytest.raises(MeshError) as err:
        annot.Mesh(dp=2, pp=2, tp=2).validate(4)
    assert str(err.value).startswith("dp(2) * pp(2) * tp(2) = 8 != world size (4)")


def test_mesh_degrees_are_positive_ints():
    with pytest.raises(MeshError, match=r"Mesh\(tp=0\): tp must be an int >= 1"):
        annot.Mesh(tp=0)


def test_backend_follows_the_device_and_refuses_more_ranks_than_gpus(monkeypatch):
    from annot.runtime.process_groups import default_backend

    monkeypatch.delenv("ANNOT_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_backend() == "nccl"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(MeshError) as err:
        default_backend()
    assert str(err.value).startswith(
        "2 ranks on this host but 1 GPU(s): NCCL needs one GPU per rank"
    )
    assert "ANNOT_BACKEND=gloo" in str(err.value)
    monkeypatch.setenv("ANNOT_BACKEND", "gloo")
    assert default_backend() == "gloo"


def _wrong_mesh():
    annot.parallelize(Net, mesh=annot.Mesh(tp=4))


def test_parallelize_on_the_wrong_world_size_fails_on_every_rank():
    with pytest.raises(RanksFailed) as err:
        run_ranks(_wrong_mesh, 2, timeout=120)
    assert set(err.value.failures) == {0, 1}
    for text in err.value.failures.values():
        assert "MeshError: dp(1) * pp(1) * tp(4) = 4 != world size (2)" in text


def test_missing_submodule_names_what_exists():
    with pytest.raises(HintError) as err:
        _verify(qkvv=Col())
    assert str(err.value) == (
        "@shard on Attn (at blocks.0): argument qkvv=Col() names no submodule of Attn; "
        "its submodules are: emb, proj, qkv"
    )


def test_spec_on_an_unsupported_module():
    with pytest.raises(HintError) as err:
        _verify(emb=Row())
    assert str(err.value) == (
        "@shard on Attn (at blocks.0): argument emb=Row() applies to nn.Linear, but Attn.emb "
        "is a Embedding; use Vocab() (rows) or Col() (columns) for an nn.Embedding"
    )
    _verify(emb=Col())  # its columns: ColumnParallelEmbedding
    with pytest.raises(HintError, match=r"Col\(\) on an nn.Embedding splits its columns"):
        _verify(emb=Col(chunks=2))
    with pytest.raises(HintError, match=r"argument qkv=Vocab\(\) applies to nn.Embedding"):
        _verify(qkv=Vocab())


def test_sizes_tp_does_not_divide():
    with pytest.raises(HintError) as err:
        _verify(qkv=Col(chunks=8))
    assert str(err.value) == (
        "@shard on Attn (at blocks.0): argument qkv=Col(chunks=8): out_features=24 is not "
        "divisible by tp(2) * chunks(8) = 16"
    )
    with pytest.raises(HintError, match=r"Attn.n_head=3 is not divisible by tp \(2\)"):
        _verify(qkv=Col(), local=("n_head",))

    class Odd(Attn):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(5, 8))

    from annot.core.hints import ShardSpec

    with pytest.raises(HintError, match=r"dim 0 of scale has size 5, not divisible by tp \(2\)"):
        check_shard_hints(Odd(), {Odd: ShardSpec({"scale": annot.P("tp", None)})}, tp=2)


def test_bad_hint_arguments_name_class_and_argument():
    with pytest.raises(HintError) as err:
        shard(c_attn=3)(Attn)
    assert str(err.value).startswith(
        "@shard on Attn: argument c_attn=3 is a int; expected a spec: Col(), Row(), Vocab(), "
        "Replicate(), P(...), Partial(), Heads() or Experts()"
    )
    with pytest.raises(HintError, match=r"Col\(chunks=0\): chunks must be an int >= 1"):
        Col(chunks=0)
    with pytest.raises(HintError, match=r"Col\(chunks='3'\): chunks must be an int >= 1, got str"):
        Col(chunks="3")
    with pytest.raises(HintError, match="give split=\\[...\\] or auto=True, not both"):
        stage(split=["blocks.1"], auto=True)(Net)
    with pytest.raises(HintError, match="expected an nn.Module subclass"):
        shard(x=Col())(object)


def test_local_takes_attribute_paths_from_the_module():
    """``Local("config.n_head")`` / ``local=("config.n_head",)``: the module's
    ``self.config.n_head``; malformed paths are refused naming what is wrong."""
    assert Local("config.n_head", "n_embd").names == ("config.n_head", "n_embd")

    class Config:
        n_head, odd = 4, 3

    class CfgAttn(Attn):
        def __init__(self):
            super().__init__()
            self.config = Config()

    hinted = shard(qkv=Col(chunks=3), local=("config.n_head",))(CfgAttn)
    spec = annot.core.hints.get_shard_spec(hinted)
    assert spec.local == ("config.n_head",)
    check_shard_hints(CfgAttn(), {CfgAttn: spec}, tp=2)  # 4 heads divide by tp 2
    net = nn.ModuleDict({"a": CfgAttn(), "b": CfgAttn()})
    specs = resolve_external_hints(net, {"*": Local("config.n_head")})
    assert specs[CfgAttn].local == ("config.n_head",)
    from annot.core.hints import ShardSpec

    with pytest.raises(HintError) as err:
        check_shard_hints(CfgAttn(), {CfgAttn: ShardSpec({}, ("config.odd",))}, tp=2)
    assert str(err.value) == (
        "@shard on CfgAttn: local=('config.odd',): CfgAttn.config.odd=3 is not divisible by tp (2)"
    )
    with pytest.raises(HintError) as err:
        check_shard_hints(CfgAttn(), {CfgAttn: ShardSpec({}, ("config.n_heads",))}, tp=2)
    assert str(err.value).startswith(
        "@shard on CfgAttn: local=('config.n_heads',): CfgAttn has no config.n_heads (a dotted "
        "local name is a path of attributes from the module: self.config.n_heads)"
    )
    tail = (
        "a per-rank size is an attribute of the module or a local variable of its forward "
        "('n_head'), or a dotted path of attributes from the module ('config.n_head': the "
        "module's self.config.n_head)"
    )
    for name, why in [
        ("config..n", "'config..n' has an empty part"),
        ("1x", "'1x': '1x' is not a Python name"),
        ("config.", "'config.' has an empty part"),
        ("config.class", "'config.class': 'class' is not a Python name"),
        (
            "self.config.n",
            "'self.config.n' starts with self; paths are relative to the module: 'config.n'",
        ),
    ]:
        with pytest.raises(HintError) as err:
            Local(name)
        assert str(err.value) == f"Local({name!r}): {why}; {tail}"
        with pytest.raises(HintError) as err:
            shard(local=("n_head", name))(Attn)
        assert (
            str(err.value) == f"@shard on Attn: argument local=('n_head', {name!r}): {why}; {tail}"
        )


def test_external_hint_matching_nothing():
    with pytest.raises(HintError) as err:
        resolve_external_hints(Net(), {"blocks.*.attn.qkv": Col()})
    assert "pattern 'blocks.*.attn.qkv' matches no submodule or parameter" in str(err.value)
    # hints that differ between instances are applied by path, not rewritten per class
    specs, paths = resolve_hints(Net(), {"blocks.0.qkv": Col(), "blocks.1.qkv": Row()})
    assert Attn not in specs
    assert paths == {"blocks.0.qkv": Col(), "blocks.1.qkv": Row()}
    with pytest.raises(HintError, match="instances of Attn get different Local"):
        resolve_external_hints(Net(), {"blocks.0": Local("n_head")})
    specs = resolve_external_hints(
        Net(), {"blocks.*.qkv": Col(chunks=3), "blocks.*": Local("n_head")}
    )
    assert specs[Attn].specs == {"qkv": Col(chunks=3)}
    assert specs[Attn].local == ("n_head",)


def _unhinted_tp2(cache):
    import os

    import torch.nn as nn

    os.environ["ANNOT_CACHE_DIR"] = cache
    try:
        # (a LayerNorm between the Linears: no MLP the sources show, nothing inferred)
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4))
        annot.parallelize(model, mesh=annot.Mesh(tp=2))
    except HintError as e:
        return str(e)
    return "no error"


def test_tp_with_nothing_to_split_is_refused(tmp_path):
    """A model with no @shard, no hints= and no transformers tp plan: tp=2 would
    run the whole model on every rank, which a user would take for tp."""
    msg = run_ranks(_unhinted_tp2, 2, str(tmp_path), timeout=120)[0]
    assert msg.startswith(
        "tp=2, but nothing in Sequential says how to split it: no @shard on its classes, no "
        "hints= given, and no transformers tp plan; every rank would run the whole model."
    ), msg
    assert "or use tp=1" in msg


def _step(x, y):
    return x


def test_microbatch_errors():
    x, y = torch.zeros(10, 3), torch.zeros(10)
    with pytest.raises(PipelineError, match="a batch of 10 is not divisible into 4 microbatches"):
        split_microbatches(_step, (x, y), {}, 4)
    with pytest.raises(PipelineError, match=r"microbatches=0; expected an int >= 1"):
        split_microbatches(_step, (x, y), {}, 0)
    with pytest.raises(
        PipelineError, match=r"must share the batch size \(dim 0\); got x: 10, y: 8;"
    ):
        split_microbatches(_step, (x, torch.zeros(8)), {}, 2)
    parts = split_microbatches(_step, (x, torch.zeros(8)), {}, 2, non_split=("y",))
    assert [a[0].shape[0] for a, _ in parts] == [5, 5]
    assert parts[0][0][1].shape[0] == 8


def test_jit_refuses_bad_settings():
    model = annot.parallelize(Net, mesh=annot.Mesh())
    with pytest.raises(PipelineError, match=r"microbatches=0; expected an int >= 1"):
        annot.jit(model, microbatches=0)(_step)
    with pytest.raises(
        PipelineError,
        match="annot.jit: unknown pipeline schedule 'zigzag'; expected one of 'gpipe', '1f1b'",
    ):
        annot.jit(model, schedule="zigzag")(_step)
    with pytest.raises(HintError, match="expected the result of annot.parallelize"):
        annot.jit(Net(), microbatches=2)(_step)
