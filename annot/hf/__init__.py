"""Hugging Face transformers under annot: a model's tp and pp plans read as
hints (:mod:`annot.hf.models`, :mod:`annot.hf.tp_plan`), and transformers'
``Trainer`` and accelerate's ``Accelerator`` for an annot model
(:mod:`annot.integrations.hf_trainer`, loaded on first use: it imports both)."""

from typing import Any

from annot.hf.models import hints_from_hf_config, stages_from_hf_config

__all__ = ["Accelerator", "Trainer", "hints_from_hf_config", "stages_from_hf_config"]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "Accelerator"):
        from annot.integrations import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module 'annot.hf' has no attribute {name!r}")
