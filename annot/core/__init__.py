"""The vocabulary every layer of annot imports, and that imports nothing of annot's
but itself: the errors (:mod:`~annot.core.errors`), the sharding specs
(:mod:`~annot.core.specs`), the decorators that record them
(:mod:`~annot.core.hints`), the mesh layout (:mod:`~annot.core.mesh`) and
atomic file writes (:mod:`~annot.core.files`).

The layers above it: the rewriters (``annot.rewriters``) and the runtime
(``annot.runtime``), side by side; the orchestration (``annot.build.parallelize``,
``annot.cli.main``, the planner) on top."""
