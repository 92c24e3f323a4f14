"""The training step: ``annot.jit`` over microbatches, its ``explain``, the
optimizer sharded over dp, mixed precision, loss scaling, gradient clipping."""
