"""Garbage collection against a concurrent commit, the interleaving forced: no committed checkpoint loses a chunk."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from spotcr_agent.store import CheckpointStore, CorruptCheckpoint

from tests.store.support import damage_chunk, pack_key, run_keys

from .support import MiB, checkpoint_id, commit_during_delete, images, meta, random_bytes

pytestmark = pytest.mark.claim("Garbage collection never loses a committed checkpoint")


def test_prune_never_deletes_a_chunk_a_concurrent_commit_relies_on(
    make_store: Callable[..., CheckpointStore], tmp_path: Path
) -> None:
    # Given checkpoint 1 with file X, and checkpoint 2 with A only: X's pack is garbage once 1 goes
    pruner, committer = make_store(), make_store()  # two VMs on one store
    pruner.commit(images(tmp_path / "img1", 2), meta(1))
    pruner.commit(images(tmp_path / "img2", 1), meta(2, parent=1))
    x_chunks = pruner.load(checkpoint_id(1)).chunk_hashes()
    assert x_chunks and not x_chunks & pruner.load(checkpoint_id(2)).chunk_hashes()

    # When prune has listed X's pack as garbage and is about to delete it, a commit of A and X (parent 2,
    # which lacks X) runs: it sends X again and commits; only then does prune go on
    commit_during_delete(
        pruner,
        committer,
        lambda: committer.commit(images(tmp_path / "img3", 1, 2), meta(3, parent=2)),
        "/chunks/",
        lambda: pruner.prune(keep=1, grace_seconds=0),
    )

    # Then every committed checkpoint restores: X's chunks are in the store again, in a pack of their own
    assert checkpoint_id(3) in pruner.checkpoint_ids()
    manifest = pruner.fetch(checkpoint_id(3), tmp_path / "restore")
    assert manifest.chunk_hashes() >= x_chunks
    assert (tmp_path / "restore/images/pages-2.img").read_bytes() == random_bytes(MiB, seed=2)


def test_a_commit_resends_a_parent_chunk_the_store_lost(store: CheckpointStore, tmp_path: Path) -> None:
    # Given a checkpoint whose pack was lost from the store (deleted by hand, an old bug, expiry)
    store.commit(images(tmp_path / "img1", 1, 2), meta(1))
    lost = sorted(store.load(checkpoint_id(1)).stored_chunks().values(), key=lambda c: c.hash)[0]
    store.backend.delete([pack_key(store, lost)])

    # When the next checkpoint, with the same content, is committed with it as parent
    result = store.commit(images(tmp_path / "img2", 1, 2), meta(2, parent=1))

    # Then the lost chunks were sent again, and the new checkpoint restores
    assert result.chunks_uploaded == result.chunks_total
    store.fetch(checkpoint_id(2), tmp_path / "restore")
    assert (tmp_path / "restore/images/pages-1.img").read_bytes() == random_bytes(MiB, seed=1)


def test_a_prune_sees_a_commit_in_flight_and_deletes_nothing(store: CheckpointStore, tmp_path: Path) -> None:
    # Given garbage, and a commit that has announced itself but not yet written its manifest
    store.commit(images(tmp_path / "img1", 2), meta(1))
    store.commit(images(tmp_path / "img2", 1), meta(2, parent=1))
    store.backend.put(f"{run_keys(store)}commits/{checkpoint_id(3)}", b"")

    # When prune runs
    pruned = store.prune(keep=1, grace_seconds=0)

    # Then it deletes nothing; once that commit is presumed dead, it does
    assert (pruned.deleted_checkpoints, pruned.deleted_chunks) == ([], 0)
    later = store.prune(keep=1, grace_seconds=0, commit_timeout_s=0)
    assert later.deleted_checkpoints == [checkpoint_id(1)] and later.deleted_chunks > 0


def test_a_fresh_full_checkpoint_heals_a_damaged_chunk_every_checkpoint_shares(
    store: CheckpointStore, tmp_path: Path
) -> None:
    # Given three periodic checkpoints of the same content (one full, then two that reuse its chunks)
    store.full_every = 3
    for n in (1, 2, 3):
        result = store.commit(images(tmp_path / f"img{n}", 1, 2), meta(n, parent=n - 1 if n > 1 else None))
    assert [store.load(checkpoint_id(n)).since_full for n in (1, 2, 3)] == [0, 1, 2]
    assert result.chunks_uploaded == 0

    # When a chunk all three share is damaged in the store (bit rot, a bad write)
    shared = sorted(store.load(checkpoint_id(1)).stored_chunks().values(), key=lambda c: c.hash)[0]
    damage_chunk(store, shared)
    with pytest.raises(CorruptCheckpoint):
        store.fetch(checkpoint_id(3), tmp_path / "broken")

    # Then the next periodic checkpoint is a fresh full one: it sends every chunk again into packs of its own, so
    # the damage reaches no checkpoint from it on (the older ones keep the damaged pack: a restore stops at it)
    fourth = store.commit(images(tmp_path / "img4", 1, 2), meta(4, parent=3))
    assert store.load(checkpoint_id(4)).since_full == 0
    assert fourth.chunks_uploaded == fourth.chunks_total
    assert not set(store.load(checkpoint_id(4)).packs()) & set(store.load(checkpoint_id(3)).packs())
    store.fetch(checkpoint_id(4), tmp_path / "restore4")
    assert (tmp_path / "restore4/images/pages-1.img").read_bytes() == random_bytes(MiB, seed=1)


def test_a_final_dump_always_deduplicates(store: CheckpointStore, tmp_path: Path) -> None:
    store.full_every = 1
    store.commit(images(tmp_path / "img1", 1), meta(1))
    final = store.commit(images(tmp_path / "img2", 1), meta(2, parent=1, kind="final"))
    assert final.chunks_uploaded == 0


def test_a_dead_pruners_marker_does_not_hold_commits_back(tmp_path: Path) -> None:
    # Given a store where a pruner died (its VM terminated) long ago, leaving its sweep marker
    store = CheckpointStore.for_directory(tmp_path / "mnt", "job-store-test")
    (tmp_path / "mnt").mkdir()
    marker = tmp_path / "mnt/jobs/job-store-test/sweeps/dead"
    marker.parent.mkdir(parents=True)
    marker.write_bytes(b"")
    os.utime(marker, (time.time() - 3600, time.time() - 3600))
    waits: list[float] = []
    store.sleep = waits.append

    # When a checkpoint is committed
    store.commit(images(tmp_path / "img", 1), meta(1))

    # Then the commit did not wait, and the dead marker is gone
    assert waits == []
    assert not marker.exists()
