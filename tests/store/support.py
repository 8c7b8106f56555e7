"""Helpers for the store tests: checkpoint ids, metadata and deterministic content."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotcr_agent.store import CheckpointMeta, CheckpointStore, ChunkRef
from spotcr_agent.store.store import run_prefix

JOB = "job-store-test"
RUN = "r-00000000000000a1"  # the run a store is for unless a test names another
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


def images(root: Path, *seeds: int) -> Path:
    """An image dir holding one MiB of seeded content per seed (pages-<seed>.img), emptied first."""
    root.mkdir(parents=True, exist_ok=True)
    for path in root.iterdir():
        path.unlink()
    for seed in seeds:
        (root / f"pages-{seed}.img").write_bytes(random_bytes(MiB, seed=seed))
    return root


def commit_during_delete(
    deleting: CheckpointStore,
    committing: CheckpointStore,
    commit: Callable[[], Any],
    deleted: str,
    act: Callable[[], Any],
) -> None:
    """Run `act` (a prune, a run's deletion) on `deleting`; its first delete of keys holding `deleted` starts `commit`
    on `committing` in a thread first, and goes on only once that commit holds back (its store sleeps while a
    delete is in flight) or has ended: the interleaving forced, not slept for. The commit must raise nothing."""
    commit_waits_or_ends, commit_done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def sleep(seconds: float) -> None:
        commit_waits_or_ends.set()
        threading.Event().wait(0.01)

    committing.sleep = sleep

    def run_commit() -> None:
        try:
            commit()
        except BaseException as error:
            errors.append(error)
        finally:
            commit_done.set()
            commit_waits_or_ends.set()

    racing = threading.Thread(target=run_commit)
    original_delete = deleting.backend.delete

    def delete(keys: list[str]) -> Any:
        if any(deleted in key for key in keys) and not racing.is_alive() and not commit_done.is_set():
            racing.start()
            assert commit_waits_or_ends.wait(60), "the racing commit neither finished nor waited"
        return original_delete(keys)

    deleting.backend.delete = delete  # type: ignore[method-assign]
    act()
    assert commit_done.wait(60)
    racing.join()
    assert errors == []


def pack_key(store: CheckpointStore, chunk: ChunkRef) -> str:
    """The pack object holding a stored chunk (its bytes are at chunk.offset, chunk.stored of them)."""
    assert chunk.pack is not None, f"chunk {chunk.hash} is not in a pack"
    return f"{run_keys(store)}chunks/packs/{chunk.pack}"


def damage_chunk(store: CheckpointStore, chunk: ChunkRef, how: str = "bit-flip") -> None:
    """Damage one chunk where the store keeps it: flip a bit in it, cut its pack short inside it, or delete it."""
    key = pack_key(store, chunk)
    pack = bytearray(store.backend.get(key))
    middle = chunk.offset + chunk.stored // 2
    if how == "bit-flip":
        pack[middle] ^= 0x10
        store.backend.put(key, bytes(pack))
    elif how == "truncate":
        store.backend.put(key, bytes(pack[:middle]))
    else:
        store.backend.delete([key])


def run_keys(store: CheckpointStore) -> str:
    """Where the store keeps its run's objects (the prefix of every key it writes)."""
    return run_prefix(store.job_id, store.run_id)
