"""The Hugging Face Trainer around an annot model (``annot.hf.Trainer``)
against the single-device ``transformers.Trainer`` on the same data: the
loss at every logged step and every parameter after the steps (AdamW, a
linear schedule with warm-up, ``max_grad_norm``, gradient accumulation).

Every example differs (and some labels are masked, so that the token counts
the Trainer divides by differ per batch): data split over the wrong ranks, a
tp shard overwritten, a gradient averaged over ranks holding other shards or
a loss scaled by the wrong count each fail the comparison. Plain
``transformers.Trainer`` (through accelerate's DDP) is refused before a
step."""

from __future__ import annotations

import os

import pytest

from annot.testing import run_ranks

STEPS = 4


def _data(n: int = 48, seq: int = 8):
    import torch

    g = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 128, (seq,), generator=g)
        labels = ids.clone()
        labels[torch.rand(seq, generator=g) < 0.25] = -100  # token counts differ per batch
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _args(out: str, batch: int, **kw):
    from transformers import TrainingArguments

    base = dict(
        output_dir=out, per_device_train_batch_size=batch, max_steps=STEPS, learning_rate=1e-2,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", max_grad_norm=0.5,
        gradient_accumulation_steps=2, warmup_steps=1, lr_scheduler_type="linear", seed=3,
        disable_tqdm=True,
    )  # fmt: skip
    base.update(kw)
    return TrainingArguments(**base)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _reference(out: str, batch: int, args_kw: dict, loss_kwargs: bool = True):
    import torch
    from transformers import Trainer

    from tests.tiny_hf import tiny_llama

    cls, cfg, _ = tiny_llama()
    torch.manual_seed(0)
    model = cls(cfg)
    trainer = Trainer(model=model, args=_args(out, batch, **args_kw), train_dataset=_data())
    trainer.model_accepts_loss_kwargs = loss_kwargs  # False: as a model without **kwargs
    trainer.train()
    return _losses(trainer), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _annot(
    cache: str, out: str, mesh_kw: dict, options: dict, batch: int, args_kw: dict, loss_kwargs=True
):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    import annot.hf
    from tests.tiny_hf import tiny_llama

    cls, cfg, split = tiny_llama()
    mesh = annot.Mesh(**mesh_kw)
    model = annot.parallelize(
        cls, cfg, mesh=mesh, seed=0, split=split if mesh.pp > 1 else None, **options
    )
    trainer = annot.hf.Trainer(
        model=model, args=_args(out, batch, **args_kw), train_dataset=_data()
    )
    trainer.model_accepts_loss_kwargs = loss_kwargs
    trainer.train()
    state = model.full_state_dict()
    return _losses(trainer), state if model.ctx.rank == 0 else None


def _compare(got, ref, what: str) -> None:
    from tests.parity import assert_close

    losses, state = got
    ref_losses, ref_state = ref
    assert len(losses) == len(ref_losses) == STEPS, (losses, ref_losses)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"{what}: loss at step {i}: {a} != {b}"
    for k, v in ref_state.items():
        assert_close(state[k], v, f"{what}: {k} after {STEPS} steps")


CASES = [
    ({"tp": 2}, {}, True),
    ({"pp": 2}, {}, True),
    # a model whose forward takes no num_items_in_batch: each microbatch's mean loss
    # weighed by its share of the batch's label tokens (masked labels: they differ)
    pytest.param({"pp": 2}, {}, False, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "tp": 2}, {}, True, marks=pytest.mark.slow),
    pytest.param({"pp": 2, "tp": 2}, {}, True, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "tp": 2}, {"fsdp": True}, True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh_kw, options, loss_kwargs", CASES)
def test_trainer_equals_the_single_device_trainer(tmp_path, mesh_kw, options, loss_kwargs):
    import annot

    mesh = annot.Mesh(**mesh_kw)
    batch = 4
    ref = run_ranks(_reference, 1, str(tmp_path / "ref"), batch * mesh.dp, {}, loss_kwargs)[0]
    results = run_ranks(
        _annot,
        mesh.size,
        str(tmp_path / "cache"),
        str(tmp_path / "out"),
        mesh_kw,
        options,
        batch,
        {},
        loss_kwargs,
    )
    _compare(results[0], ref, f"annot.hf.Trainer {mesh_kw} {options}")
    # every rank logs the same losses (each the full batch's)
    for r, (losses, _) in enumerate(results):
        assert losses == results[0][0], f"rank {r} logged {losses}, rank 0 {results[0][0]}"


def _wrappers_refused(cache: str, out: str, mesh_kw: dict):
    """What each wrapper around an annot model raises on this rank."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from transformers import Trainer

    import annot
    from tests.tiny_hf import tiny_llama

    cls, cfg, split = tiny_llama()
    mesh = annot.Mesh(**mesh_kw)
    split = split if mesh.pp > 1 else None
    said = {}
    model = annot.parallelize(cls, cfg, mesh=mesh, seed=0, split=split)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model=model, args=_args(out, 4), train_dataset=_data())
    with pytest.raises(annot.IntegrationError) as e:
        trainer.train()
    said["Trainer"] = str(e.value)
    with pytest.raises(annot.IntegrationError) as e:
        DistributedDataParallel(torch.nn.Sequential(model))
    said["DDP"] = str(e.value)
    for k, v in model.state_dict().items():  # nothing was broadcast over the shards
        assert torch.equal(v, before[k]), k
    with pytest.raises(annot.IntegrationError) as e:
        fully_shard(model)
    said["fully_shard"] = str(e.value)
    if mesh.pp == 1:  # on a module holding the model: its first forward refuses
        model = annot.parallelize(cls, cfg, mesh=mesh, seed=0, split=split)
        fully_shard(torch.nn.Sequential(model))
        ids = torch.randint(0, 128, (2, 8))
        with pytest.raises(annot.IntegrationError) as e:
            model(ids, labels=ids)
        said["fully_shard around"] = str(e.value)
    return said


@pytest.mark.parametrize("mesh_kw", [{"tp": 2}, pytest.param({"pp": 2}, marks=pytest.mark.slow)])
def test_wrappers_over_different_shards_are_refused(tmp_path, mesh_kw):
    said = run_ranks(_wrappers_refused, 2, str(tmp_path / "cache"), str(tmp_path / "out"), mesh_kw)[
        0
    ]
    assert said["Trainer"].startswith("torch.nn.parallel.DistributedDataParallel around an annot")
    assert "annot.hf.Trainer" in said["Trainer"]
    assert "at '0' inside Sequential" in said["DDP"]
    assert said["fully_shard"].startswith("fully_shard was called on an annot model")
    assert "annot.Mesh(dp=N" in said["fully_shard"]
    if "tp" in mesh_kw:
        assert said["fully_shard around"] == said["fully_shard"]


def _save_then_resume(cache: str, out: str, mesh_kw: dict, resume: bool):
    """Train two steps saving a checkpoint (``resume=False``), or resume from
    it to the end (``resume=True``); then evaluate and save the model."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    import annot.hf
    from tests.tiny_hf import tiny_llama

    cls, cfg, split = tiny_llama()
    mesh = annot.Mesh(**mesh_kw)
    model = annot.parallelize(
        cls, cfg, mesh=mesh, seed=1 if resume else 0, split=split if mesh.pp > 1 else None
    )
    from transformers import TrainerCallback

    class StopAtTwo(TrainerCallback):  # the schedule of STEPS steps, cut after two
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2 and not resume:
                control.should_training_stop = True

    args = _args(
        os.path.join(out, "run"), 4, save_strategy="steps", save_steps=2,
        per_device_eval_batch_size=4,
    )  # fmt: skip
    trainer = annot.hf.Trainer(
        model=model, args=args, train_dataset=_data(), eval_dataset=_data(16),
        callbacks=[StopAtTwo()],
    )  # fmt: skip
    trainer.train(
        resume_from_checkpoint=os.path.join(out, "run", "checkpoint-2") if resume else None
    )
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(out, "final"))
    return _losses(trainer), metrics["eval_loss"]


def _reference_eval_and_reload(out: str, final: str):
    import torch
    from transformers import AutoModelForCausalLM, Trainer

    from tests.tiny_hf import tiny_llama

    cls, cfg, _ = tiny_llama()
    torch.manual_seed(0)
    model = cls(cfg)
    args = _args(out, 4, per_device_eval_batch_size=4)
    trainer = Trainer(model=model, args=args, train_dataset=_data(), eval_dataset=_data(16))
    trainer.train()
    reloaded = AutoModelForCausalLM.from_pretrained(final)  # what annot.hf.Trainer saved
    return (
        _losses(trainer),
        trainer.evaluate()["eval_loss"],
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        reloaded.state_dict(),
    )


@pytest.mark.slow
def test_trainer_saves_and_resumes_on_another_mesh(tmp_path):
    """Two steps at pp2 saved by save_strategy; resumed at tp2 to the end: the
    losses of all steps, the evaluation loss and the saved model (reloaded by
    plain transformers) equal one device's."""
    from tests.parity import assert_close

    cache, out = str(tmp_path / "cache"), str(tmp_path / "out")
    first = run_ranks(_save_then_resume, 2, cache, out, {"pp": 2}, False)[0]
    second = run_ranks(_save_then_resume, 2, cache, out, {"tp": 2}, True)[0]
    losses, eval_loss, state, reloaded = run_ranks(
        _reference_eval_and_reload, 1, str(tmp_path / "ref"), os.path.join(out, "final")
    )[0]
    got = first[0] + second[0][-2:]
    for i, (a, b) in enumerate(zip(got, losses)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"loss at step {i}: {a} != {b}"
    assert abs(second[1] - eval_loss) <= 1e-4 * eval_loss, (second[1], eval_loss)
    for k, v in state.items():
        assert_close(reloaded[k], v, f"saved by annot.hf.Trainer, reloaded: {k}")


def _evaluate(cache: str, out: str, mesh_kw: dict):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    import annot.hf
    from tests.tiny_hf import tiny_llama

    cls, cfg, split = tiny_llama()
    mesh = annot.Mesh(**mesh_kw)
    model = annot.parallelize(cls, cfg, mesh=mesh, seed=0, split=split if mesh.pp > 1 else None)
    args = _args(out, 4, per_device_eval_batch_size=4)
    trainer = annot.hf.Trainer(model=model, args=args, eval_dataset=_data(16))
    return trainer.evaluate()["eval_loss"]


def _reference_evaluate(out: str):
    import torch
    from transformers import Trainer

    from tests.tiny_hf import tiny_llama

    cls, cfg, _ = tiny_llama()
    torch.manual_seed(0)
    args = _args(out, 4, per_device_eval_batch_size=4)
    return Trainer(model=cls(cfg), args=args, eval_dataset=_data(16)).evaluate()["eval_loss"]


def test_trainer_evaluates_a_pipeline(tmp_path):
    ref = run_ranks(_reference_evaluate, 1, str(tmp_path / "ref"))[0]
    got = run_ranks(_evaluate, 2, str(tmp_path / "cache"), str(tmp_path / "out"), {"pp": 2})
    for r, loss in enumerate(got):
        assert abs(loss - ref) <= 1e-5 * ref, f"rank {r}: eval_loss {loss} != {ref}"


def _accelerate_loop(cache: str, mesh_kw: dict):
    """accelerate without the Trainer, as its docs write a loop; a pipeline's
    step is an annot.jit step whose body calls accelerator.backward."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    from torch.utils.data import DataLoader

    import annot
    import annot.hf
    from tests.tiny_hf import tiny_llama

    cls, cfg, split = tiny_llama()
    mesh = annot.Mesh(**mesh_kw)
    model = annot.parallelize(cls, cfg, mesh=mesh, seed=0, split=split if mesh.pp > 1 else None)
    accelerator = annot.hf.Accelerator(cpu=True)  # the mesh of the model just built
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    @annot.jit(model, microbatches=2)
    def step(batch):
        loss = model(**batch).loss
        accelerator.backward(loss)
        return loss

    losses = []
    for i, batch in enumerate(loader):
        if i == STEPS:
            break
        if mesh.pp > 1:
            loss = step(batch).reduce_mean()
        else:
            loss = model(**batch).loss
            accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        # over every process: each replica's loss, once per rank of it
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    state = model.full_state_dict()  # collective
    return losses, state if model.ctx.rank == 0 else None


def one_device_loop(dp: int, pipelined: bool, data: list | None = None):
    """One device: each step the batch of every dp replica, each replica's loss
    a mean over its own tokens (as annot, and DDP, average replicas), split in
    two microbatches where the pipeline splits it. ``data``: the rows (default
    :func:`_data`)."""
    import torch

    from tests.tiny_hf import tiny_llama

    cls, cfg, _ = tiny_llama()
    torch.manual_seed(0)
    ref = cls(cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = _data() if data is None else data
    losses = []
    for i in range(STEPS):
        rows = data[i * 4 * dp : (i + 1) * 4 * dp]
        parts = [rows[j : j + 2] for j in range(0, len(rows), 2)] if pipelined else [
            rows[j : j + 4] for j in range(0, len(rows), 4)
        ]  # fmt: skip
        total = 0.0
        for part in parts:
            ids = torch.stack([r["input_ids"] for r in part])
            labels = torch.stack([r["labels"] for r in part])
            loss = ref(input_ids=ids, labels=labels).loss / len(parts)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, ref.state_dict()


@pytest.mark.parametrize(
    "mesh_kw", [{"tp": 2}, {"pp": 2}, pytest.param({"dp": 2, "tp": 2}, marks=pytest.mark.slow)]
)
def test_accelerate_prepare_equals_one_device(tmp_path, mesh_kw):
    import annot

    mesh = annot.Mesh(**mesh_kw)
    ref = one_device_loop(mesh.dp, mesh.pp > 1)
    got = run_ranks(_accelerate_loop, mesh.size, str(tmp_path), mesh_kw)
    _compare(got[0], ref, f"annot.hf.Accelerator {mesh_kw}")


@pytest.mark.slow  # 4 ranks
def test_the_trainer_example_tp2_pp2(tmp_path):
    """examples/hf_trainer.py as the README runs it: trains, evaluates, saves;
    its rank 0 checks the reloaded model's loss against the Trainer's."""
    import subprocess
    import sys

    from annot.testing import free_port

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "ANNOT_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env["ANNOT_BACKEND"] = "gloo"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    cmd += ["--master-port", str(free_port()), os.path.join(root, "examples", "hf_trainer.py")]
    cmd += ["--tp", "2", "--pp", "2", "--steps", "4", "--workdir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "eval loss: annot.hf.Trainer" in proc.stdout, proc.stdout
