"""What a checkpoint carries, with the real CRIU, between bare local VMs (rehearsal.vm): each has its own empty
/tmp, /var/tmp and /dev/shm, its own /var/lib/spotcr, its own network namespace and address, and the job's
storage at /mnt/spotcr. The agent runs inside them as on a job VM."""

import re
import sys

import pytest
from spotcr_agent.store import CheckpointStore

from tests.support import wait_for

from .conftest import JOBS
from .vm_agent import RUN_ID, JobVM, reference_run

pytestmark = [pytest.mark.criu, pytest.mark.usefixtures("criu_available")]


@pytest.mark.parametrize("kind", ["periodic", "final"])
def test_files_in_vm_local_places_come_back_on_a_fresh_vm(bare_vm, storage, kind):
    # Given a job holding a log in /tmp, a mapped file like a JVM's hsperfdata, closed spills in /var/tmp,
    # a 3 MiB unlinked temp file and a named POSIX semaphore in /dev/shm
    command = (sys.executable, str(JOBS / "vmlocal.py"), "40", "0.1")
    expected = reference_run(bare_vm(), (*command[:3], "0"))
    primary = JobVM(bare_vm(shared_storage=storage), command=command)
    primary.agent("start")
    wait_for(lambda: len(primary.progress()) >= 8, what="progress")

    # When it is checkpointed, then its VM is lost and a fresh VM (empty /tmp, /var/tmp, /dev/shm) restores it
    outcome = primary.agent("checkpoint", kind, "1")
    if kind == "periodic":
        wait_for(lambda: len(primary.progress()) >= 12, what="progress after the periodic dump")
    primary.vm.terminate()
    backup = JobVM(bare_vm(shared_storage=storage), generation=2, mode="restore")
    restored = backup.agent("restore", "2")

    # Then the job ends there exactly as an uninterrupted run: every VM-local thing it held was carried
    assert restored["checkpoint_id"] == outcome["checkpoint_id"]
    assert backup.agent("wait-exit", "60")["exit_code"] == 0
    assert (backup.workdir / "result.txt").read_text() == (expected / "result.txt").read_text()
    assert (backup.workdir / "progress.log").read_text() == (expected / "progress.log").read_text()
    assert [e["checkpoint_id"] for e in primary.events("CheckpointCompleted")] == [outcome["checkpoint_id"]]


def _tcp_job(bare_vm, storage, same_vm, tcp="established", listen="0.0.0.0", kind="final", outside=""):
    """A job holding a listener and an established connection through its VM's address, checkpointed and
    restored on another VM (another address) or on the same VM (the same address); the backup and its progress.
    outside: host:port of a peer outside the job it also keeps a connection to."""
    port = 7411
    primary_vm = bare_vm(shared_storage=storage)
    listen = primary_vm.address if listen == "vm" else listen
    command = (sys.executable, str(JOBS / "tcp_pair.py"), primary_vm.address, str(port), "60", "0.05", listen, outside)
    primary = JobVM(primary_vm, command=command, tcp=tcp)
    primary.agent("start")
    wait_for(lambda: len(primary.progress()) >= 5, what="the job to talk to itself")
    primary.agent("checkpoint", kind, "1")
    if same_vm:
        backup = JobVM(primary_vm, generation=2, mode="restore", tcp=tcp)
    else:
        if kind == "periodic":
            wait_for(lambda: len(primary.progress()) >= 10, what="progress after the periodic dump")
        primary_vm.terminate()
        backup = JobVM(bare_vm(shared_storage=storage), generation=2, mode="restore", tcp=tcp)
        assert backup.vm.address != primary_vm.address
    backup.agent("restore", "2")
    # The listener came back: a client on the backup VM reaches it
    to = "127.0.0.1" if listen == "0.0.0.0" else listen
    probe = backup.vm.run([sys.executable, "-c", f"import socket; socket.create_connection(('{to}', {port}))"])
    assert probe.returncode == 0, probe.stderr
    return backup, primary_vm.address


def _loopback_addresses(vm):
    return vm.run(["ip", "-o", "-4", "addr", "show", "dev", "lo"]).stdout


@pytest.mark.parametrize("kind", ["periodic", "final"])
def test_a_job_listening_and_connected_to_itself_on_its_vm_address_keeps_its_connection_on_another_vm(
    bare_vm, storage, kind
):
    # Given a job listening on its VM's private address, connected to itself through it (as MPI ranks over UCX)
    backup, old_address = _tcp_job(bare_vm, storage, same_vm=False, listen="vm", kind=kind)

    # When it is restored on a VM with another address, then the old address is kept on that VM's loopback only
    assert f"inet {old_address}/32 " in _loopback_addresses(backup.vm)
    assert backup.vm.address not in _loopback_addresses(backup.vm)

    # Then its connection came back intact: every step answered, none reconnected
    assert backup.agent("wait-exit", "60")["exit_code"] == 0
    lines = backup.progress()
    assert len(lines) == 60
    assert [line for line in lines if "reconnect" in line] == []
    # And once the job has ended, the address is no longer shadowed on the backup
    assert old_address not in _loopback_addresses(backup.vm)


def test_a_connection_from_the_vm_s_address_to_a_peer_outside_the_job_is_reset_and_the_job_s_own_is_kept(
    bare_vm, storage
):
    # Given a service on another VM, and a job connected to itself over its VM's address and to that service
    peer = bare_vm()
    script = f"setsid {sys.executable} {JOBS / 'echo_server.py'} 7413 >/dev/null 2>&1 < /dev/null &"
    assert peer.run(["sh", "-c", script]).returncode == 0
    dial = f"import socket; socket.create_connection(('{peer.address}', 7413))"
    wait_for(lambda: peer.run([sys.executable, "-c", dial]).returncode == 0, what="the service to listen")

    # When the job is restored on a VM with another address, where the service's replies cannot reach the old one
    backup, _ = _tcp_job(bare_vm, storage, same_vm=False, listen="vm", outside=f"{peer.address}:7413")

    # Then the job sees only its connection to the service reset (before it resumed), dials it again, and ends;
    # its connection to itself came back intact
    assert backup.agent("wait-exit", "60")["exit_code"] == 0
    lines = backup.progress()
    assert [line for line in lines if "reconnect" in line] == []
    resets = [line for line in lines if "outside reset" in line]
    assert len(resets) == 1 and resets[0].endswith("ConnectionAbortedError"), resets
    assert len(lines) == 61


def test_the_close_policy_closes_connections_when_the_backup_has_another_address(bare_vm, storage):
    # Given a job under spotcr:tcp=close with a connection through its VM's address, restored on another VM
    backup, old_address = _tcp_job(bare_vm, storage, same_vm=False, tcp="close")
    # Then no address is kept for it, the job sees its connection reset once, reconnects, and ends
    assert old_address not in _loopback_addresses(backup.vm)
    assert backup.agent("wait-exit", "60")["exit_code"] == 0
    lines = backup.progress()
    assert len(lines) == 60
    assert len([line for line in lines if "reconnect" in line]) == 1


def test_tcp_connections_come_back_where_the_address_is_the_same(bare_vm, storage):
    backup, _ = _tcp_job(bare_vm, storage, same_vm=True)
    assert backup.agent("wait-exit", "60")["exit_code"] == 0
    lines = backup.progress()
    assert len(lines) == 60
    assert [line for line in lines if "reconnect" in line] == []


def test_the_close_policy_closes_connections_even_where_the_address_is_the_same(bare_vm, storage):
    backup, _ = _tcp_job(bare_vm, storage, same_vm=True, tcp="close")
    assert backup.agent("wait-exit", "60")["exit_code"] == 0
    assert len([line for line in backup.progress() if "reconnect" in line]) == 1


def test_a_jvm_with_default_flags_comes_back_on_a_fresh_vm(bare_vm, storage):
    # Given a JVM with default flags, which maps /tmp/hsperfdata_root/<pid>
    primary = JobVM(bare_vm(shared_storage=storage), command=("java", str(JOBS / "Counter.java"), "60"))
    primary.agent("start")
    wait_for(lambda: len(primary.progress()) >= 5, timeout=60, what="the JVM to run")
    hsperf = primary.vm.run(["sh", "-c", "ls /tmp/hsperfdata_root"])
    assert hsperf.stdout.split(), "the JVM mapped no hsperfdata file"

    # When it is final-dumped and restored on a fresh VM with an empty /tmp
    outcome = primary.agent("checkpoint", "final", "1")
    primary.vm.terminate()
    store = CheckpointStore.for_directory(storage, "job-1", run_id=RUN_ID)
    carried = [f.path for f in store.load(outcome["checkpoint_id"]).files]
    assert f"local/tmp/hsperfdata_root/{hsperf.stdout.split()[0]}" in carried
    backup = JobVM(bare_vm(shared_storage=storage), generation=2, mode="restore")
    backup.agent("restore", "2")

    # Then it ends there, every step counted once
    assert backup.agent("wait-exit", "60")["exit_code"] == 0
    sums = [int(line.split()[2]) for line in backup.progress()]
    assert sums == [sum(s * s for s in range(step + 1)) for step in range(60)]


def test_a_listener_on_the_vm_s_own_address_is_refused_at_the_checkpoint_under_the_close_policy(bare_vm, storage):
    # Given a job under spotcr:tcp=close listening on its VM's private address, which no backup will have
    vm = bare_vm(shared_storage=storage)
    job = JobVM(vm, command=(sys.executable, str(JOBS / "listener.py"), "7412", vm.address), tcp="close")
    job.agent("start")
    wait_for(lambda: len(job.progress()) >= 2, what="the job to listen")

    # When a checkpoint is asked for, then it is refused before the dump, naming the address and what to do
    failed = job.agent("checkpoint", "periodic", "1", check=False)
    assert not failed["ok"]
    assert f"it listens on {vm.address}:7412, an address only this VM has" in failed["error"]
    assert "spotcr:tcp=established" in failed["error"]
    assert "0.0.0.0" in failed["error"]
    assert job.events("CheckpointCompleted") == []
    assert [e["reason"] for e in job.events("CheckpointFailed")] == [failed["error"]]


def test_a_sqlite_database_in_rollback_journal_mode_is_refused_at_the_checkpoint(bare_vm, storage):
    # Given a job writing a SQLite database in the default rollback-journal mode, which no restore can write again
    job = JobVM(
        bare_vm(shared_storage=storage), command=(sys.executable, str(JOBS / "sqlite_db.py"), "delete", "600", "0.05")
    )
    job.agent("start")
    wait_for(lambda: len(job.progress()) >= 3, what="the job to write rows")

    # When a checkpoint is asked for, then it is refused before the dump, naming the process, the file and the fix
    failed = job.agent("checkpoint", "periodic", "1", check=False)
    assert not failed["ok"]
    assert re.search(
        r"pid \d+ \(python[^)]*\)(, host pid \d+)? holds the SQLite database \S+/rows\.db in rollback-journal",
        failed["error"],
    ), failed["error"]
    assert "PRAGMA journal_mode=WAL" in failed["error"]
    assert job.events("CheckpointCompleted") == []
    assert [e["reason"] for e in job.events("CheckpointFailed")] == [failed["error"]]
    before = len(job.progress())
    wait_for(lambda: len(job.progress()) > before, what="the job to run on, never frozen")


def test_a_sqlite_database_in_wal_mode_is_checkpointed_and_restored_on_a_fresh_vm(bare_vm, storage):
    # Given a job writing a SQLite database in WAL mode
    command = (sys.executable, str(JOBS / "sqlite_db.py"), "wal", "60", "0.05")
    primary = JobVM(bare_vm(shared_storage=storage), command=command)
    primary.agent("start")
    wait_for(lambda: len(primary.progress()) >= 5, what="the job to write rows")

    # When it is final-dumped and restored on a fresh VM with another address
    outcome = primary.agent("checkpoint", "final", "1")
    primary.vm.terminate()
    backup = JobVM(bare_vm(shared_storage=storage), generation=2, mode="restore")
    assert backup.agent("restore", "2")["checkpoint_id"] == outcome["checkpoint_id"]

    # Then it writes on there and ends with every row written once
    assert backup.agent("wait-exit", "60")["exit_code"] == 0
    assert backup.progress()[-1] == "step 59 rows 60"
