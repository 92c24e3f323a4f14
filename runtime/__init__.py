"""Execution over torch.distributed: mesh and groups, TP layers, pipeline, partitioner."""
