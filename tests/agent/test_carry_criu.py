"""What a checkpoint carries, with the real CRIU, between local VMs as bare as EC2's: each has its own empty
/tmp, /var/tmp and /dev/shm, and, where the test needs one, its own network namespace and address."""

import json
import os
import signal
import sys

import pytest
from spotcr_agent.carry import LOCAL_DIRS

from .conftest import JOBS, kill_tree, make_config, progress_lines, wait_for
from .localvm import local_vms, outside_tmp

pytestmark = [pytest.mark.criu, pytest.mark.usefixtures("criu_available")]


@pytest.fixture
def root():
    with outside_tmp() as path:
        yield path


@pytest.fixture
def vms():
    with local_vms() as make:
        yield make


def vm_config(root, name, generation=1, mode="run", **overrides):
    config = make_config(root, name, generation=generation, mode=mode, local_dirs=LOCAL_DIRS, **overrides)
    path = root / name / "agent.json"
    config.mount_point.mkdir(parents=True, exist_ok=True)
    config.write(path)
    return path


def events(config_path, detail_type):
    path = config_path.parent / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [event for event in map(json.loads, lines) if event["type"] == detail_type]


def reference_run(vm, root, command):
    """What an uninterrupted run writes, on a fresh VM of its own."""
    workdir = root / "reference"
    workdir.mkdir()
    vm.run(list(command), cwd=workdir, timeout=120)
    return workdir


@pytest.mark.parametrize("kind", ["periodic", "final"])
def test_files_in_vm_local_places_come_back_on_a_fresh_vm(root, vms, kind):
    # Given a job holding a log in /tmp, a mapped file like a JVM's hsperfdata, closed spills in /var/tmp,
    # a 3 MiB unlinked temp file and a named POSIX semaphore in /dev/shm
    command = (sys.executable, str(JOBS / "vmlocal.py"), "40", "0.1")
    expected = reference_run(vms("reference"), root, (*command[:3], "0"))
    primary = vms("primary")
    config = vm_config(root, "primary", command=command)
    pid = primary.agent(config, "start")["pid"]
    workdir = root / "work"
    wait_for(lambda: len(progress_lines(workdir)) >= 8, what="progress")

    # When it is checkpointed, then its VM is lost and a fresh VM (empty /tmp, /var/tmp, /dev/shm) restores it
    outcome = primary.agent(config, "checkpoint", kind, "1")
    if kind == "periodic":
        wait_for(lambda: len(progress_lines(workdir)) >= 12, what="progress after the periodic dump")
        os.kill(pid, signal.SIGSTOP)
    backup = vms("backup")
    backup_config = vm_config(root, "backup", generation=2, mode="restore")
    restored = backup.agent(backup_config, "restore", "2")
    kill_tree(pid)

    # Then the job ends there exactly as an uninterrupted run: every VM-local thing it held was carried
    assert restored["checkpoint_id"] == outcome["checkpoint_id"]
    assert backup.agent(backup_config, "wait-exit", "60")["exit_code"] == 0
    assert (workdir / "result.txt").read_text() == (expected / "result.txt").read_text()
    assert (workdir / "progress.log").read_text() == (expected / "progress.log").read_text()
    assert [e["checkpoint_id"] for e in events(config, "CheckpointCompleted")] == [outcome["checkpoint_id"]]


def _tcp_job_across_vms(root, vms, backup_address, tcp="established"):
    """A job holding a listener and an established connection through its VM's address, final-dumped on the
    primary (10.77.0.1) and restored on a VM with backup_address; the restored job's progress lines."""
    port = 7411
    command = (sys.executable, str(JOBS / "tcp_pair.py"), "10.77.0.1", str(port), "60", "0.05")
    primary = vms("primary", "10.77.0.1")
    config = vm_config(root, "primary", command=command, tcp=tcp)
    primary.agent(config, "start")
    workdir = root / "work"
    wait_for(lambda: len(progress_lines(workdir)) >= 5, what="the job to talk to itself")
    primary.agent(config, "checkpoint", "final", "1")
    backup = vms("backup", backup_address)
    backup_config = vm_config(root, "backup", generation=2, mode="restore", tcp=tcp)
    restored = backup.agent(backup_config, "restore", "2")
    try:
        # The listener came back: a client on the backup VM reaches it
        answer = backup.run([sys.executable, "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}))"])
        assert answer.returncode == 0
        assert backup.agent(backup_config, "wait-exit", "60")["exit_code"] == 0
    finally:
        kill_tree(restored["pid"])
    return progress_lines(workdir)


def test_tcp_connections_are_closed_when_the_backup_has_another_address(root, vms):
    # Given a job with an established connection through 10.77.0.1, restored on a VM whose address is 10.77.0.2
    lines = _tcp_job_across_vms(root, vms, "10.77.0.2")
    # Then the restore succeeds, the job sees its connection reset once, reconnects, and ends
    assert len(lines) == 60
    assert len([line for line in lines if "reconnect" in line]) == 1


def test_tcp_connections_come_back_when_the_backup_has_the_same_address(root, vms):
    lines = _tcp_job_across_vms(root, vms, "10.77.0.1")
    assert len(lines) == 60
    assert [line for line in lines if "reconnect" in line] == []


def test_the_close_policy_closes_connections_even_where_the_address_is_the_same(root, vms):
    lines = _tcp_job_across_vms(root, vms, "10.77.0.1", tcp="close")
    assert len([line for line in lines if "reconnect" in line]) == 1
