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
from annot.mesh import Mesh
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
    "PartitionError",
    "PipelineError",
    "RankFailure",
    "Replicate",
    "RewriteError",
    "Row",
    "Vocab",
    "boundary",
    "shard",
    "stage",
]
