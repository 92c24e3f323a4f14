"""``Mesh(dp, pp, tp)``: the parallel layout as data.

Ranks are laid out tp fastest, then pp, then dp (Megatron's order), so a tp
group is consecutive ranks. The runtime builds torch's DeviceMesh from it.
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

    def __post_init__(self) -> None:
        for axis in ("dp", "pp", "tp"):
            v = getattr(self, axis)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MeshError(f"Mesh({axis}={v!r}): {axis} must be an int >= 1")

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

    def key(self) -> str:
        return f"dp{self.dp}-pp{self.pp}-tp{self.tp}"

    def __repr__(self) -> str:
        return f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp})"
