"""PyTorch Lightning around an annot model: ``AnnotStrategy``.

Lightning's default strategy on several processes wraps the LightningModule
in ``DistributedDataParallel`` over all of them (refused around an annot
model whose ranks hold different parts: :mod:`annot.runtime.wrap_guard`) and gives
each process other batches. ``Trainer(strategy=AnnotStrategy())`` instead:

- leaves the model unwrapped (annot places it and reduces its gradients);
- samples each batch over annot's dp axis only (every tp and pp rank of one
  dp replica gets the same batches);
- runs Lightning's backward as ``model.backward(loss)`` of the annot model the
  LightningModule holds (its dp average, tied-weight and tp sums); gradient
  clipping (``gradient_clip_val``) clips the whole model;
- saves checkpoints with the annot model's weights in the single-device
  names (gathered, as ``model.full_state_dict()``), which
  ``load_from_checkpoint`` and ``ckpt_path=`` read back into any mesh. The
  optimizer's state is not in them (each rank's is its shards): resuming
  with ``ckpt_path=`` restores the weights, epoch and step, and refuses to
  run unless the LightningModule saves and loads its optimizer itself
  (``annot.save`` / ``annot.load`` in ``on_save_checkpoint`` /
  ``on_load_checkpoint``).

The LightningModule holds exactly one annot model (an attribute, built in
``__init__`` or ``configure_model``). Without a pipeline its
``training_step`` returns the loss as usual; with one, the step runs on
annot's schedule, so it uses manual optimization::

    self.automatic_optimization = False
    def training_step(self, batch):
        loss = self.step(batch).reduce_mean()   # an @annot.jit step
        opt = self.optimizers(); opt.step(); opt.zero_grad()
        return loss
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from annot.core.errors import IntegrationError
from annot.parallel_model import ParallelModel

__all__ = ["AnnotStrategy"]


class AnnotStrategy(ParallelStrategy):
    """A Lightning strategy for a LightningModule holding an annot model (see
    the module docstring)."""

    strategy_name = "annot"

    def __init__(self, timeout: Optional[timedelta] = default_pg_timeout) -> None:
        super().__init__()
        self._timeout = timeout
        self.num_nodes = 1

    # -- the annot model --------------------------------------------------

    def module(self) -> Any:
        """The LightningModule (set once the Trainer has it)."""
        assert self.lightning_module is not None
        return self.lightning_module

    def annot_model(self) -> tuple[str, ParallelModel]:
        """The annot model the LightningModule holds, and its attribute path."""
        module = self.module()
        found = [(n, m) for n, m in module.named_modules() if isinstance(m, ParallelModel)]
        if len(found) != 1:
            raise IntegrationError(
                f"AnnotStrategy: the LightningModule {type(module).__name__} holds "
                f"{len(found)} annot models ({', '.join(n for n, _ in found) or 'none'}); it "
                "must hold exactly one, built by annot.parallelize or annot.from_pretrained"
            )
        return found[0]

    # -- processes and data -------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        ctx = self.annot_model()[1].ctx
        return {"num_replicas": ctx.mesh.dp, "rank": ctx.dp_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(
            self.node_rank * self.num_processes + self.local_rank
        )
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        if not dist.is_initialized():  # else annot.parallelize started it
            backend = "nccl" if self.root_device.type == "cuda" else "gloo"
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.annot_model()  # exactly one, before anything runs
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        pass  # annot placed the model: each rank's part on its device

    # -- the step -----------------------------------------------------------

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any):
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.module())
        self.annot_model()[1].backward(closure_loss)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.module())
        self.post_backward(closure_loss)
        return closure_loss

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: Optional[str] = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # -- checkpoints --------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state, its annot model's part in the single-
        device names (a collective: every rank gathers)."""
        prefix, model = self.annot_model()
        own = f"{prefix}."
        state = {k: v for k, v in self.module().state_dict().items() if not k.startswith(own)}
        state.update({own + k: v for k, v in model.full_state_dict().items()})
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        prefix, model = self.annot_model()
        own = f"{prefix}."
        state = checkpoint["state_dict"]
        mine = {k[len(own) :]: v for k, v in state.items() if k.startswith(own)}
        model.load_full_state_dict(mine, strict=strict)
        rest = {k: v for k, v in state.items() if not k.startswith(own)}
        missing, unexpected = self.module().load_state_dict(rest, strict=False)
        if strict and (unexpected or [k for k in missing if not k.startswith(own)]):
            raise IntegrationError(
                f"AnnotStrategy: the checkpoint's state does not fit {type(self.module()).__name__}"
                f": missing {missing[:4]}, unexpected {unexpected[:4]}"
            )

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # each rank's state is its shards: annot.save writes it (see the docstring)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not checkpoint.get("annot_optimizer_saved", False):
            raise IntegrationError(
                "AnnotStrategy: this checkpoint holds the annot model's weights but not its "
                "optimizer's state (each rank's is its shards). Save and load it in the "
                "LightningModule: annot.save(self.model, optimizer, path) in on_save_checkpoint "
                "(and set checkpoint['annot_optimizer_saved'] = True there), annot.load(...) in "
                "on_load_checkpoint; or load the weights alone with "
                "LightningModule.load_from_checkpoint"
            )

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options=None):
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(
                checkpoint, filepath, storage_options=storage_options
            )

    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
