"""The tensor-parallel rewrite: ``@shard`` hints into tp constructors, per-rank
sizes and the vocab-parallel loss."""
