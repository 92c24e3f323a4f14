"""The Hugging Face training loops around an annot model: ``Trainer`` and
``Accelerator``, drop-in subclasses of transformers' and accelerate's.

annot owns the mesh: which ranks hold which shards, which ranks average
gradients (dp only) and which see which data (every tp and pp rank of one dp
replica sees the same batch). transformers' ``Trainer`` and accelerate guess
that from the world size: with two processes they wrap the model in
``DistributedDataParallel`` over both (overwriting tp shards with rank 0's,
averaging different shards' gradients) and give each process other
examples. These subclasses tell them instead, through their own switches:

- the data: accelerate's data loaders split each batch over annot's dp axis
  only (``prepare_data_loader`` with dp processes, this rank's dp index), and
  the Trainer's token counts and loss scale divide by the ``pp * tp`` ranks
  that share a batch (its ``get_tp_size``);
- the model: prepared without DDP or FSDP (annot reduces its gradients);
  ``accelerator.backward(loss)`` is ``model.backward(loss)`` (annot's dp
  average, tied-weight and tp sums);
- the step (Trainer): the batch runs as ``microbatches`` microbatches on
  annot's pipeline schedule (:func:`annot.jit`), with the Trainer's own
  ``compute_loss``; clipping by ``max_grad_norm`` clips the whole model;
  evaluation runs the pipeline forward only;
- saving: ``trainer.save_model()`` writes the Hugging Face layout
  (:func:`annot.save_pretrained`, reloadable by plain transformers);
  checkpoints (``save_strategy``) hold the model and optimizer as
  :func:`annot.save` writes them, and ``resume_from_checkpoint`` reads them
  on any mesh.

What the Trainer would do wrong around annot and these classes cannot fix is
refused when the Trainer is built (:class:`~annot.core.errors.IntegrationError`
naming the setting and annot's way); plain ``transformers.Trainer`` and
``accelerate.Accelerator`` are refused when they wrap the model in DDP
(:mod:`annot.runtime.wrap_guard`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any, Optional

import accelerate
import torch
import transformers

from annot.core.errors import IntegrationError
from annot.core.mesh import Mesh
from annot.parallel_model import ParallelModel, unwrap

__all__ = ["Accelerator", "Trainer"]

# a Trainer checkpoint's model and optimizer, as annot.save writes them
CHECKPOINT_DIR = "annot_checkpoint"


def annot_model(model: Any, who: str) -> ParallelModel:
    """The :class:`ParallelModel` ``model`` is (or that ``torch.compile`` wraps)."""
    inner = unwrap(model)
    if not isinstance(inner, ParallelModel):
        raise IntegrationError(
            f"{who}: model is a {type(model).__name__}; expected what annot.parallelize or "
            "annot.from_pretrained returned (for a plain model use transformers' or "
            "accelerate's own class)"
        )
    return inner


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` for an annot model: data split over annot's
    dp axis, the model prepared without DDP or FSDP, ``backward(loss)`` by
    ``model.backward``. ``mesh``: the annot model's mesh (default: that of
    the last annot model built in this process); other arguments are
    accelerate's."""

    def __init__(self, *args: Any, mesh: Optional[Mesh] = None, **kwargs: Any) -> None:
        if mesh is None:
            from annot.runtime.wrap_guard import last_mesh

            mesh = last_mesh()
        if mesh is not None and kwargs.get("parallelism_config") is not None:
            raise IntegrationError(
                "annot.hf.Accelerator(parallelism_config=...): the annot model's mesh "
                f"({mesh!r}) says which ranks share data and gradients; leave it out"
            )
        super().__init__(*args, **kwargs)
        self.mesh = mesh
        self.annot_model: Optional[ParallelModel] = None

    def prepare_data_loader(
        self, data_loader: Any, device_placement: Optional[bool] = None, slice_fn_for_dispatch=None
    ):
        """accelerate's own, over annot's dp axis: the ``pp * tp`` ranks of a
        dp replica get the same batches (ranks are laid out tp fastest, then
        pp, then dp, so a rank's dp index is its rank // (pp * tp))."""
        mesh = self.mesh
        if mesh is None or mesh.size == 1 or getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if self.dispatch_batches:
            raise IntegrationError(
                "accelerate's dispatch_batches=True (an IterableDataset's default) sends rank 0's "
                f"batches to every process, not to annot's dp replicas ({mesh!r}): pass "
                "DataLoaderConfiguration(dispatch_batches=False) (Trainer: "
                "accelerator_config={'dispatch_batches': False}) with a dataset every rank reads"
            )
        import torch.distributed as dist
        from accelerate.data_loader import prepare_data_loader

        rank = dist.get_rank() if dist.is_initialized() else self.process_index
        if device_placement is None:
            device_placement = self.device_placement
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=mesh.dp,
            process_index=rank // (mesh.pp * mesh.tp),
            split_batches=self.split_batches,
            put_on_device=device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=False,
            even_batches=self.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return prepared

    def prepare_model(
        self, model: torch.nn.Module, device_placement: Optional[bool] = None, evaluation_mode=False
    ):
        inner = unwrap(model)
        if not isinstance(inner, ParallelModel):
            return super().prepare_model(model, device_placement, evaluation_mode)
        if self.scaler is not None:
            raise IntegrationError(
                "accelerate's float16 loss scaling around an annot model scales each rank's "
                "gradients apart (a stage that overflows skips its step alone): train in "
                "bfloat16 (annot.parallelize(..., precision='bf16')), or scale with "
                "annot.grad_scaler(model)"
            )
        self.annot_model = inner
        # annot places the model and reduces its gradients: no DDP, no FSDP, no .to()
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        model = self.annot_model
        if model is None:
            return super().backward(loss, **kwargs)
        model.backward(loss / self.gradient_accumulation_steps)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for an annot model (see the module docstring).

    ``microbatches``: how many microbatches each batch a rank gets runs as
    (default: ``pp``, 1 without a pipeline); the per-device batch size must
    be a multiple of it. ``schedule``: the pipeline schedule, as in
    :func:`annot.jit`. Everything else is transformers' Trainer's.
    """

    def __init__(
        self,
        model: Any = None,
        args: Optional[transformers.TrainingArguments] = None,
        *rest: Any,
        microbatches: Optional[int] = None,
        schedule: str = "1f1b",
        **kwargs: Any,
    ) -> None:
        inner = annot_model(model, "annot.hf.Trainer")
        self.annot_model = inner
        self.microbatches = microbatches if microbatches is not None else inner.ctx.mesh.pp
        self.schedule = schedule
        if args is not None:
            refuse_settings(args, inner)
        super().__init__(model, args, *rest, **kwargs)
        refuse_settings(self.args, inner)
        self.inspect_model(inner.module)
        self._train_step: Any = None
        self._eval_step: Any = None

    def inspect_model(self, module: torch.nn.Module) -> None:
        """What the Trainer reads from the model it was given, read from the
        model annot wraps (the Trainer's own rules, transformers 5)."""
        from transformers.utils import can_return_loss, find_labels

        self.model_accepts_loss_kwargs = accepts_loss_kwargs(module)
        if self.args.label_names is None:
            self.label_names = find_labels(type(module))
        self.can_return_loss = can_return_loss(type(module))
        if hasattr(self, "_loss_shifts_labels"):  # a causal LM's token count skips position 0
            from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

            config = getattr(module, "config", None)
            loss_type = getattr(module, "loss_type", None)
            causal = loss_type is not None and LOSS_MAPPING.get(loss_type) is ForCausalLMLoss
            self._loss_shifts_labels = causal and not getattr(config, "is_encoder_decoder", False)

    # -- accelerate ---------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        with trainer_accelerator_class(Accelerator):
            super().create_accelerator_and_postprocess()

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        args["mesh"] = self.annot_model.ctx.mesh
        return args

    def get_tp_size(self) -> int:
        """The ranks that see the same batch (the Trainer divides its token
        counts by them, and scales the loss by world / them = dp)."""
        mesh = self.annot_model.ctx.mesh
        return mesh.pp * mesh.tp

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            names = list(inspect.signature(self.annot_model.module.forward).parameters)
            columns = names + list({"label", "label_ids", *self.label_names})
            self._signature_columns = columns  # type: ignore[assignment]

    # -- the step -----------------------------------------------------------

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        import annot

        model.train()
        train = getattr(self.optimizer, "train", None)  # schedule-free optimizers
        if callable(train):
            train()
        inputs = self._prepare_inputs(inputs)
        # the loss of a whole-batch sum over num_items tokens is already scaled for
        # gradient accumulation; a per-batch mean is divided by its steps here
        summed = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            self.compute_loss_func is not None
        )
        if self.loss_is_scaled_for_ga is not None:
            summed = self.loss_is_scaled_for_ga
        weight = 1.0 if summed else 1.0 / self.current_gradient_accumulation_steps
        # annot.jit weighs each microbatch's loss by its share of the batch (a mean):
        # a microbatch's part of a whole-batch sum counts whole; a microbatch's mean
        # over its own label tokens counts by its share of the batch's tokens
        per_mb = float(self.microbatches) if summed else 1.0
        total = None if summed else self.label_count(inputs)

        if self._train_step is None:

            @annot.jit(self.annot_model, microbatches=self.microbatches, schedule=self.schedule)
            def train_step(batch: dict[str, Any], num_items: Any, total: Any, scale: float):
                # batch is split into microbatches; num_items and total (0-d tensors)
                # and scale are passed whole
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, batch, num_items_in_batch=num_items)
                assert isinstance(loss, torch.Tensor)  # (no return_outputs)
                share = self.token_share(batch, total)
                self.annot_model.backward(loss * (scale * share))
                return loss.detach() * share

            self._train_step = train_step
        out = self._train_step(inputs, num_items_in_batch, total, per_mb * weight)
        return (out.reduce_mean() * per_mb * weight).detach()

    def label_count(self, batch: dict[str, Any]) -> Optional[torch.Tensor]:
        """How many label tokens the loss averages over in ``batch`` (the
        Trainer's rule: a causal LM's first position predicts nothing), or
        None without labels or with none unmasked."""
        labels = batch.get("labels")
        if not isinstance(labels, torch.Tensor) or labels.dim() == 0:
            return None
        if self.loss_shifts_labels():
            labels = labels[..., 1:]
        count = labels.ne(-100).sum()
        return count if count > 0 else None

    def token_share(self, batch: dict[str, Any], total: Optional[torch.Tensor]) -> Any:
        """A microbatch's weight against annot.jit's equal shares: its share
        of the batch's label tokens times the number of microbatches (1 where
        they are not counted)."""
        mine = None if total is None else self.label_count(batch)
        if mine is None or total is None:
            return 1.0
        return self.microbatches * mine / total

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return self.annot_model.clip_grad_norm_(self.args.max_grad_norm)

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: Optional[list[str]] = None,
    ) -> tuple[Optional[torch.Tensor], Any, Any]:
        pipeline = self.annot_model.pipeline
        if pipeline is None or pipeline.num_stages == 1:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        import annot

        inputs = self._prepare_inputs(inputs)
        has_labels = bool(self.label_names) and all(
            inputs.get(k) is not None for k in self.label_names
        )
        if not has_labels:
            raise IntegrationError(
                "annot.hf.Trainer evaluates a pipelined model by its loss: the evaluation batch "
                f"has no labels ({self.label_names or 'label_names is empty'}); pass labels, or "
                "run predictions in an @annot.jit(model, microbatches=M, forward_only=True) step"
            )
        # a microbatch's loss as its part of the batch's sum over label tokens, where
        # the model takes the count; else its mean weighted by its share of them
        num_items = None
        if self.model_accepts_loss_kwargs and isinstance(inputs.get("labels"), torch.Tensor):
            labels = inputs["labels"][..., 1:] if self.loss_shifts_labels() else inputs["labels"]
            num_items = labels.ne(-100).sum()
        if self._eval_step is None:

            @annot.jit(
                self.annot_model,
                microbatches=self.microbatches,
                schedule=self.schedule,
                forward_only=True,
            )
            def eval_step(batch: dict[str, Any], num_items: Any, total: Any) -> Any:
                loss, outputs = self.compute_loss(
                    model, batch, return_outputs=True, num_items_in_batch=num_items
                )
                logits = None
                if not prediction_loss_only and isinstance(outputs, dict):
                    logits = outputs.get("logits")
                return loss.detach() * self.token_share(batch, total), logits

            self._eval_step = eval_step
        total = self.label_count(inputs) if num_items is None else None
        with torch.no_grad(), self.compute_loss_context_manager():
            out = self._eval_step(inputs, num_items, total)
        losses = torch.stack([v[0] for v in out])
        if num_items is None:  # means weighted by their token shares
            loss = losses.mean()
        else:  # compute_loss scaled each part by the dp average it undoes in training
            averaged = self.args.average_tokens_across_devices
            loss = losses.sum() / (self.annot_model.ctx.mesh.dp if averaged else 1)
        if prediction_loss_only:
            return loss, None, None
        logits = [v[1] for v in out]
        labels = tuple(inputs.get(k) for k in self.label_names)
        joined = torch.cat(logits) if all(t is not None for t in logits) else None
        return loss, joined, labels[0] if len(labels) == 1 else labels

    def loss_shifts_labels(self) -> bool:
        return bool(getattr(self, "_loss_shifts_labels", False))

    # -- saving -------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The Hugging Face layout, through :func:`annot.save_pretrained` (every
        rank calls it, as the Trainer does)."""
        import annot

        output_dir = str(output_dir if output_dir is not None else self.args.output_dir)
        annot.save_pretrained(self.annot_model, output_dir, overwrite=True)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        import annot

        annot.save(self.annot_model, self.optimizer, os.path.join(output_dir, CHECKPOINT_DIR))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        pass  # read with the optimizer, once the optimizer exists

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        import annot
        from annot.core.errors import CheckpointError

        path = os.path.join(checkpoint, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise CheckpointError(
                f"resume_from_checkpoint={checkpoint!r}: no {CHECKPOINT_DIR}/ in it; annot.hf.Trainer "
                "resumes from the checkpoints it saved (save_strategy)"
            )
        annot.load(self.annot_model, self.optimizer, path)
        scheduler = os.path.join(checkpoint, "scheduler.pt")
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def accepts_loss_kwargs(module: torch.nn.Module) -> bool:
    """transformers' rule: the model says so, or its forward takes ``**kwargs``."""
    if hasattr(module, "accepts_loss_kwargs"):
        return bool(module.accepts_loss_kwargs)
    params = inspect.signature(module.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def refuse_settings(args: transformers.TrainingArguments, model: ParallelModel) -> None:
    """Trainer settings annot cannot honour, refused when the Trainer is built."""
    mesh = model.ctx.mesh
    refusals = {
        "fsdp": (
            bool(args.fsdp),
            "annot shards over its dp axis itself: annot.parallelize(..., "
            f"mesh=annot.Mesh(dp=N, pp={mesh.pp}, tp={mesh.tp}), fsdp=True)",
        ),
        "deepspeed": (
            bool(getattr(args, "deepspeed", None)),
            "DeepSpeed would shard and reduce the model itself; annot's own: "
            "annot.Mesh(dp=N, ...), fsdp=True, annot.zero_optimizer",
        ),
        "parallelism_config": (
            getattr(args, "parallelism_config", None) is not None,
            f"annot builds it from the model's mesh ({mesh!r}); leave it out",
        ),
        "gradient_checkpointing": (
            bool(args.gradient_checkpointing),
            "annot recomputes activations by module class: call annot.recompute(BlockClass) "
            "(e.g. LlamaDecoderLayer) before building the model",
        ),
        "label_smoothing_factor": (
            bool(args.label_smoothing_factor),
            "not supported by annot.hf.Trainer yet: compute a smoothed loss in compute_loss_func",
        ),
    }
    for name, (given, way) in refusals.items():
        if given:
            raise IntegrationError(
                f"annot.hf.Trainer: TrainingArguments({name}=...) around an annot model "
                f"({mesh!r}): {way}"
            )


@contextlib.contextmanager
def trainer_accelerator_class(cls: type):
    """The Trainer builds its accelerator as ``Accelerator(**args)`` from
    transformers.trainer's own name: that name is ``cls`` while it does."""
    import transformers.trainer as trainer_module

    old = trainer_module.Accelerator
    trainer_module.Accelerator = cls
    try:
        yield
    finally:
        trainer_module.Accelerator = old
