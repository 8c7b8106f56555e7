"""Helpers for the store tests: checkpoint ids, metadata and deterministic content."""

from __future__ import annotations

import random
from pathlib import Path

from spotcr_agent.store import CheckpointMeta

JOB = "job-store-test"
MiB = 1024 * 1024


def checkpoint_id(n: int, generation: int = 1, kind: str = "periodic") -> str:
    return f"{1_700_000_000_000 + n:013d}-g{generation}-{kind}"


def meta(n: int, parent: int | None = None, kind: str = "periodic", job: str = JOB) -> CheckpointMeta:
    return CheckpointMeta(
        job_id=job,
        checkpoint_id=checkpoint_id(n, kind=kind),
        generation=1,
        kind=kind,
        parent=checkpoint_id(parent) if parent is not None else None,
        criu_version="4.1.1",
        kernel="6.18.0",
        arch="x86_64",
        cpu_flags=["sse4_2", "avx2"],
        open_files=[{"path": "/work/out.log", "size": 12}],
    )


def random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
