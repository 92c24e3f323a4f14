"""``annot.from_pretrained`` / ``annot.save_pretrained`` on real gloo ranks.

Checkpoints are written by transformers' own ``save_pretrained`` from small
configs, sharded with an index (``max_shard_size`` small). Every load is
checked against ``Cls.from_pretrained(PATH)`` (loss on the same batch, fp32,
train mode, dropout 0); every save by plain transformers loading it (weights
equal the single-device model after the same training step) and by annot
on another mesh. Refusals are checked with their exact messages.
"""

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from annot.testing import run_ranks
from tests.requires import fsdp_unused_params

LLAMA_KW = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)
GPT2_KW = dict(
    n_layer=2,
    n_embd=32,
    n_head=4,
    vocab_size=64,
    n_positions=16,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)


def _quiet(cache: str) -> None:
    os.environ["ANNOT_CACHE_DIR"] = cache
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _batch(seq: int = 8):
    import torch

    return torch.randint(0, 64, (4, seq), generator=torch.Generator().manual_seed(3))


def _save_hf(kind: str, path: str, seed: int = 0) -> None:
    """A 'pretrained' checkpoint: transformers' save_pretrained, sharded."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_KW))
    else:
        model = GPT2LMHeadModel(GPT2Config(**GPT2_KW))
    model.save_pretrained(path, max_shard_size="20KB")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"note": "a file beside the weights"}, f)


def _cls(kind: str):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return LlamaForCausalLM if kind == "llama" else GPT2LMHeadModel


def _pipeline_loss(model, ids):
    import annot

    @annot.jit(model, microbatches=2)
    def step(x):
        loss = model(x, labels=x).loss
        model.backward(loss)
        return loss

    return step(ids).reduce_mean()


def _train_save_reload(cache, kind, path, out, mesh_kw, split, again_kw, again_split):
    """Load at ``mesh_kw``; loss vs transformers; one SGD step; save_pretrained;
    plain transformers reloads it (weights equal the single-device model after
    the same step); annot reloads it at ``again_kw`` (loss equal)."""
    _quiet(cache)
    import torch

    import annot

    cls = _cls(kind)
    model = annot.from_pretrained(cls, path, mesh=annot.Mesh(**mesh_kw), split=split)
    plain = cls.from_pretrained(path)
    model.train()
    plain.train()
    ids = _batch()
    ref_loss = plain(ids, labels=ids).loss
    if model.pipeline is not None:
        loss = _pipeline_loss(model, ids)
    else:
        loss = model(ids, labels=ids).loss
        model.backward(loss)
    out_: dict = {"loss": (loss.item(), ref_loss.item())}
    ref_loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
        for p in plain.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    annot.save_pretrained(model, out, max_shard_size="30KB")
    if torch.distributed.get_rank() == 0:
        again = cls.from_pretrained(out)
        want = plain.state_dict()
        got = again.state_dict()
        out_["keys"] = (sorted(got), sorted(want))
        out_["max_diff"] = max((got[k] - want[k]).abs().max().item() for k in want)
        out_["files"] = sorted(os.listdir(out))
    torch.distributed.barrier()
    again = annot.from_pretrained(cls, out, mesh=annot.Mesh(**again_kw), split=again_split)
    again.train()
    plain.zero_grad()
    want = plain(ids, labels=ids).loss.item()
    got = _pipeline_loss(again, ids) if again.pipeline is not None else again(ids, labels=ids).loss
    out_["reloaded_loss"] = (got.item(), want)
    return out_


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("annot_cache"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    _save_hf("llama", path)
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt2"))
    _save_hf("gpt2", path)
    return path


def _check_round_trip(res, path):
    for r in res:
        got, want = r["loss"]
        assert abs(got - want) <= 1e-5 * abs(want) + 4e-5, r["loss"]
        got, want = r["reloaded_loss"]
        assert abs(got - want) <= 1e-5 * abs(want) + 4e-5, r["reloaded_loss"]
    got_keys, want_keys = res[0]["keys"]
    assert got_keys == want_keys
    assert res[0]["max_diff"] <= 1e-6
    files = res[0]["files"]
    assert "model.safetensors.index.json" in files
    assert "config.json" in files
    assert "tokenizer_config.json" in files  # copied from beside the weights read


def test_llama_tp2_round_trip_reload_pp2(cache, llama_dir, tmp_path):
    """tp2 load equals transformers; after a step, the saved directory loads
    in plain transformers and in annot at pp2 (nested boundary, cut at run time)."""
    out = str(tmp_path / "saved")
    res = run_ranks(
        _train_save_reload, 2, cache, "llama", llama_dir, out,
        {"tp": 2}, None, {"pp": 2}, ["model.layers.2"], timeout=240,
    )  # fmt: skip
    _check_round_trip(res, out)


@pytest.mark.slow  # the Llama round trip stays fast
def test_gpt2_pp2_tied_round_trip(cache, gpt2_dir, tmp_path):
    """GPT-2 (head tied to the embedding, Conv1D) at pp2 cut at run time:
    the tied weight is stored once and read by both stages."""
    out = str(tmp_path / "saved")
    res = run_ranks(
        _train_save_reload, 2, cache, "gpt2", gpt2_dir, out,
        {"pp": 2}, ["transformer.h.1"], {"pp": 2}, ["transformer.h.1"], timeout=240,
    )  # fmt: skip
    _check_round_trip(res, out)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        stored = json.load(f)["weight_map"]
    assert "lm_head.weight" not in stored
    assert "transformer.wte.weight" in stored


def _saved_equals(model, plain, out) -> bool:
    """save_pretrained on every rank; rank 0 reloads with plain transformers:
    every tensor equal to ``plain``'s."""
    import torch

    import annot

    annot.save_pretrained(model, out, max_shard_size="30KB")
    same = True
    if torch.distributed.get_rank() == 0:
        got, want = type(plain).from_pretrained(out).state_dict(), plain.state_dict()
        same = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    torch.distributed.barrier()
    return same


def _fsdp_load(cache, path, out):
    _quiet(cache)
    import annot
    from annot.runtime.fsdp import local

    cls = _cls("llama")
    model = annot.from_pretrained(cls, path, mesh=annot.Mesh(dp=2), fsdp=True)
    plain = cls.from_pretrained(path)
    ids = _batch()
    model.train()
    plain.train()
    held = sum(local(p).numel() for p in model.parameters())
    loss = model(ids, labels=ids).loss.item(), plain(ids, labels=ids).loss.item()
    return (*loss, held, _saved_equals(model, plain, out))


@fsdp_unused_params
def test_llama_dp2_fsdp(cache, llama_dir, tmp_path):
    """dp2 with fsdp=True: each rank reads only its dp chunk; the loss equals
    transformers'; saved (each tensor gathered over dp), it reloads equal."""
    res = run_ranks(_fsdp_load, 2, cache, llama_dir, str(tmp_path / "out"), timeout=240)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        total = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**LLAMA_KW)).parameters())
    for got, want, _, saved in res:
        assert abs(got - want) <= 1e-5 * abs(want) + 4e-5
        assert saved
    assert sum(r[2] for r in res) == total  # the dp chunks partition the model


def _tp_pp_load(cache, path, out):
    _quiet(cache)
    import annot

    cls = _cls("llama")
    model = annot.from_pretrained(cls, path, mesh=annot.Mesh(pp=2, tp=2), split=["model.layers.2"])
    plain = cls.from_pretrained(path)
    ids = _batch()
    model.train()
    plain.train()
    loss = _pipeline_loss(model, ids).item(), plain(ids, labels=ids).loss.item()
    return (*loss, _saved_equals(model, plain, out))


@pytest.mark.slow
def test_llama_tp2_pp2(cache, llama_dir, tmp_path):
    res = run_ranks(_tp_pp_load, 4, cache, llama_dir, str(tmp_path / "out"), timeout=300)
    for got, want, saved in res:
        assert abs(got - want) <= 1e-5 * abs(want) + 4e-5
        assert saved


def _variant_load(cache, path, mesh_kw, options, schedule):
    """from_pretrained with ``options``; (annot's loss, transformers' loss)."""
    _quiet(cache)
    import annot

    cls = _cls("llama")
    model = annot.from_pretrained(cls, path, mesh=annot.Mesh(**mesh_kw), **options)
    plain = cls.from_pretrained(path)
    ids = _batch()
    model.train()
    plain.train()
    if model.pipeline is None:
        with model.forward_context():
            loss = model(ids, labels=ids).loss
    else:

        @annot.jit(model, microbatches=2, schedule=schedule)
        def step(x):
            loss = model(x, labels=x).loss
            model.backward(loss)
            return loss

        loss = step(ids).reduce_mean()
    return loss.item(), plain(ids, labels=ids).loss.item()


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh_kw, options, schedule, tol",
    [
        (
            {"pp": 2},
            {"chunks": 2, "split": ["model.layers.1", "model.layers.2", "model.layers.3"]},
            "interleaved",
            4e-5,
        ),
        ({"tp": 2}, {"sequence_parallel": True}, None, 4e-5),
        ({"tp": 2}, {"precision": "bf16"}, None, 3e-2),
    ],
    ids=["interleaved", "sequence_parallel", "bf16"],
)
def test_llama_load_options(cache, llama_dir, mesh_kw, options, schedule, tol):
    res = run_ranks(_variant_load, 2, cache, llama_dir, mesh_kw, options, schedule, timeout=240)
    for got, want in res:
        assert abs(got - want) <= tol * max(1.0, abs(want)), (got, want)


def test_dtype_converts_what_is_stored(cache, llama_dir):
    """dtype=torch.bfloat16: the stored float32 tensors cast as transformers casts them."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot

    _quiet(cache)
    model = annot.from_pretrained(_cls("llama"), llama_dir, dtype=torch.bfloat16)
    plain = _cls("llama").from_pretrained(llama_dir, dtype=torch.bfloat16)
    got, want = model.full_state_dict(), plain.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def test_lone_safetensors_file_of_a_plain_module(cache, tmp_path):
    """One safetensors file of a single-device state dict (the embedding
    tied to the head stored once, as safetensors' save_model stores it),
    read into an annot-hinted module built from its constructor arguments."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    from safetensors.torch import save_model

    import annot
    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, dropout=0.0)
    torch.manual_seed(0)
    plain = GPT(cfg)
    file = str(tmp_path / "gpt.safetensors")
    save_model(plain, file)
    model = annot.from_pretrained(GPT, file, cfg)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    _, loss = model(x, x)
    _, want = plain(x, x)
    assert torch.equal(loss, want)
    with pytest.raises(annot.CheckpointError) as err:
        annot.from_pretrained(_cls("llama"), file)
    assert str(err.value) == (
        f"{file}: a lone safetensors file has no config; pass the config: "
        f"annot.from_pretrained(LlamaForCausalLM, {file!r}, config, mesh=...)"
    )


def test_save_replaces_a_directory_only_when_asked(cache, llama_dir, tmp_path):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot

    _quiet(cache)
    model = annot.from_pretrained(_cls("llama"), llama_dir)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("the user's")
    with pytest.raises(annot.CheckpointError) as err:
        annot.save_pretrained(model, out)
    assert str(err.value) == (
        f"{out}: exists; save_pretrained does not replace it unless asked: pass "
        "overwrite=True, or pick a new path"
    )
    assert os.listdir(out) == ["mine.txt"]
    annot.save_pretrained(model, out, overwrite=True)
    assert sorted(os.listdir(out)) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json",
    ]  # fmt: skip
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left


def test_base_model_prefix(cache, llama_dir):
    """The base model (LlamaModel) from a LlamaForCausalLM checkpoint: the
    stored names lose their ``model.`` prefix, as in transformers; the head
    is unexpected there, so strict=True refuses it and strict=False skips it."""
    import warnings

    import torch
    from transformers import LlamaModel

    import annot

    _quiet(cache)
    with pytest.raises(annot.CheckpointError) as err:
        annot.from_pretrained(LlamaModel, llama_dir)
    assert "missing none, unexpected ['lm_head.weight']" in str(err.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = annot.from_pretrained(LlamaModel, llama_dir, strict=False)
    plain = LlamaModel.from_pretrained(llama_dir)
    ids = _batch()
    got = model(ids).last_hidden_state
    assert torch.equal(got, plain(ids).last_hidden_state)


def test_progress_prints_on_rank_0_only_after_its_delay(capsys):
    from annot.io.pretrained import Progress

    quiet = Progress(2 * 1024**3, show=True, after_s=3600)
    quiet.add(1024**3)
    quiet.finish()
    hidden = Progress(2 * 1024**3, show=False, after_s=0, every_s=0)
    hidden.add(1024**3)
    shown = Progress(2 * 1024**3, show=True, after_s=0, every_s=0)
    shown.add(1024**3)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith(
        "annot: from_pretrained: read 1.00 GiB of 2.00 GiB on rank 0 (50%) in "
    )


# ---- refusals: exact messages, nothing built -------------------------------------------


def _copy(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _rewrite_index(path: str, edit) -> None:
    """Rewrite the safetensors file holding the first tensor of ``edit``'s
    choice with transformers' safetensors writer, and the index to match."""
    from safetensors.torch import load_file, save_file

    index_path = os.path.join(path, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    state = load_file(os.path.join(path, files[0]))
    new = edit(state)
    save_file(new, os.path.join(path, files[0]), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != files[0]}
    index["weight_map"].update({k: files[0] for k in new})
    with open(index_path, "w") as f:
        json.dump(index, f)


def _refused(path: str) -> str:
    import annot

    _quiet(os.environ.get("ANNOT_CACHE_DIR", ""))
    with pytest.raises(annot.CheckpointError) as err:
        annot.from_pretrained(_cls("llama"), path)
    return str(err.value)


def test_refuses_missing_key(cache, llama_dir, tmp_path):
    os.environ["ANNOT_CACHE_DIR"] = cache
    path = _copy(llama_dir, str(tmp_path / "ckpt"))
    _rewrite_index(path, lambda s: {k: v for k, v in s.items() if k != "model.embed_tokens.weight"})
    assert _refused(path) == (
        f"{path}: does not fit LlamaForCausalLM: missing ['model.embed_tokens.weight'], "
        "unexpected none. Load a checkpoint of this model and configuration, or pass "
        "strict=False to load the tensors that match"
    )


def test_refuses_unexpected_key(cache, llama_dir, tmp_path):
    import torch

    os.environ["ANNOT_CACHE_DIR"] = cache
    path = _copy(llama_dir, str(tmp_path / "ckpt"))
    _rewrite_index(path, lambda s: {**s, "model.extra.weight": torch.zeros(3)})
    assert _refused(path) == (
        f"{path}: does not fit LlamaForCausalLM: missing none, unexpected "
        "['model.extra.weight']. Load a checkpoint of this model and configuration, or pass "
        "strict=False to load the tensors that match"
    )


def test_refuses_wrong_shape(cache, llama_dir, tmp_path):
    import torch

    os.environ["ANNOT_CACHE_DIR"] = cache
    path = _copy(llama_dir, str(tmp_path / "ckpt"))
    _rewrite_index(path, lambda s: {**s, "model.embed_tokens.weight": torch.zeros(65, 32)})
    assert _refused(path) == (
        f"{path}: wrong shapes: model.embed_tokens.weight has shape (65, 32), "
        "model.embed_tokens.weight in the model (64, 32)"
    )


def test_refuses_truncated_file_before_building(cache, llama_dir, tmp_path):
    os.environ["ANNOT_CACHE_DIR"] = cache
    path = _copy(llama_dir, str(tmp_path / "ckpt"))
    last = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))[-1]
    file = os.path.join(path, last)
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size - 4)
    message = _refused(path)
    assert message.startswith(f"{file}: not a readable safetensors file: ")
    assert message.endswith(
        f"but the file has {size - 4} bytes (truncated); the file is damaged or was not "
        "written completely: copy or save it again"
    )


def test_refuses_broken_header(cache, llama_dir, tmp_path):
    os.environ["ANNOT_CACHE_DIR"] = cache
    path = _copy(llama_dir, str(tmp_path / "ckpt"))
    file = os.path.join(path, sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))[0])
    with open(file, "r+b") as f:
        f.seek(8)
        f.write(b"[[[")
    assert _refused(path).startswith(
        f"{file}: not a readable safetensors file: its header is not JSON ("
    )


# ---- save_pretrained called on one rank alone ------------------------------------------


def _save_alone(cache, path, out):
    _quiet(cache)
    import time

    import torch.distributed as dist

    import annot

    model = annot.from_pretrained(_cls("llama"), path, mesh=annot.Mesh(dp=2))
    if dist.get_rank() == 1:
        time.sleep(12)  # never calls save_pretrained
        return None
    try:
        annot.save_pretrained(model, out)
    except annot.RankFailure as e:
        return str(e)
    return "saved"


@pytest.mark.slow
def test_save_on_one_rank_alone_times_out(cache, llama_dir, tmp_path):
    out = str(tmp_path / "never")
    res = run_ranks(
        _save_alone, 2, cache, llama_dir, out, env={"ANNOT_TIMEOUT_S": "3"}, timeout=120
    )
    assert res[0].startswith(f"this rank (0) timed out in save_pretrained({out!r})")
    assert not os.path.exists(out)


# ---- memory: no rank holds the whole model ---------------------------------------------


@pytest.mark.slow
def test_load_peak_memory_per_rank(tmp_path):
    """pp2 load of a 0.3 GB float32 Llama: each rank's peak RSS over its life
    stays within the issue's budget, 1.2 x (its own parameter bytes + a bare
    torch + transformers process), and below what reading the whole model
    would take (bare + the whole checkpoint)."""
    from benchmarks.pretrained_memory import bare_rss_bytes, make_checkpoint, rank_load

    config = dict(
        vocab_size=16000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    path = str(tmp_path / "ckpt")
    make_checkpoint(path, config)
    whole = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    bare = bare_rss_bytes()
    ranks = run_ranks(rank_load, 2, path, 2, 1, str(tmp_path / "cache"), timeout=600)
    assert sum(r["own"] for r in ranks) >= 0.99 * whole - 1e6  # the stages partition it
    for r in ranks:
        assert r["peak"] <= 1.2 * (r["own"] + bare), (r, bare)
        assert r["peak"] < bare + whole, (r, bare, whole)


# ---- the example ------------------------------------------------------------------------


@pytest.mark.slow
def test_finetune_example_tp2_pp2_then_resume_on_tp2(tmp_path):
    import subprocess
    import sys

    from annot.testing import free_port

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "ANNOT_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env["ANNOT_BACKEND"] = "gloo"
    script = os.path.join(root, "examples", "finetune_hf.py")
    work, dcp = str(tmp_path / "work"), str(tmp_path / "work" / "step4")
    for nproc, extra in (
        (4, ["--tp", "2", "--pp", "2", "--save-dcp", dcp]),
        (2, ["--tp", "2", "--resume", dcp]),
    ):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        cmd += [
            "--master-port",
            str(free_port()),
            script,
            "--steps",
            "4",
            "--workdir",
            work,
            *extra,
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "last batch: annot loss" in proc.stdout
    assert "resumed from" in proc.stdout
    assert "step   7 |" in proc.stdout
