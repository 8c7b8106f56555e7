"""Checkpoints and restores that cannot work say why, with the real CRIU: before the dump where it can be known,
else with CRIU's first real error and its log kept in the job's storage, shown by `spotcr-agent status`.

Every job runs with its agent in a bare local VM (rehearsal.vm): its own /tmp, /dev/shm, /proc and address."""

import json
import re
import sys
from pathlib import Path

import pytest
from spotcr_agent.config import DEFAULT_MOUNT_POINT, DEFAULT_STATE_DIR

from tests.support import wait_for

from .conftest import JOBS
from .vm_agent import ROOT, JobVM

pytestmark = [pytest.mark.criu, pytest.mark.usefixtures("criu_available")]

IMAGE = "/opt/spotcr/image"  # a VM-private place of the image (/opt), which differs between the VMs here


def in_storage(storage, vm_path):
    """Where a path on the VMs' job storage lies on the host."""
    return storage / Path(vm_path).relative_to(DEFAULT_MOUNT_POINT)


def _refused_and_runs_on(job):
    """A refused periodic checkpoint's error; it committed nothing, and the job was never frozen: it runs on."""
    failed = job.agent("checkpoint", "periodic", "1", check=False)
    assert failed["type"] == "CheckpointError", failed
    assert job.agent("checkpoint-ids")["ids"] == []
    before = len(job.progress())
    wait_for(lambda: len(job.progress()) > before, what="the job to run on, never frozen")
    return failed["error"]


def _refused_and_stopped(job):
    """A refused final dump: it committed nothing, and the job is stopped for good, since the VM is going away and
    the backup restores an older checkpoint (at most one live copy)."""
    failed = job.agent("checkpoint", "final", "1", check=False)
    assert failed["type"] == "CheckpointError", failed
    assert job.agent("checkpoint-ids")["ids"] == []
    status = job.agent("status")
    assert (status["job_status"], status["job_alive"]) == ("stopped", False), status
    return failed["error"]


def test_a_job_holding_io_uring_is_refused_before_the_dump_naming_the_process_and_the_workaround(bare_vm, storage):
    # Given a job that holds an io_uring instance, as Node.js with UV_USE_IO_URING=1
    job = JobVM(bare_vm(shared_storage=storage), command=(sys.executable, str(JOBS / "io_uring.py"), "300"))
    job.agent("start")
    wait_for(job.progress, what="the job to set up its ring")

    # When a checkpoint is asked for
    message = _refused_and_runs_on(job)

    # Then it fails before freezing the job, naming the process, what it holds and the workaround
    assert re.search(r"pid \d+ \(python[^)]*\), host pid \d+ holds anon_inode:\[io_uring\]", message), message
    assert "UV_USE_IO_URING=0" in message
    assert job.events("CheckpointFailed")[0]["reason"] == message


def test_a_job_holding_a_socket_criu_cannot_dump_is_refused_before_the_dump(bare_vm, storage):
    # Given a job holding a vsock socket, next to the unix and TCP sockets CRIU dumps in every other test
    job = JobVM(bare_vm(shared_storage=storage), command=(sys.executable, str(JOBS / "vsock.py"), "300"))
    job.agent("start")
    wait_for(job.progress, what="the job to open its socket")
    # When its final dump is asked for, then it is refused, naming the process and the socket, and the job stopped
    message = _refused_and_stopped(job)
    assert re.search(r"pid \d+ \(python[^)]*\), host pid \d+ holds socket:\[\d+\], of a kind", message), message


def test_a_failed_dump_reports_criu_s_first_real_error_and_keeps_its_log_in_storage(bare_vm, storage):
    # Given a job holding a 3 MiB unlinked file, and an agent whose ghost limit is 1 MiB
    command = (sys.executable, str(JOBS / "holds.py"), "ghost", "3", "300")
    job = JobVM(bare_vm(shared_storage=storage), command=command, ghost_limit_mb=1)
    job.agent("start")
    wait_for(job.progress, what="the job to hold its temp file")

    # When the dump fails
    failed = job.agent("checkpoint", "periodic", "1", check=False)
    assert "bigger than ghost_limit_mb in the agent config" in failed["error"]

    # Then the event carries the cause, CRIU's log tail (without the RLIMIT noise) and where the log was kept
    [event] = job.events("CheckpointFailed")
    assert "Can't dump ghost file" in event["reason"]
    assert "Can't dump ghost file" in event["log_tail"]
    assert "RLIMIT_NOFILE" not in event["log_tail"]
    assert Path(event["criu_log"]).is_relative_to(DEFAULT_MOUNT_POINT)
    assert "Dumping FAILED" in in_storage(storage, event["criu_log"]).read_text()
    # And the agent's own lines of that command are kept beside it
    [agent_log] = (in_storage(storage, event["criu_log"]).parent.parent / "agent-logs").iterdir()
    assert "periodic checkpoint failed: " in agent_log.read_text()

    # And `spotcr-agent status` on the VM shows it, from the job's storage
    pythonpath = f"PYTHONPATH={ROOT / 'functions'}:{ROOT / 'vm-bootstrap'}"
    status = job.vm.run(["env", pythonpath, sys.executable, "-m", "spotcr_agent", "status", "--job", "job-1"])
    assert status.returncode == 0, status.stderr
    logs = json.loads(status.stdout)["criu_logs"]
    assert logs[0]["log"] == event["criu_log"]
    assert logs[0]["error"].startswith("an unlinked file the job holds is bigger than ghost_limit_mb")


# Inside a VM: hold a port on loopback until killed (started detached, its output nowhere).
SQUATTER = """
import socket, sys, time
squatter = socket.socket()
squatter.bind(("127.0.0.1", int(sys.argv[1])))
squatter.listen()
time.sleep(600)
"""


def test_a_failed_restore_carries_criu_s_log_tail_and_keeps_the_log(bare_vm, storage):
    # Given the final dump of a job listening on a loopback port
    port = 7414
    primary = JobVM(bare_vm(shared_storage=storage), command=(sys.executable, str(JOBS / "listener.py"), str(port)))
    primary.agent("start")
    wait_for(lambda: len(primary.progress()) >= 2, what="the job to listen")
    primary.agent("checkpoint", "final", "1")
    primary.vm.terminate()

    # When the backup restores while something else on its VM holds the port
    backup = JobVM(bare_vm(shared_storage=storage), generation=2, mode="restore")
    squat = f"setsid -f {sys.executable} -c '{SQUATTER}' {port} </dev/null >/dev/null 2>&1"
    assert backup.vm.run(["sh", "-c", squat]).returncode == 0
    probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"
    wait_for(lambda: backup.vm.run([sys.executable, "-c", probe]).returncode == 0, what="the squatter to listen")
    failed = backup.agent("restore", "2", check=False)
    assert failed["type"] == "RestoreError", failed
    assert "a port the job listens on is already taken here" in failed["error"]

    # Then RestoreFailed carries CRIU's log tail and where its whole log was kept
    [event] = backup.events("RestoreFailed")
    assert "Address already in use" in event["log_tail"]
    assert Path(event["criu_log"]).is_relative_to(DEFAULT_MOUNT_POINT)
    assert "Restoring FAILED" in in_storage(storage, event["criu_log"]).read_text()


def test_a_restore_on_a_different_image_names_the_file_that_differs(bare_vm, storage):
    # Given a job holding a read-only file of the image (as a library or a model), final-dumped
    model = f"{IMAGE}/model.bin"
    primary_vm = bare_vm(shared_storage=storage)
    image = primary_vm.dir("opt") / "image"
    image.mkdir(parents=True)
    (image / "model.bin").write_bytes(b"weights v1" * 1000)
    command = (sys.executable, str(JOBS / "holds.py"), "read", model, "40")
    primary = JobVM(primary_vm, command=command, image_dirs=(IMAGE,))
    primary.agent("start")
    wait_for(lambda: len(primary.progress()) >= 2, what="the job to open its file")
    primary.agent("checkpoint", "final", "1")
    primary.vm.terminate()

    # When the backup VM's image has another version of that file, of the same size
    backup = JobVM(bare_vm(shared_storage=storage), generation=2, mode="restore", image_dirs=(IMAGE,))
    (backup.vm.dir("opt") / "image").mkdir(parents=True)
    (backup.vm.dir("opt") / "image" / "model.bin").write_bytes(b"weights v2" * 1000)
    failed = backup.agent("restore", "2", check=False)
    assert failed["type"] == "RestoreError", failed
    assert re.search(rf"image differs .*{re.escape(model)} has other contents here", failed["error"]), failed

    # Then with the same file the same checkpoint restores
    (backup.vm.dir("opt") / "image" / "model.bin").write_bytes(b"weights v1" * 1000)
    backup.agent("restore", "2")
    assert backup.agent("wait-exit", "60")["exit_code"] == 0


def test_a_failure_while_the_job_is_frozen_fails_the_dump_and_the_job_runs_on(bare_vm, storage):
    # Given a running job, and copying its VM-local files at the freeze breaks (a full scratch disk)
    command = (sys.executable, str(JOBS / "holds.py"), "ghost", "1", "300")
    job = JobVM(bare_vm(shared_storage=storage), command=command, agent_env={"SPOTCR_TEST_FAULT": "full-disk"})
    job.agent("start")
    wait_for(job.progress, what="the job to start")

    # When a periodic checkpoint is taken, then nothing is committed, and CRIU let the job run on
    message = _refused_and_runs_on(job)
    assert re.search(r"recording the job.s files at the freeze failed: .*No space left", message), message


def test_a_job_holding_a_file_in_the_agent_s_own_directories_is_refused_before_the_dump(bare_vm, storage):
    # Given a job that holds a file in the agent's scratch dir, which no checkpoint carries
    vm = bare_vm(shared_storage=storage)
    held = DEFAULT_STATE_DIR / "scratch" / "not-the-job-s.bin"
    vm.host_path(str(held)).parent.mkdir(parents=True)
    vm.host_path(str(held)).write_bytes(b"x")
    job = JobVM(vm, command=(sys.executable, str(JOBS / "holds.py"), "read", str(held), "300"))
    job.agent("start")
    wait_for(job.progress, what="the job to open the file")
    # When its final dump is asked for, then it is refused before CRIU runs, and the agent stops the job
    message = _refused_and_stopped(job)
    assert f"it holds {held}, inside the agent's own directories" in message
