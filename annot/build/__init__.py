"""``annot.parallelize``, step by step: hints resolved, source rewritten (cached),
this rank's part built on the meta device, checked before any rank works,
given its values, wired into a pipeline."""
