"""Checkpoints and restores that cannot work say why, with the real CRIU: before the dump where it can be known,
else with CRIU's first real error and its log kept in the job's storage, shown by `spotcr-agent status`."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from spotcr_agent.checkpoint import CheckpointError
from spotcr_agent.restore import RestoreError
from spotcr_agent.store import CheckpointStore

from .conftest import JOBS, free_port, kill_tree, make_agent, make_config, progress_lines, wait_for

pytestmark = [pytest.mark.criu, pytest.mark.usefixtures("criu_available")]


@pytest.fixture
def mounted_store(tmp_path):
    """A real mount (a bind mount of a temp dir), as efs storage is on a VM."""
    store = tmp_path / "store"
    store.mkdir()
    subprocess.run(["mount", "--bind", str(store), str(store)], check=True)
    yield store
    subprocess.run(["umount", "-l", str(store)], check=True)


def test_a_job_holding_io_uring_is_refused_before_the_dump_naming_the_process_and_the_workaround(tmp_path, publisher):
    # Given a job that holds an io_uring instance, as Node.js with UV_USE_IO_URING=1
    agent = make_agent(make_config(tmp_path, command=(sys.executable, str(JOBS / "io_uring.py"), "300")), publisher)
    pid = agent.start_job()
    try:
        wait_for(lambda: progress_lines(agent.config.workdir), what="the job to set up its ring")

        # When a checkpoint is asked for
        with pytest.raises(CheckpointError) as failure:
            agent.checkpoint("periodic", 1)

        # Then it fails before freezing the job, naming the process, what it holds and the workaround
        message = str(failure.value)
        assert re.search(r"pid \d+ \(python[^)]*\), host pid \d+ holds anon_inode:\[io_uring\]", message), message
        assert "UV_USE_IO_URING=0" in message
        assert publisher.of("CheckpointFailed")[0].reason == message
        assert agent.store().checkpoint_ids() == []
        before = len(progress_lines(agent.config.workdir))
        wait_for(lambda: len(progress_lines(agent.config.workdir)) > before, what="the job to run on, never frozen")
    finally:
        kill_tree(pid)


def test_a_job_holding_a_socket_criu_cannot_dump_is_refused_before_the_dump(tmp_path, publisher):
    # Given a job holding a vsock socket, next to the unix and TCP sockets CRIU dumps in every other test
    agent = make_agent(make_config(tmp_path, command=(sys.executable, str(JOBS / "vsock.py"), "300")), publisher)
    pid = agent.start_job()
    try:
        wait_for(lambda: progress_lines(agent.config.workdir), what="the job to open its socket")
        # When a checkpoint is asked for, then it is refused, naming the process and the socket
        with pytest.raises(
            CheckpointError, match=r"pid \d+ \(python[^)]*\), host pid \d+ holds socket:\[\d+\], of a kind"
        ):
            agent.checkpoint("final", 1)
        assert agent.store().checkpoint_ids() == []
    finally:
        kill_tree(pid)


def test_a_failed_dump_reports_criu_s_first_real_error_and_keeps_its_log_in_storage(tmp_path, publisher, mounted_store):
    # Given a job holding a 3 MiB unlinked file, and an agent whose ghost limit is 1 MiB
    command = (sys.executable, str(JOBS / "holds.py"), "ghost", "3", "300")
    config = make_config(tmp_path, command=command, ghost_limit_mb=1, mount_point=mounted_store)
    agent = make_agent(config, publisher)
    pid = agent.start_job()
    try:
        wait_for(lambda: progress_lines(config.workdir), what="the job to hold its temp file")

        # When the dump fails
        with pytest.raises(CheckpointError, match="bigger than ghost_limit_mb in the agent config"):
            agent.checkpoint("periodic", 1)

        # Then the event carries the cause, CRIU's log tail (without the RLIMIT noise) and where the log was kept
        failed = publisher.of("CheckpointFailed")[0]
        assert "Can't dump ghost file" in failed.reason
        assert "Can't dump ghost file" in failed.log_tail
        assert "RLIMIT_NOFILE" not in failed.log_tail
        kept = Path(failed.criu_log)
        assert kept.is_relative_to(mounted_store) and "Dumping FAILED" in kept.read_text()

        # And `spotcr-agent status` shows it, from the job's storage
        config_path = tmp_path / "agent.json"
        config.write(config_path)
        environ = {**os.environ, "SPOTCR_AGENT_CONFIG": str(config_path)}
        out = subprocess.run(
            [sys.executable, "-m", "spotcr_agent", "status", "--job", "job-1"],
            env={**environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        logs = json.loads(out)["criu_logs"]
        assert logs[0]["log"] == failed.criu_log
        assert logs[0]["error"].startswith("an unlinked file the job holds is bigger than ghost_limit_mb")
    finally:
        kill_tree(pid)


def test_a_failed_restore_carries_criu_s_log_tail_and_keeps_the_log(tmp_path, publisher):
    # Given the final dump of a job listening on a loopback port
    port = free_port()
    (tmp_path / "store").mkdir()
    store = CheckpointStore.for_directory(tmp_path / "store", "job-1")
    config = make_config(tmp_path, "primary", command=(sys.executable, str(JOBS / "listener.py"), str(port)))
    primary = make_agent(config, publisher, store)
    pid = primary.start_job()
    wait_for(lambda: len(progress_lines(config.workdir)) >= 2, what="the job to listen")
    primary.checkpoint("final", 1)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), what="the job to stop")

    # When the backup restores while something else holds the port
    backup = make_agent(make_config(tmp_path, "backup", generation=2, mode="restore"), publisher, store)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(RestoreError, match="a port the job listens on is already taken here"):
            backup.restore(2)

    # Then RestoreFailed carries CRIU's log tail and where its whole log was kept
    failed = publisher.of("RestoreFailed")[0]
    assert "Address already in use" in failed.log_tail
    assert Path(failed.criu_log).is_relative_to(tmp_path / "store")
    assert "Restoring FAILED" in Path(failed.criu_log).read_text()


def test_a_restore_on_a_different_image_names_the_file_that_differs(tmp_path, publisher):
    # Given a job holding a read-only file of the image (as a library or a model), final-dumped
    image = tmp_path / "image"
    image.mkdir()
    model = image / "model.bin"
    model.write_bytes(b"weights v1" * 1000)
    (tmp_path / "store").mkdir()
    store = CheckpointStore.for_directory(tmp_path / "store", "job-1")
    command = (sys.executable, str(JOBS / "holds.py"), "read", str(model), "40")
    config = make_config(tmp_path, "primary", command=command, image_dirs=(str(image),))
    primary = make_agent(config, publisher, store)
    pid = primary.start_job()
    wait_for(lambda: len(progress_lines(config.workdir)) >= 2, what="the job to open its file")
    primary.checkpoint("final", 1)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), what="the job to stop")

    # When the backup's image has another version of that file, of the same size
    model.write_bytes(b"weights v2" * 1000)
    backup = make_agent(make_config(tmp_path, "backup", generation=2, mode="restore"), publisher, store)
    with pytest.raises(RestoreError, match=rf"image differs .*{re.escape(str(model))} has other contents here"):
        backup.restore(2)

    # Then with the same file the same checkpoint restores
    model.write_bytes(b"weights v1" * 1000)
    restored = backup.restore(2)
    kill_tree(restored.pid)


def test_a_failure_while_the_job_is_frozen_fails_the_dump_and_the_job_runs_on(tmp_path, publisher, monkeypatch):
    # Given a running job, and copying its VM-local files at the freeze breaks (a full scratch disk)
    def full_disk(entries, dest):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("spotcr_agent.carry.copy_files", full_disk)
    command = (sys.executable, str(JOBS / "holds.py"), "ghost", "1", "300")
    agent = make_agent(make_config(tmp_path, command=command), publisher)
    pid = agent.start_job()
    try:
        wait_for(lambda: progress_lines(agent.config.workdir), what="the job to start")

        # When a periodic checkpoint is taken
        with pytest.raises(CheckpointError, match=r"recording the job.s files at the freeze failed: .*No space left"):
            agent.checkpoint("periodic", 1)

        # Then nothing is committed, and CRIU let the job run on
        assert agent.store().checkpoint_ids() == []
        before = len(progress_lines(agent.config.workdir))
        wait_for(lambda: len(progress_lines(agent.config.workdir)) > before, what="the job to run on")
    finally:
        kill_tree(pid)


def test_a_job_holding_a_file_in_the_agent_s_own_directories_is_refused_before_the_dump(tmp_path, publisher):
    # Given a job that holds a file in the agent's scratch dir, which no checkpoint carries
    config = make_config(tmp_path)
    held = config.scratch_dir / "not-the-job-s.bin"
    held.parent.mkdir(parents=True)
    held.write_bytes(b"x")
    command = (sys.executable, str(JOBS / "holds.py"), "read", str(held), "300")
    agent = make_agent(make_config(tmp_path, command=command), publisher)
    pid = agent.start_job()
    try:
        wait_for(lambda: progress_lines(agent.config.workdir), what="the job to open the file")
        # When its final dump is asked for, then it is refused before CRIU stops the job
        with pytest.raises(CheckpointError, match=f"it holds {held}, inside the agent's own directories"):
            agent.checkpoint("final", 1)
        before = len(progress_lines(agent.config.workdir))
        wait_for(lambda: len(progress_lines(agent.config.workdir)) > before, what="the job to run on")
    finally:
        kill_tree(pid)
