"""``annot.from_pretrained``: build the parallel model with its weights read
from a Hugging Face checkpoint, each rank reading only what it holds.

    model = annot.from_pretrained(LlamaForCausalLM, "ckpt/", mesh=annot.Mesh(pp=2, tp=2))

Steps:

1. open the checkpoint: the weight files (``model.safetensors``, or the
   shards its index lists, or the one file given), every header checked
   against its file's size (:mod:`annot.io.hf_files`): a truncated file or a
   broken header is refused here, before anything is built;
2. the config from the directory (a transformers class given no arguments);
3. :func:`annot.parallelize` builds this rank's part as always (rewrite,
   stages, tp shards; on meta) with :class:`PretrainedWeights` as its weight
   source, which at step 5 matches the stored names to the single-device
   model's (:mod:`annot.io.hf_names`, transformers' rules), refuses missing,
   unexpected and wrong-shape tensors naming each, and gives every tensor
   storage: those on disk empty, the rest (non-persistent buffers such as
   rotary tables) their values from the class's constructor, replayed by
   deferred initialization without the weight init;
4. after FSDP2 has sharded the parameters over dp (``fsdp=True``), each
   rank reads its boxes of the stored tensors (:mod:`annot.io.held_slices`:
   its stages' tensors, its tp slice, its dp chunk) straight into them
   (:func:`annot.io.safetensors_files.read_box`). No rank reads or holds
   more than its own part; a load past a few seconds prints its progress on
   rank 0.

The result is the :class:`~annot.parallel_model.ParallelModel`
``parallelize`` returns; ``model.report.pretrained`` says where its weights
came from, for :func:`annot.save_pretrained`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from annot.core.errors import CheckpointError
from annot.io.hf_files import Stored, open_stored
from annot.io.hf_names import Matched, is_transformers, match_names

__all__ = ["PretrainedWeights", "Progress", "Source", "from_pretrained"]


@dataclass(frozen=True)
class Source:
    """Where a model's weights were read: the checkpoint directory (None for
    a lone file) and the stored name of each model name."""

    directory: Optional[str]
    loaded_as: dict[str, str]


def from_pretrained(
    model: type,
    path: str | os.PathLike,
    *args: Any,
    dtype: Optional[torch.dtype] = None,
    strict: bool = True,
    **options: Any,
) -> Any:
    """This rank's part of ``model`` (an ``nn.Module`` class) with the weights
    stored at ``path``, built over ``mesh=`` with every other option of
    :func:`annot.parallelize` (``split=``, ``chunks=``, ``hints=``,
    ``fsdp=``, ``sequence_parallel=``, ``precision=``, ...). Every rank calls it.

    ``path`` is a checkpoint directory as transformers' ``save_pretrained``
    writes it (``config.json`` and ``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``), or one safetensors file of the
    single-device model's state dict. A transformers class given no
    arguments takes its config from the directory; any other class is built
    from ``*args`` (and constructor keywords), as ``parallelize`` builds it.
    Names follow transformers' ``from_pretrained`` (tied weights stored once,
    ``base_model_prefix``, the keys it ignores, its renamings).

    ``dtype=`` converts the stored floating-point tensors (default: the
    model's own dtype, float32 for transformers classes). ``strict=True``
    refuses a checkpoint with missing, unexpected or wrong-shape tensors
    (:class:`CheckpointError` naming each); ``strict=False`` loads what
    matches and leaves the rest as the class initializes it (wrong shapes
    are refused either way).
    """
    from annot.build.parallelize import parallelize

    stored = open_stored(path)
    if not args and is_transformers(model):
        args = (_config(model, stored),)
    weights = PretrainedWeights(stored, model, args, options, dtype=dtype, strict=strict)
    options.setdefault("seed", 0)  # nothing is drawn: every rank starts alike without a check
    built = parallelize(model, *args, weights=weights, **options)
    built.report.pretrained = Source(stored.directory, dict(weights.matched.load))
    return built


def _config(model: type[Any], stored: Stored):
    if stored.directory is None:
        raise CheckpointError(
            f"{stored.path}: a lone safetensors file has no config; pass the config: "
            f"annot.from_pretrained({model.__name__}, {stored.path!r}, config, mesh=...)"
        )
    return model.config_class.from_pretrained(stored.directory)


class Progress:
    """Prints ``annot: from_pretrained: read 1.2 GiB of 3.4 GiB (35%) in 6 s``
    to stderr on rank 0, once ``after_s`` seconds have passed and then every
    ``every_s``, and a last line when done (only if it printed before)."""

    def __init__(self, total: int, *, show: bool, after_s: float = 3.0, every_s: float = 3.0):
        self.total, self.show, self.after_s, self.every_s = total, show, after_s, every_s
        self.done = 0
        self.start = self.last = time.monotonic()
        self.printed = False

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.show and now - self.start >= self.after_s and now - self.last >= self.every_s:
            self._print(now)

    def finish(self) -> None:
        if self.printed:
            self._print(time.monotonic())

    def _print(self, now: float) -> None:
        gib = 1024**3
        pct = 100 * self.done / max(self.total, 1)
        print(
            f"annot: from_pretrained: read {self.done / gib:.2f} GiB of {self.total / gib:.2f} "
            f"GiB on rank 0 ({pct:.0f}%) in {now - self.start:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        self.last, self.printed = now, True


class PretrainedWeights:
    """The weight source :func:`annot.parallelize` takes from
    :func:`from_pretrained` (``weights=``): :meth:`allocate` at step 5 (names
    matched, storage given, nothing read), :meth:`fill` once the model is
    built (each rank's boxes read)."""

    def __init__(self, stored: Stored, model, args, options, *, dtype, strict: bool):
        self.stored = stored
        self.build = (model, args, _model_kwargs(options))
        self.dtype = dtype
        self.strict = strict
        self.matched = Matched()

    def allocate(self, local: nn.Module, ref: nn.Module, ctx) -> None:
        """Step 5 of ``parallelize``: refuse a checkpoint that does not fit
        ``ref`` (the single-device model, on meta); give ``local`` (this
        rank's part, on meta) its storage: empty for what is read later,
        replayed from the constructor for the rest."""
        from annot.runtime import process_groups
        from annot.runtime.init.deferred import materialize_, named_tensors, shard_slicers

        shapes = {k: entry.shape for k, (_, entry) in self.stored.tensors.items()}
        self.matched = match_names(ref, shapes)
        self._refuse_misfits()
        tensors = named_tensors(local)
        values: dict[str, torch.Tensor] = {}
        by_id: dict[int, torch.Tensor] = {}
        for name, t in tensors.items():
            if name not in self.matched.load:
                continue
            if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
                t.data = torch.empty_like(t, dtype=self.dtype, device="meta")
            if id(t) not in by_id:
                by_id[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=ctx.device)
            values[name] = by_id[id(t)]
        rest = [n for n in tensors if n not in values]
        if rest:
            with process_groups.use(ctx):
                slicer = shard_slicers(local)
            values.update(self._constructed(set(rest), slicer))
        materialize_(local, values, ctx.device)

    def _refuse_misfits(self) -> None:
        m, where = self.matched, self.stored.path
        if m.wrong_shape:
            raise CheckpointError(f"{where}: wrong shapes: {'; '.join(m.wrong_shape)}")
        if self.strict and (m.missing or m.unexpected):
            raise CheckpointError(
                f"{where}: does not fit {self.build[0].__name__}: missing "
                f"{m.missing or 'none'}, unexpected {m.unexpected or 'none'}. Load a "
                "checkpoint of this model and configuration, or pass strict=False to load "
                "the tensors that match"
            )
        if m.missing or m.unexpected:
            import warnings

            warnings.warn(
                f"annot.from_pretrained(strict=False): {where}: missing {m.missing or 'none'} "
                f"(initialized by the class), unexpected {m.unexpected or 'none'} (not read)",
                stacklevel=4,
            )

    def _constructed(self, names: set[str], slicer) -> dict[str, torch.Tensor]:
        """The values the constructor gives ``names`` (non-persistent buffers,
        tensor attributes; with ``strict=False`` the missing weights too),
        by deferred initialization: the weight init skipped (transformers'
        ``no_init_weights``) unless a missing weight needs it."""
        import contextlib

        from annot.runtime.init.deferred import deferred_reference

        model, args, kwargs = self.build
        quiet: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if is_transformers(model) and not self.matched.missing:
            from transformers.initialization import no_init_weights

            quiet = no_init_weights()
        with torch.random.fork_rng(), quiet:
            _, values = deferred_reference(
                lambda: model(*args, **kwargs), lambda n: slicer(n) if n in names else None
            )
        return values

    def fill(self, built) -> None:
        """Read this rank's boxes of every stored tensor it holds into the
        built model (after FSDP2's sharding: its dp chunk only). Every rank
        calls it; a failure on any rank is raised on all."""
        from annot.io.dcp_adapter import Target, exchange
        from annot.io.held_slices import held_slices
        from annot.io.safetensors_files import read_box
        from annot.runtime import process_groups

        target = Target.of(built)
        err = None
        try:
            with process_groups.use(built.ctx):
                held = held_slices(built.module)
            jobs = self._jobs(held)
            progress = Progress(
                sum(h.local.numel() * h.local.element_size() for _, h in jobs),
                show=target.rank == 0,
            )
            fds: dict[str, int] = {}
            try:
                with torch.no_grad():
                    for key, h in jobs:
                        file, entry = self.stored.tensors[key]
                        if file not in fds:
                            fds[file] = os.open(file, os.O_RDONLY)
                        dest = h.local.detach()
                        for piece in h.pieces:
                            read_box(fds[file], entry, piece.offsets, piece.sizes, piece.of(dest))
                        progress.add(dest.numel() * dest.element_size())
            finally:
                for fd in fds.values():
                    os.close(fd)
            progress.finish()
        except (CheckpointError, OSError) as e:
            err = e if isinstance(e, CheckpointError) else CheckpointError(f"{e}")
        exchange(target, err, None, f"from_pretrained({self.stored.path!r})")

    def _jobs(self, held: dict) -> list:
        """``(stored name, Held)`` once per tensor this rank holds that is stored."""
        seen: set[int] = set()
        jobs = []
        for name, h in held.items():
            key = self.matched.load.get(name)
            if key is None or id(h.tensor) in seen:
                continue
            seen.add(id(h.tensor))
            jobs.append((key, h))
        return jobs


def _model_kwargs(options: dict) -> dict:
    """The constructor keywords among ``options`` (as ``parallelize`` tells
    them from its own options, ``model_kwargs=`` included)."""
    import inspect

    from annot.build.parallelize import parallelize

    params = inspect.signature(parallelize).parameters
    own = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return {
        **{k: v for k, v in options.items() if k not in own},
        **(options.get("model_kwargs") or {}),
    }
