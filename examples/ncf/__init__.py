"""Neural Collaborative Filtering (NeuMF), one of the SageMaker
model-parallelism paper's workloads, annotated for annot: ``model.py`` the
model, ``train.py`` the torchrun script."""

__all__ = []
