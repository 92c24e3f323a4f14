"""``Mesh(dp, pp, tp, ep)``: the parallel layout as data.

Ranks are laid out tp fastest, then pp, then dp (Megatron's order), so a tp
group is consecutive ranks. The runtime builds torch's DeviceMesh from it.

Expert parallelism borrows the data-parallel ranks, as torchtitan's does: ``ep``
divides ``dp``, and each group of ``ep`` consecutive dp ranks (same pp and tp
coordinates) holds every expert once, ``1/ep`` of them on each rank; tokens
travel to their experts' ranks by all-to-all. Outside the experts the ``dp``
ranks are data parallel as ever. ``Mesh(dp=4, ep=2)``: two expert groups of
two ranks each; the expert weights are replicated over the ``dp / ep`` groups.

Context parallelism borrows them too: ``cp`` divides ``dp``, and each group of
``cp`` consecutive dp ranks reads one batch and splits its sequence, ``1/cp``
of the tokens each. ``Mesh(dp=4, cp=2)`` reads ``dp / cp = 2`` batches a step
(:attr:`Mesh.batches`; a rank's is ``ctx.batch_rank``).
"""

from __future__ import annotations

from dataclasses import dataclass

from annot.core.errors import MeshError

__all__ = ["Mesh"]


@dataclass(frozen=True)
class Mesh:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "pp", "tp", "ep", "cp"):
            v = getattr(self, axis)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MeshError(f"Mesh({axis}={v!r}): {axis} must be an int >= 1")
        if self.dp % self.ep:
            raise MeshError(
                f"Mesh(dp={self.dp}, ep={self.ep}): expert parallelism borrows the data-parallel "
                f"ranks, so ep must divide dp; each rank then holds 1/ep of the experts and "
                f"sees its own batch. Use Mesh(dp={self.ep * max(1, self.dp // self.ep)}, "
                f"ep={self.ep}, ...) and launch dp * pp * tp ranks"
            )
        if self.dp % self.cp:
            raise MeshError(
                f"Mesh(dp={self.dp}, cp={self.cp}): context parallelism borrows the "
                f"data-parallel ranks, so cp must divide dp; each group of cp ranks reads one "
                f"batch and splits its sequence. Use Mesh(dp={self.cp * max(1, self.dp // self.cp)}, "
                f"cp={self.cp}, ...) and launch dp * pp * tp ranks"
            )
        if self.ep > 1 and self.cp > 1:
            raise MeshError(
                f"Mesh(ep={self.ep}, cp={self.cp}): expert and context parallelism together are "
                "not built yet; use one of them"
            )

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def validate(self, world_size: int) -> None:
        if self.size != world_size:
            raise MeshError(
                f"dp({self.dp}) * pp({self.pp}) * tp({self.tp}) = {self.size} != "
                f"world size ({world_size}); launch with torchrun --nproc-per-node "
                f"{self.size} or change the mesh"
            )

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) coordinates of a global rank."""
        tp = rank % self.tp
        pp = (rank // self.tp) % self.pp
        dp = rank // (self.tp * self.pp)
        return dp, pp, tp

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def ep_coords(self, dp: int) -> tuple[int, int]:
        """``(expert group, rank in it)`` of dp rank ``dp``: groups of ``ep``
        consecutive dp ranks."""
        return dp // self.ep, dp % self.ep

    def cp_coords(self, dp: int) -> tuple[int, int]:
        """``(batch, rank in its context group)`` of dp rank ``dp``: groups of
        ``cp`` consecutive dp ranks read one batch."""
        return dp // self.cp, dp % self.cp

    @property
    def batches(self) -> int:
        """How many batches a step reads: one per group of ``cp`` dp ranks."""
        return self.dp // self.cp

    def key(self) -> str:
        extra = "".join(f"-{a}{getattr(self, a)}" for a in ("ep", "cp") if getattr(self, a) > 1)
        return f"dp{self.dp}-pp{self.pp}-tp{self.tp}" + extra

    def __repr__(self) -> str:
        extra = "".join(f", {a}={getattr(self, a)}" for a in ("ep", "cp") if getattr(self, a) > 1)
        return f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}{extra})"
