"""Agent behaviour with the real CRIU: clear errors, one final dump for two triggers, fallback, sockets.

Every job runs with its agent in a bare local VM (rehearsal.vm): its own /tmp, /dev/shm, /proc and address."""

import sys

import pytest
from spotcr_agent.store import CheckpointStore

from tests.support import wait_for

from .conftest import JOBS, compute_command
from .vm_agent import ROOT, RUN_ID, JobVM, reference_output

pytestmark = [pytest.mark.criu, pytest.mark.usefixtures("criu_available")]


def test_a_job_that_exits_at_once_is_reported_and_cannot_be_checkpointed(bare_vm, storage):
    # Given a job that fails immediately
    job = JobVM(bare_vm(shared_storage=storage), command=("sh", "-c", "echo no input file >&2; exit 4"))
    job.agent("start")
    # When the agent watches it, then it reports the exit code and keeps the job's stderr
    assert job.agent("wait-exit", "30")["exit_code"] == 4
    assert [e["exit_code"] for e in job.events("JobExited")] == [4]
    assert "no input file" in (job.workdir / ".spotcr" / "stderr.log").read_text()
    # And a checkpoint says why there is nothing to dump, and reports the exit again (not a failed dump)
    failed = job.agent("checkpoint", "periodic", "1", check=False)
    assert failed["type"] == "CheckpointError"
    assert "the job is not running: it exited with code 4" in failed["error"]
    assert [e["exit_code"] for e in job.events("JobExited")] == [4, 4]
    assert job.events("CheckpointFailed") == []


def test_a_command_that_does_not_exist_is_refused_before_starting(bare_vm, storage):
    job = JobVM(bare_vm(shared_storage=storage), command=("no-such-program", "--x"))
    assert job.agent("start")["pid"] is None
    [failed] = job.events("BootstrapFailed")
    assert "'no-such-program' is not an executable file" in failed["reason"]
    assert job.events("JobStarted") == []


def test_a_job_with_a_terminal_is_refused_with_the_reason(bare_vm, storage):
    job = JobVM(bare_vm(shared_storage=storage), command=(sys.executable, str(JOBS / "terminal.py")))
    job.agent("start")
    wait_for((job.workdir / "ready").exists, what="the job to take a terminal")
    failed = job.agent("checkpoint", "final", "1", check=False)
    assert failed["type"] == "CheckpointError"
    assert "job has a controlling terminal" in failed["error"]
    assert "controlling terminal" in job.events("CheckpointFailed")[0]["reason"]


# Inside a VM: what the agent says of a process started outside a session of its own.
OUTSIDE_SESSION = """
import subprocess
from spotcr_agent.runner import checkpointable_problem
process = subprocess.Popen(["sleep", "30"])
try:
    print(checkpointable_problem(process.pid) or "")
finally:
    process.kill()
    process.wait()
"""


def test_a_process_outside_its_own_session_is_named(bare_vm):
    vm = bare_vm()
    result = vm.run(
        ["env", f"PYTHONPATH={ROOT / 'vm-bootstrap'}:{ROOT / 'functions'}", sys.executable, "-c", OUTSIDE_SESSION]
    )
    assert result.returncode == 0, result.stderr
    assert "root process is not a session leader" in result.stdout


# The IMDS poll asks at the generation the VM serves (1); the warning's SSM command at the same or the bumped one.
@pytest.mark.parametrize("ssm_generation", [1, 2])
def test_two_triggers_for_one_interruption_take_one_final_dump(bare_vm, storage, ssm_generation):
    # Given a running job whose agent config is on disk, on a VM whose job storage is a real mount
    job = JobVM(bare_vm(shared_storage=storage), command=compute_command(64, 40, 0.1))
    job.agent("start")
    wait_for(lambda: len(job.progress()) >= 3, what="progress")

    # When the SSM command (a separate process) and the IMDS poll both trigger the final dump
    both = job.agent("two-triggers", str(ssm_generation))

    # Then exactly one final dump exists, and both triggers report it
    assert both["ssm_exit"] == 0, both["ssm_stderr"]
    reported = both["reported"]
    finals = [m.checkpoint_id for m in CheckpointStore.for_directory(storage, "job-1", run_id=RUN_ID).checkpoints()]
    assert finals == [reported["checkpoint_id"]]
    assert both["final_status"] == "done"
    assert both["final_result"]["checkpoint_id"] == reported["checkpoint_id"]
    assert len(job.events("CheckpointCompleted")) == (0 if not reported["already_taken"] else 1)
    # And the job stopped for the handover is not reported as exited
    assert both["watch"] is None
    assert job.events("JobExited") == []


@pytest.mark.parametrize("damage", ["chunk", "manifest"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(bare_vm, storage, damage):
    expected, _ = reference_output(bare_vm, compute_command(32, 40, 0))
    # Given two periodic checkpoints of a running job, the newer one's chunk or manifest corrupted in the store
    primary = JobVM(bare_vm(shared_storage=storage), command=compute_command(32, 40, 0.1))
    primary.agent("start")
    wait_for(lambda: len(primary.progress()) >= 3, what="progress")
    older = primary.agent("checkpoint", "periodic", "1")
    wait_for(lambda: len(primary.progress()) >= 8, what="more progress")
    newer = primary.agent("checkpoint", "periodic", "1")
    primary.vm.terminate()
    store = CheckpointStore.for_directory(storage, "job-1", run_id=RUN_ID)
    manifests = {m.checkpoint_id: m for m in store.checkpoints()}
    chunks = manifests[newer["checkpoint_id"]].stored_chunks()
    unique = chunks.keys() - manifests[older["checkpoint_id"]].chunk_hashes()
    job_root = storage / "jobs" / "job-1" / "runs" / RUN_ID
    if damage == "chunk":  # bit rot at the start of a chunk only the newer one has, inside its pack
        chunk = chunks[sorted(unique)[0]]
        victim, at = job_root / "chunks" / "packs" / str(chunk.pack), chunk.offset
    else:
        victim, at = job_root / "checkpoints" / f"{newer['checkpoint_id']}.json", 0
    data = victim.read_bytes()
    victim.write_bytes(data[:at] + b"bit rot" + data[at + 7 :])

    # When the backup restores the newest checkpoint
    backup = JobVM(bare_vm(shared_storage=storage), generation=2, mode="restore")
    restored = backup.agent("restore", "2")

    # Then it restores the previous one, says why, and the job still ends as an uninterrupted run
    assert restored["checkpoint_id"] == older["checkpoint_id"]
    assert newer["checkpoint_id"] in restored["skipped"] and "corrupt" in restored["skipped"]
    assert backup.events("RestoreCompleted")[0]["skipped"] == restored["skipped"]
    assert backup.agent("wait-exit", "60")["exit_code"] == 0
    assert (backup.workdir / "progress.log").read_text() == expected


# Inside a VM: the first line the job answers on its loopback port.
ASK = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5) as connection:
    print(connection.makefile().readline().strip())
"""


def test_a_job_holding_a_listening_socket_dumps_and_restores(bare_vm, storage):
    # Given a job listening on a loopback port
    port = 7413
    primary = JobVM(bare_vm(shared_storage=storage), command=(sys.executable, str(JOBS / "listener.py"), str(port)))
    primary.agent("start")
    wait_for(lambda: len(primary.progress()) >= 2, what="the job to listen")

    # When its final dump is taken and it is restored on the backup (another VM)
    primary.agent("checkpoint", "final", "1")
    primary.vm.terminate()
    backup = JobVM(bare_vm(shared_storage=storage), generation=2, mode="restore")
    backup.agent("restore", "2")

    # Then the restored job answers on the same port
    answer = backup.vm.run([sys.executable, "-c", ASK, str(port)], timeout_s=30)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.startswith("alive at step")
