"""Old runs are pruned: the VM that starts a new run of a job name deletes the earlier runs' checkpoints."""

from __future__ import annotations

import sys

import pytest
from spotcr_agent.store import CheckpointStore

from tests.store.support import meta

from .conftest import FakePublisher, kill_tree, make_agent, make_config

pytestmark = pytest.mark.claim("Old runs are pruned, never under a commit")

EARLIER = "r-00000000000000e1"


def test_a_new_run_deletes_the_earlier_runs_checkpoints_and_keeps_their_results(tmp_path):
    # Given an earlier run of job-1 with a checkpoint and a stored result in the job's store
    config = make_config(tmp_path, command=(sys.executable, "-c", "import time; time.sleep(60)"))
    config.mount_point.mkdir(parents=True)
    earlier = CheckpointStore.for_directory(config.mount_point, config.job_id, run_id=EARLIER)
    images = tmp_path / "images"
    images.mkdir()
    (images / "pages-1.img").write_bytes(b"\x01" * 4096)
    earlier.commit(images, meta(1, job=config.job_id))
    earlier.backend.put(f"jobs/{config.job_id}/runs/{EARLIER}/result/manifest.json", b"{}")
    agent = make_agent(config, FakePublisher())

    # When the new run's VM has not started the job, nothing is deleted; once it has, the earlier run goes
    assert agent.delete_earlier_runs() == []
    assert earlier.checkpoint_ids() != []
    pid = agent.start_job()
    try:
        assert agent.delete_earlier_runs() == [EARLIER]
    finally:
        kill_tree(pid)

    # Then the earlier run keeps only its result
    left = [o.key for o in earlier.backend.scan(f"jobs/{config.job_id}/runs/{EARLIER}/")]
    assert left == [f"jobs/{config.job_id}/runs/{EARLIER}/result/manifest.json"]
