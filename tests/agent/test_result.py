"""A finished job's work dir is committed as its result, whole, before the agent reports JobExited."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from spotcr_agent import result, storage
from spotcr_agent.agent import base_job_env
from spotcr_agent.checkpoint import CheckpointError
from spotcr_agent.runner import process_start_time, start_job
from spotcr_agent.store.backends import DirectoryBackend, ObjectNotFound, S3Backend
from spotcr_agent.store.errors import StoreUnavailable
from spotcr_contracts import layout

from tests.support import wait_for

from .conftest import FakePublisher, make_agent, make_config

WRITE_RESULT = "import pathlib; pathlib.Path('out').mkdir(); pathlib.Path('out/result.txt').write_text('42\\n')"


class ReadingPublisher(FakePublisher):
    """Reads the committed result at the moment JobExited is published: what the control plane could see."""

    def __init__(self, backend):
        super().__init__()
        self.backend = backend
        self.seen_at_exit = None

    def publish(self, event):
        if event.DETAIL_TYPE == "JobExited":
            self.seen_at_exit = result.fetch_result_file(self.backend, event.job_id, "out/result.txt", event.run_id)
        return super().publish(event)


def _ended(tmp_path, publisher, code=0, result_files=(), **overrides):
    command = (sys.executable, "-c", f"{WRITE_RESULT}; raise SystemExit({code})")
    config = make_config(tmp_path, command=command, result_files=result_files)
    agent = make_agent(config, publisher)
    for name, value in overrides.items():
        setattr(agent, name, value)
    agent.ready()
    pid = agent.start_job()
    start_time = agent.state.read().job_start_time
    wait_for(lambda: process_start_time(pid) != start_time, what="the job to end")
    return agent


@pytest.mark.parametrize("code", [0, 3])
def test_the_result_is_committed_before_job_exited(tmp_path, code):
    # Given a job that writes out/result.txt and exits (with any code)
    backend = DirectoryBackend(tmp_path / "store")
    publisher = ReadingPublisher(backend)
    agent = _ended(tmp_path, publisher, code)

    # When the agent notices the end
    assert agent.watch_job() == code

    # Then the result was readable in the store when JobExited went out, and the event says where it is
    assert publisher.seen_at_exit == b"42\n"
    [exited] = publisher.of("JobExited")
    assert (exited.exit_code, exited.result_error) == (code, "")
    assert exited.result == str(
        tmp_path / "store" / "jobs" / "job-1" / "runs" / exited.run_id / "result" / "manifest.json"
    )
    manifest = result.read_manifest(backend, "job-1", exited.run_id)
    assert manifest.exit_code == code
    assert manifest.files["out/result.txt"]["size"] == 3

    # And a later dump order re-sends the same end with the same result, committing nothing again
    with pytest.raises(CheckpointError):
        agent.checkpoint("periodic", 1)
    assert [e.result for e in publisher.of("JobExited")] == [exited.result, exited.result]
    assert result.read_manifest(backend, "job-1", exited.run_id).attempt == manifest.attempt


def test_a_job_that_ends_without_its_declared_result_is_reported_and_nothing_is_stored(tmp_path, publisher):
    # Given a job that declares out/result.txt and model.bin (spotcr:result) but leaves only out/result.txt
    agent = _ended(tmp_path, publisher, 0, result_files=("out/result.txt", "model.bin"))

    # When the agent notices its end (exit code 0)
    agent.watch_job()

    # Then JobExited names the missing file, and no result is stored as if the job had succeeded
    [exited] = publisher.of("JobExited")
    assert (exited.exit_code, exited.result, exited.result_missing) == (0, "", "model.bin")
    assert "missing model.bin" in exited.result_error
    with pytest.raises(ObjectNotFound, match=r"manifest\.json"):
        result.read_manifest(DirectoryBackend(tmp_path / "store"), "job-1", exited.run_id)
    # And the status the control plane ends the job from says the same
    status = agent.status()
    assert (status.result, status.result_missing) == ("", "model.bin")


def test_a_job_that_leaves_its_declared_result_is_stored(tmp_path, publisher):
    agent = _ended(tmp_path, publisher, 0, result_files=("./out/result.txt",))

    agent.watch_job()

    [exited] = publisher.of("JobExited")
    assert (exited.result_missing, exited.result_error) == ("", "")
    assert result.fetch_result_file(DirectoryBackend(tmp_path / "store"), "job-1", "out/result.txt", exited.run_id)


class RestoredDuringCommit(DirectoryBackend):
    """Before the commit's first file lands, the job is restored here (recorded as Restorer.restore records it) and
    runs again: the interleaving of a node whose share MPI ended when another node went."""

    def __init__(self, root: Path, agent) -> None:
        super().__init__(root)
        self.agent, self.restored = agent, False

    def put(self, key: str, data: bytes | memoryview) -> None:
        if not self.restored:
            command = (sys.executable, "-c", "import time; time.sleep(0.5)")  # then it ends well
            job = start_job(command, self.agent.config.workdir, base_job_env(os.environ))
            self.restored = True
            with self.agent.state.locked() as state:
                state.job_pid, state.job_start_time = job.pid, job.start_time
                state.job_status, state.exit_code = "running", None
                state.result, state.result_error, state.result_missing = "", "", ""
        super().put(key, data)


@pytest.mark.claim("The result equals an uninterrupted run's")
def test_an_end_whose_job_was_restored_during_its_commit_is_not_the_jobs_end(tmp_path, publisher):
    # Given a share that failed (code 255), and a restore that brings the job back while that end's result is stored
    backend = RestoredDuringCommit(tmp_path / "store", None)
    agent = _ended(tmp_path, publisher, 255, result_backend=lambda config, job_storage: backend)
    backend.agent = agent

    # When the agent notices the failed share's end
    assert agent.watch_job() is None

    # Then that end is neither reported nor kept: the restored job runs, with no result
    assert publisher.of("JobExited") == []
    status = agent.status()
    assert (status.job_status, status.exit_code, status.result) == ("running", None, "")
    # And the restored job's own end is stored and reported as the job's
    wait_for(lambda: agent.watch_job() is not None, what="the restored job to end")
    assert agent.state.read().exit_code == 0
    [exited] = publisher.of("JobExited")
    assert exited.exit_code == 0
    assert result.read_manifest(backend, "job-1", exited.run_id).exit_code == 0


class BrokenBackend(DirectoryBackend):
    """The store refuses writes after `allowed` puts (credentials gone, bucket policy, disk full)."""

    def __init__(self, root: Path, allowed: int) -> None:
        super().__init__(root)
        self.allowed = allowed

    def put(self, key: str, data: bytes | memoryview) -> None:
        if self.allowed <= 0:
            raise StoreUnavailable(f"access denied writing {key}")
        self.allowed -= 1
        super().put(key, data)


def test_a_failed_upload_is_reported_and_never_presented_as_a_result(tmp_path, publisher):
    # Given a store that takes the first file of the result and then refuses every write
    broken = BrokenBackend(tmp_path / "store", allowed=1)
    agent = _ended(tmp_path, publisher, 0, result_backend=lambda config, job_storage: broken)

    # When the agent notices the end
    agent.watch_job()

    # Then JobExited says the result is not stored, and why; no manifest makes the partial upload look complete
    [exited] = publisher.of("JobExited")
    assert exited.result == ""
    assert "access denied" in exited.result_error
    with pytest.raises(ObjectNotFound, match=r"manifest\.json"):
        result.read_manifest(broken, "job-1")
    # And a dump order re-sends the same failure (the control plane then keeps the VM with its work dir)
    with pytest.raises(CheckpointError):
        agent.checkpoint("periodic", 1)
    assert [e.result_error for e in publisher.of("JobExited")] == [exited.result_error] * 2


def test_a_commit_cut_short_is_cleared_by_the_next_one_and_a_damaged_file_is_refused(tmp_path):
    # Given a work dir and a commit that died after its first file
    workdir = tmp_path / "work"
    (workdir / "sub").mkdir(parents=True)
    (workdir / "a.txt").write_text("a")
    (workdir / "sub" / "b.bin").write_bytes(b"\x00" * 1000)
    broken = BrokenBackend(tmp_path / "store", allowed=1)
    with pytest.raises(StoreUnavailable):
        result.commit_result(broken, "job-1", workdir, 0, 1, clock=lambda: 1.0)

    # When the commit runs again
    backend = DirectoryBackend(tmp_path / "store")
    location = result.commit_result(backend, "job-1", workdir, 0, 1, clock=lambda: 2.0)

    # Then only its own files and manifest are left, and each file reads back as committed
    prefix = layout.result_prefix("job-1")
    assert sorted(obj.key for obj in backend.scan(prefix)) == [
        f"{prefix}0000000002000-g1/a.txt",
        f"{prefix}0000000002000-g1/sub/b.bin",
        f"{prefix}manifest.json",
    ]
    assert location.endswith("jobs/job-1/result/manifest.json")
    assert result.fetch_result_file(backend, "job-1", "sub/b.bin") == b"\x00" * 1000
    # And a file changed after the commit is refused, never returned as the result
    (tmp_path / "store" / prefix / "0000000002000-g1" / "a.txt").write_text("b")
    with pytest.raises(result.ResultError, match=r"a\.txt does not match"):
        result.fetch_result_file(backend, "job-1", "a.txt")
    with pytest.raises(result.ResultError, match=r"has no missing\.txt"):
        result.fetch_result_file(backend, "job-1", "missing.txt")


def test_an_ebs_jobs_result_goes_to_the_checkpoint_bucket_which_outlives_its_volume(tmp_path):
    job_storage = DirectoryBackend(tmp_path / "store")
    ebs = make_config(tmp_path, storage="ebs", bucket="spotcr-checkpoints")
    backend = storage.result_backend(ebs, job_storage)
    assert isinstance(backend, S3Backend)
    assert backend.bucket == "spotcr-checkpoints"
    # Without a bucket (an agent run by hand) the job's own storage takes it
    assert storage.result_backend(make_config(tmp_path, storage="ebs"), job_storage) is job_storage


@pytest.mark.claim("One identity per run")
def test_each_run_of_a_job_name_keeps_its_own_result(tmp_path):
    # Given a run of job-1 whose result is stored
    backend = DirectoryBackend(tmp_path / "store")
    (tmp_path / "first").mkdir()
    (tmp_path / "first" / "out.txt").write_text("first run")
    first = result.commit_result(backend, "job-1", tmp_path / "first", 0, 0, run_id="r-00000000000000e1")

    # When the name is reused for a new run that stores its own
    (tmp_path / "second").mkdir()
    (tmp_path / "second" / "out.txt").write_text("second run")
    second = result.commit_result(backend, "job-1", tmp_path / "second", 0, 0, run_id="r-00000000000000e2")

    # Then each run's result is under its run, next to its checkpoints, and the earlier one is intact
    assert first.endswith("jobs/job-1/runs/r-00000000000000e1/result/manifest.json")
    assert second.endswith("jobs/job-1/runs/r-00000000000000e2/result/manifest.json")
    assert result.fetch_result_file(backend, "job-1", "out.txt", "r-00000000000000e1") == b"first run"
    assert result.fetch_result_file(backend, "job-1", "out.txt", "r-00000000000000e2") == b"second run"
    assert all(layout.is_result_key("job-1", o.key) for o in backend.scan("jobs/job-1/"))
