"""How a stage's callable is made: the source runner (rewritten stage methods)
and the replay runner (module calls at any depth, others replayed on meta)."""
