"""Every error annot raises on purpose is an :class:`AnnotError`.

Each subclass names one kind of mistake. Messages say what was wrong, where,
and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "AnnotError",
    "HintError",
    "MeshError",
    "RewriteError",
    "PipelineError",
    "RankFailure",
    "PartitionError",
    "CheckpointError",
    "VerifyError",
]


class AnnotError(Exception):
    """Base class of all errors annot raises for bad input or failed runs."""


class HintError(AnnotError, TypeError):
    """A ``@shard`` / ``@stage`` hint (or an external hint) is malformed or does
    not fit the model: names the class, the argument and what was expected."""


class MeshError(AnnotError, ValueError):
    """The mesh does not fit the world (``dp * pp * tp != world size``) or the
    process groups could not be built."""


class RewriteError(AnnotError):
    """The source rewriter refuses a pattern it cannot transform safely.

    ``str(err)`` is ``file:line:col: reason`` so editors can jump to it.
    """

    def __init__(self, reason: str, path: str = "<string>", line: int = 0, col: int = 0):
        self.reason = reason
        self.path = path
        self.line = line
        self.col = col
        super().__init__(f"{path}:{line}:{col}: {reason}")


class PipelineError(AnnotError):
    """A pipeline step went wrong (bad microbatching, a header mismatch between
    stages, a value that cannot cross a boundary)."""


class RankFailure(AnnotError):
    """Another rank failed, died or hung; this rank stopped instead of waiting
    forever. Names the failed rank and, when known, its stage, the operation
    and the microbatch."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        stage: int | None = None,
        op: str | None = None,
        microbatch: int | None = None,
    ):
        self.rank = rank
        self.stage = stage
        self.op = op
        self.microbatch = microbatch
        super().__init__(message)


class PartitionError(AnnotError, ValueError):
    """No partition satisfies the constraints (e.g. the memory budget)."""


class CheckpointError(AnnotError):
    """A checkpoint is missing, incomplete, corrupt or unsafe to load."""


class VerifyError(AnnotError):
    """Verification (``parallelize(verify=True)``) found ranks that disagree on
    what must be equal, e.g. the gradient of a parameter replicated over tp."""


class IntegrationError(AnnotError):
    """A training loop, wrapper or library around an annot model would make it
    wrong (``DistributedDataParallel`` or ``fully_shard`` over ranks that hold
    different shards, a Trainer setting annot cannot honour): names the
    setting and the way annot does the same."""
