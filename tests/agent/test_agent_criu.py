"""Agent behaviour with the real CRIU: clear errors, one final dump for two triggers, fallback, sockets."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from spotcr_agent import daemon
from spotcr_agent.checkpoint import CheckpointError
from spotcr_agent.runner import checkpointable_problem
from spotcr_agent.store import CheckpointStore

from .conftest import (
    JOBS,
    FakeMetadata,
    compute_command,
    free_port,
    kill_tree,
    make_agent,
    make_config,
    progress_lines,
    wait_for,
    wait_for_exit,
)

pytestmark = [pytest.mark.criu, pytest.mark.usefixtures("criu_available")]


def test_a_job_that_exits_at_once_is_reported_and_cannot_be_checkpointed(tmp_path, publisher):
    # Given a job that fails immediately
    agent = make_agent(make_config(tmp_path, command=("sh", "-c", "echo no input file >&2; exit 4")), publisher)
    agent.start_job()
    # When the agent watches it, then it reports the exit code and keeps the job's stderr
    assert wait_for_exit(agent) == 4
    assert [e.exit_code for e in publisher.of("JobExited")] == [4]
    assert "no input file" in (agent.config.workdir / ".spotcr" / "stderr.log").read_text()
    # And a checkpoint says why there is nothing to dump, and reports the exit again (not a failed dump)
    with pytest.raises(CheckpointError, match="the job is not running: it exited with code 4"):
        agent.checkpoint("periodic", 1)
    assert [e.exit_code for e in publisher.of("JobExited")] == [4, 4]
    assert publisher.of("CheckpointFailed") == []


def test_a_command_that_does_not_exist_is_refused_before_starting(tmp_path, publisher):
    agent = make_agent(make_config(tmp_path, command=("no-such-program", "--x")), publisher)
    assert agent.start_job() is None
    [failed] = publisher.of("BootstrapFailed")
    assert "'no-such-program' is not an executable file" in failed.reason
    assert publisher.of("JobStarted") == []


def test_a_job_with_a_terminal_is_refused_with_the_reason(tmp_path, publisher):
    agent = make_agent(make_config(tmp_path, command=(sys.executable, str(JOBS / "terminal.py"))), publisher)
    pid = agent.start_job()
    try:
        ready = agent.config.workdir / "ready"
        wait_for(ready.exists, what="the job to take a terminal")
        with pytest.raises(CheckpointError, match="job has a controlling terminal"):
            agent.checkpoint("final", 1)
        assert "controlling terminal" in publisher.of("CheckpointFailed")[0].reason
    finally:
        kill_tree(pid)


def test_a_process_outside_its_own_session_is_named():
    process = subprocess.Popen(["sleep", "30"])
    try:
        assert "root process is not a session leader" in (checkpointable_problem(process.pid) or "")
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def mounted_store(tmp_path):
    """A real mount (a bind mount of a temp dir), as efs/ebs storage is on a VM."""
    store = tmp_path / "store"
    store.mkdir()
    subprocess.run(["mount", "--bind", str(store), str(store)], check=True)
    yield store
    subprocess.run(["umount", "-l", str(store)], check=True)


# The IMDS poll asks at the generation the VM serves (1); the warning's SSM command at the same or the bumped one.
@pytest.mark.parametrize("ssm_generation", [1, 2])
def test_two_triggers_for_one_interruption_take_one_final_dump(tmp_path, publisher, mounted_store, ssm_generation):
    # Given a running job whose agent config is on disk, as on a VM
    config = make_config(tmp_path, mount_point=mounted_store, command=compute_command(64, 40, 0.1))
    config_path = tmp_path / "agent.json"
    config.write(config_path)
    agent = make_agent(config, publisher)
    agent.start_job()
    wait_for(lambda: len(progress_lines(config.workdir)) >= 3, what="progress")

    # When the SSM command (a separate process) and the IMDS poll both trigger the final dump
    root = Path(__file__).parents[2]
    pythonpath = os.pathsep.join(str(root / p) for p in ("functions", "vm-bootstrap", "."))
    environ = {**os.environ, "SPOTCR_AGENT_CONFIG": str(config_path), "PYTHONPATH": pythonpath}
    argv = ["checkpoint", "--job", "job-1", "--generation", str(ssm_generation), "--kind", "final"]
    ssm = subprocess.Popen(
        [sys.executable, "-m", "spotcr_agent", *argv],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    notice = FakeMetadata({"meta-data/spot/instance-action": '{"action":"terminate","time":"2026-11-21T20:40:00Z"}'})
    poll = threading.Thread(target=daemon._check_interruption, args=(agent, notice))
    poll.start()
    out, err = ssm.communicate(timeout=120)
    poll.join(timeout=120)

    # Then exactly one final dump exists, and both triggers report it
    assert ssm.returncode == 0, err
    reported = json.loads(out)
    finals = [m.checkpoint_id for m in CheckpointStore.for_directory(mounted_store, "job-1").checkpoints()]
    assert finals == [reported["checkpoint_id"]]
    state = agent.state.read()
    assert state.final_dump().status == "done"
    assert state.final_dump().result["checkpoint_id"] == reported["checkpoint_id"]
    assert len(publisher.of("CheckpointCompleted")) == (0 if not reported["already_taken"] else 1)
    # And the job stopped for the handover is not reported as exited
    assert agent.watch_job() is None
    assert publisher.of("JobExited") == []


@pytest.mark.parametrize("damage", ["chunk", "manifest"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, publisher, reference_output, damage):
    # Given two periodic checkpoints of a running job, the newer one's chunk or manifest corrupted in the store
    (tmp_path / "store").mkdir()
    store = CheckpointStore.for_directory(tmp_path / "store", "job-1")
    config = make_config(tmp_path, "primary", command=compute_command(32, 40, 0.1))
    primary = make_agent(config, publisher, store)
    pid = primary.start_job()
    wait_for(lambda: len(progress_lines(config.workdir)) >= 3, what="progress")
    older = primary.checkpoint("periodic", 1)
    wait_for(lambda: len(progress_lines(config.workdir)) >= 8, what="more progress")
    newer = primary.checkpoint("periodic", 1)
    os.kill(pid, signal.SIGSTOP)
    manifests = {m.checkpoint_id: m for m in store.checkpoints()}
    unique = manifests[newer.checkpoint_id].chunk_hashes() - manifests[older.checkpoint_id].chunk_hashes()
    job_root = tmp_path / "store" / "jobs" / "job-1"
    if damage == "chunk":
        victim = next((job_root / "chunks").glob(f"*/{sorted(unique)[0]}"))
    else:
        victim = job_root / "checkpoints" / f"{newer.checkpoint_id}.json"
    victim.write_bytes(b"bit rot" + victim.read_bytes()[7:])

    # When the backup restores the newest checkpoint
    backup = make_agent(make_config(tmp_path, "backup", generation=2, mode="restore"), publisher, store)
    restored = backup.restore(2)
    kill_tree(pid)

    # Then it restores the previous one, says why, and the job still ends as an uninterrupted run
    assert restored.checkpoint_id == older.checkpoint_id
    assert newer.checkpoint_id in restored.skipped and "corrupt" in restored.skipped
    assert publisher.of("RestoreCompleted")[0].skipped == restored.skipped
    assert wait_for_exit(backup) == 0
    assert (config.workdir / "progress.log").read_text() == reference_output(32, 40)[0]


def test_a_job_holding_a_listening_socket_dumps_and_restores(tmp_path, publisher):
    # Given a job listening on a loopback port
    port = free_port()
    (tmp_path / "store").mkdir()
    store = CheckpointStore.for_directory(tmp_path / "store", "job-1")
    config = make_config(tmp_path, "primary", command=(sys.executable, str(JOBS / "listener.py"), str(port)))
    primary = make_agent(config, publisher, store)
    pid = primary.start_job()
    wait_for(lambda: len(progress_lines(config.workdir)) >= 2, what="the job to listen")

    # When its final dump is taken and it is restored on the backup
    primary.checkpoint("final", 1)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), what="the job to stop")
    backup = make_agent(make_config(tmp_path, "backup", generation=2, mode="restore"), publisher, store)
    restored = backup.restore(2)

    # Then the restored job answers on the same port
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
            assert connection.makefile().readline().startswith("alive at step")
    finally:
        kill_tree(restored.pid)
