"""annot: annotate a PyTorch model with ``@shard`` / ``@stage`` and run it
tensor- and pipeline-parallel, by source rewriting."""

from annot.core.errors import (
    AnnotError,
    CheckpointError,
    HintError,
    IntegrationError,
    MeshError,
    PartitionError,
    PipelineError,
    RankFailure,
    RewriteError,
    VerifyError,
)
from annot.core.hints import boundary, checkpoint, recompute, shard, stage
from annot.core.mesh import Mesh
from annot.core.specs import Col, Experts, Heads, Local, P, Partial, Replicate, Row, Vocab

__all__ = [
    "AnnotError",
    "CheckpointError",
    "Col",
    "HintError",
    "IntegrationError",
    "Local",
    "Mesh",
    "MeshError",
    "P",
    "ParallelModel",
    "Partial",
    "Heads",
    "Experts",
    "PartitionError",
    "PipelineError",
    "RankFailure",
    "Replicate",
    "RewriteError",
    "Row",
    "StepOutput",
    "VerifyError",
    "Vocab",
    "boundary",
    "checkpoint",
    "clip_grad_norm_",
    "from_pretrained",
    "grad_scaler",
    "jit",
    "load",
    "load_full",
    "parallelize",
    "recompute",
    "save",
    "save_pretrained",
    "shard",
    "stage",
    "state_bytes",
    "zero_optimizer",
]

# The torch-heavy entry points load on first use, so `annot rewrite` and the
# rewriters start without importing torch.
_LAZY = {
    "jit": "annot.training.jit",
    "parallelize": "annot.build.parallelize",
    "ParallelModel": "annot.parallel_model",
    "clip_grad_norm_": "annot.parallel_model",
    "StepOutput": "annot.training.microbatch",
    "save": "annot.io.dcp",
    "load": "annot.io.dcp",
    "load_full": "annot.io.dcp",
    "from_pretrained": "annot.io.pretrained",
    "save_pretrained": "annot.io.save_pretrained",
    "zero_optimizer": "annot.training.optim",
    "grad_scaler": "annot.training.grad_scaler",
    "state_bytes": "annot.training.optim",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'annot' has no attribute {name!r}")
