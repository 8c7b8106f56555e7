"""Old runs are pruned: an ended run's checkpoints are deleted whole, its result kept, never under a late commit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from spotcr_agent.store import CheckpointStore
from spotcr_agent.store.store import other_runs

from .support import MiB, checkpoint_id, commit_during_delete, images, meta, random_bytes

pytestmark = pytest.mark.claim("Old runs are pruned, never under a commit")

EARLIER, LATER = "r-00000000000000e1", "r-00000000000000e2"


def test_an_ended_runs_checkpoints_are_deleted_and_its_result_and_the_new_run_kept(
    make_store: Callable[..., CheckpointStore], tmp_path: Path
) -> None:
    # Given an earlier run with two checkpoints and a stored result, and a new run with one checkpoint
    earlier, later = make_store(run_id=EARLIER), make_store(run_id=LATER)
    earlier.commit(images(tmp_path / "a", 1, 2), meta(1))
    earlier.commit(images(tmp_path / "b", 1, 3), meta(2, parent=1))
    earlier.backend.put(f"jobs/{earlier.job_id}/runs/{EARLIER}/result/manifest.json", b"{}")
    later.commit(images(tmp_path / "c", 4), meta(3))

    # When the new run deletes the other runs
    assert other_runs(later.backend, later.job_id, LATER) == [EARLIER]
    done = earlier.delete_run()

    # Then the earlier run keeps only its result, and the new run is whole
    assert done.deleted_checkpoints == [checkpoint_id(2), checkpoint_id(1)] and done.deleted_chunks > 0
    left = [
        o.key.removeprefix(f"jobs/{earlier.job_id}/runs/{EARLIER}/")
        for o in earlier.backend.scan(f"jobs/{earlier.job_id}/")
    ]
    assert [k for k in left if not k.startswith("jobs/")] == ["result/manifest.json"]
    assert later.checkpoint_ids() == [checkpoint_id(3)]
    later.fetch(checkpoint_id(3), tmp_path / "restore")


def test_a_late_commit_of_the_ended_run_is_never_left_with_a_missing_chunk(
    make_store: Callable[..., CheckpointStore], tmp_path: Path
) -> None:
    # Given an ended run with a checkpoint, whose zombie VM commits one more (parent 1: it would dedup against it)
    deleter, zombie = make_store(run_id=EARLIER), make_store(run_id=EARLIER)
    deleter.commit(images(tmp_path / "a", 1, 2), meta(1))

    # When the zombie's commit starts right after the delete's last look, while it deletes
    commit_during_delete(
        deleter,
        zombie,
        lambda: zombie.commit(images(tmp_path / "b", 1, 2), meta(2, parent=1)),
        "/checkpoints/",
        deleter.delete_run,
    )

    # Then what the late commit left is a whole checkpoint: it re-sent the chunks the delete removed
    assert deleter.checkpoint_ids() == [checkpoint_id(2)]
    deleter.fetch(checkpoint_id(2), tmp_path / "restore")
    assert (tmp_path / "restore/images/pages-2.img").read_bytes() == random_bytes(MiB, seed=2)


def test_nothing_is_deleted_while_a_commit_of_the_run_is_in_flight(
    make_store: Callable[..., CheckpointStore], tmp_path: Path
) -> None:
    # Given an ended run with a checkpoint and a commit of it in flight (its marker written, not yet done)
    store = make_store(run_id=EARLIER)
    store.commit(images(tmp_path / "a", 1), meta(1))
    store.backend.put(f"jobs/{store.job_id}/runs/{EARLIER}/commits/{checkpoint_id(2)}", b"")

    # When its checkpoints are deleted, then nothing goes: the next new run tries again
    done = store.delete_run()
    assert (done.kept, done.deleted_checkpoints) == ([checkpoint_id(1)], [])
    store.fetch(checkpoint_id(1), tmp_path / "restore")
