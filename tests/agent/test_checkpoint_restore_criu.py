"""The agent's whole path with the real CRIU: run, checkpoint, lose the VM, restore elsewhere, same output."""

import os
import signal

import pytest
from spotcr_agent.runner import job_alive
from spotcr_agent.store import CheckpointStore, DirectoryBackend, StoreError

from .conftest import compute_command, kill_tree, make_agent, make_config, progress_lines, wait_for, wait_for_exit

pytestmark = [pytest.mark.criu, pytest.mark.usefixtures("criu_available")]


def _interrupt_and_restore(tmp_path, publisher, store, reference_output, kind, megabytes=200, steps=50):
    # Given a job running on the primary VM
    command = compute_command(megabytes, steps, 0.1)
    primary = make_agent(make_config(tmp_path, "primary", command=command), publisher, store)
    primary.ready()
    pid = primary.start_job()
    workdir = primary.config.workdir
    wait_for(lambda: len(progress_lines(workdir)) >= 5, what="progress")

    # When it is checkpointed, then its VM is lost (the old PID stays taken while the backup restores)
    outcome = primary.checkpoint(kind, 1)
    if kind == "periodic":
        assert job_alive(pid, primary.state.read().job_start_time)
        wait_for(lambda: len(progress_lines(workdir)) >= 8, what="progress after the periodic dump")
        os.kill(pid, signal.SIGSTOP)
    backup = make_agent(make_config(tmp_path, "backup", generation=2, mode="restore"), publisher, store)
    restored = backup.restore(2)

    # Then the job continues from the checkpoint in a fresh PID namespace and ends as an uninterrupted run
    assert restored.checkpoint_id == outcome.checkpoint_id
    assert restored.pid != pid
    kill_tree(pid)
    assert wait_for_exit(backup) == 0
    progress, stdout = reference_output(megabytes, steps)
    assert (workdir / "progress.log").read_text() == progress
    assert (workdir / ".spotcr" / "stdout.log").read_text() == stdout
    completed = publisher.of("CheckpointCompleted")
    assert [e.checkpoint_id for e in completed] == [outcome.checkpoint_id]
    assert completed[0].bytes_total > megabytes << 20
    assert [e.checkpoint_id for e in publisher.of("RestoreCompleted")] == [outcome.checkpoint_id]
    assert [e.exit_code for e in publisher.of("JobExited")] == [0]


def test_periodic_checkpoint_restores_on_a_directory_store(tmp_path, publisher, reference_output):
    (tmp_path / "store").mkdir()
    store = CheckpointStore.for_directory(tmp_path / "store", "job-1")
    _interrupt_and_restore(tmp_path, publisher, store, reference_output, "periodic")


def test_final_dump_restores_on_a_directory_store(tmp_path, publisher, reference_output):
    (tmp_path / "store").mkdir()
    store = CheckpointStore.for_directory(tmp_path / "store", "job-1")
    _interrupt_and_restore(tmp_path, publisher, store, reference_output, "final")


def test_periodic_checkpoint_restores_on_s3(tmp_path, publisher, reference_output, moto_s3):
    import boto3

    boto3.client("s3").create_bucket(Bucket="spotcr-test")
    store = CheckpointStore.for_s3("spotcr-test", "job-1")
    # moto ingests about 70 MiB/s: a smaller job, long enough to outlive the upload and show it ran on meanwhile
    _interrupt_and_restore(tmp_path, publisher, store, reference_output, "periodic", megabytes=64, steps=40)


class _StreamingBreaks(CheckpointStore):
    """A store whose upload breaks off while CRIU still writes the final dump (a network blip)."""

    def commit(self, image_dir, meta, extra_files=None, still_writing=None):
        if still_writing is not None:
            raise StoreError("connection reset while streaming the final dump")
        return super().commit(image_dir, meta, extra_files)


def test_a_final_dump_whose_streaming_breaks_is_shipped_from_scratch_and_restores(
    tmp_path, publisher, reference_output
):
    (tmp_path / "store").mkdir()
    store = _StreamingBreaks(DirectoryBackend(tmp_path / "store"), "job-1")
    _interrupt_and_restore(tmp_path, publisher, store, reference_output, "final", megabytes=64)
