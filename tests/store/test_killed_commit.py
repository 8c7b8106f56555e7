"""An agent killed mid-upload leaves chunks without a manifest: that checkpoint does not exist."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from spotcr_agent.store import CheckpointStore, S3Backend

from .support import JOB, RUN, MiB, checkpoint_id, meta, random_bytes, run_keys

pytestmark = pytest.mark.claim("Never a partial checkpoint")

REPO = Path(__file__).resolve().parents[2]

# A commit whose CRIU never finishes writing: it uploads chunks as they come and never writes a manifest.
COMMITTER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from spotcr_agent.store import CheckpointMeta, CheckpointStore

    kind, where, images = sys.argv[1:4]
    if kind == "s3":
        store = CheckpointStore.for_s3(where, "{job}", run_id="{run}")
    else:
        store = CheckpointStore.for_directory(Path(where), "{job}", run_id="{run}")
    store.pack_size = 1024 * 1024  # packs written as it goes, not one at the end
    meta = CheckpointMeta(job_id="{job}", checkpoint_id="{cid}", generation=1, kind="final")
    store.commit(Path(images), meta, still_writing=lambda: True)
    """
).format(job=JOB, run=RUN, cid=checkpoint_id(2, kind="final"))


def test_killed_commit_is_not_listed_and_previous_checkpoint_restores(store: CheckpointStore, tmp_path: Path) -> None:
    # Given a committed periodic checkpoint
    images = tmp_path / "img"
    images.mkdir()
    (images / "pages-1.img").write_bytes(random_bytes(2 * MiB, seed=30))
    store.commit(images, meta(1))
    chunks_before = {o.key for o in store.backend.scan(f"{run_keys(store)}chunks/")}

    # When the agent starts a final dump, uploads part of it, and is killed
    final_images = tmp_path / "final-img"
    final_images.mkdir()
    (final_images / "pages-1.img").write_bytes(random_bytes(12 * MiB, seed=31))
    where = store.backend.bucket if isinstance(store.backend, S3Backend) else str(store.backend.root)  # type: ignore[attr-defined]
    kind = "s3" if isinstance(store.backend, S3Backend) else "directory"
    env = os.environ | {"PYTHONPATH": f"{REPO}/functions:{REPO}/vm-bootstrap:{REPO}"}
    agent = subprocess.Popen([sys.executable, "-c", COMMITTER, kind, where, str(final_images)], env=env)
    try:
        deadline = time.monotonic() + 30
        while len({o.key for o in store.backend.scan(f"{run_keys(store)}chunks/")} - chunks_before) < 2:
            assert agent.poll() is None, "the committing agent exited on its own"
            assert time.monotonic() < deadline, "the committing agent uploaded nothing"
            time.sleep(0.05)
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.wait()

    # Then the half-uploaded checkpoint does not exist, and the previous one restores intact
    assert [m.checkpoint_id for m in store.checkpoints()] == [checkpoint_id(1)]
    store.fetch(checkpoint_id(1), tmp_path / "restore")
    assert (tmp_path / "restore/images/pages-1.img").read_bytes() == random_bytes(2 * MiB, seed=30)

    # And the orphaned chunks are collected once they and the dead commit are past the grace period (here: none),
    # the committed ones are not
    pruned = store.prune(keep=1, grace_seconds=0, commit_timeout_s=0)
    assert pruned.deleted_chunks >= 2
    assert {o.key for o in store.backend.scan(f"{run_keys(store)}chunks/")} == chunks_before
