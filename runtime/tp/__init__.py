"""Tensor parallelism at run time: Megatron's collectives, the tp layers the
rewriter emits, built layers converted, vocab-parallel loss, sequence parallelism."""
