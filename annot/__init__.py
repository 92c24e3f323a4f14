"""annot: annotate a PyTorch model with ``@shard`` / ``@stage`` and run it
tensor- and pipeline-parallel, by source rewriting."""

from annot.errors import (
    AnnotError,
    CheckpointError,
    HintError,
    MeshError,
    PartitionError,
    PipelineError,
    RankFailure,
    RewriteError,
)
from annot.hints import boundary, shard, stage
from annot.jit import jit
from annot.mesh import Mesh
from annot.microbatch import StepOutput
from annot.parallel_model import ParallelModel
from annot.parallelize import parallelize
from annot.specs import P, Col, Local, Replicate, Row, Vocab

__all__ = [
    "AnnotError",
    "CheckpointError",
    "Col",
    "HintError",
    "Local",
    "Mesh",
    "MeshError",
    "P",
    "ParallelModel",
    "PartitionError",
    "PipelineError",
    "RankFailure",
    "Replicate",
    "RewriteError",
    "Row",
    "StepOutput",
    "Vocab",
    "boundary",
    "jit",
    "parallelize",
    "shard",
    "stage",
]
