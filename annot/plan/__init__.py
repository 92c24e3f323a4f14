"""Where to cut a pipeline: candidate points, their measured costs, the balanced
partition, the memory model, and the what-if table over meshes."""
