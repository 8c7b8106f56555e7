"""GPU instance types: a GPU job restores only where CRIU's CUDA plugin finds the same GPU model and count.

What each type holds comes from EC2 (DescribeInstanceTypes' GpuInfo), never from a table here that would age.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpus:
    """The GPUs of an instance type, as DescribeInstanceTypes' GpuInfo names them."""

    manufacturer: str
    model: str
    count: int

    def __str__(self) -> str:
        return f"{self.count} x {self.manufacturer} {self.model}"


def from_gpu_info(info: Mapping[str, object] | None) -> Gpus | None:
    """Gpus from an instance type's GpuInfo; None for a type without GPUs."""
    gpus = list(info.get("Gpus", [])) if info else []  # type: ignore[call-overload]
    if not gpus:
        return None
    models = sorted({(str(g.get("Manufacturer", "")), str(g.get("Name", ""))) for g in gpus})
    count = sum(int(g.get("Count", 0)) for g in gpus)
    return Gpus(manufacturer=" + ".join(m for m, _ in models), model=" + ".join(n for _, n in models), count=count)


def matching_fallbacks(
    job_type: str, fallbacks: Sequence[str], gpus: Mapping[str, Gpus | None]
) -> tuple[list[str], dict[str, str]]:
    """The fallback types a job on `job_type` may restore on, and why each other one may not.

    A type with GPUs needs fallbacks with the same GPU model and count (the job's GPU state is in its checkpoint);
    a type EC2 does not know is dropped. A job on a type without GPUs may use any known type.
    """
    kept: list[str] = []
    dropped: dict[str, str] = {}
    if job_type not in gpus:
        return list(fallbacks), {}  # the job's own type is unknown: nothing to compare with
    wanted = gpus[job_type]
    for fallback in fallbacks:
        if fallback not in gpus:
            dropped[fallback] = "EC2 does not know this instance type"
        elif wanted is not None and gpus[fallback] != wanted:
            has = gpus[fallback] or "no GPU"
            dropped[fallback] = f"it has {has}; the job's {job_type} has {wanted}, which its checkpoint needs"
        else:
            kept.append(fallback)
    return kept, dropped
