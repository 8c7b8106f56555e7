"""The agent's whole path with the real CRIU: run, checkpoint, lose the VM, restore elsewhere, same output.

Each VM is a bare local VM (rehearsal.vm) with its own /tmp, /dev/shm, /proc and address; the agent runs in it."""

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.support import wait_for

from .conftest import compute_command, free_port
from .vm_agent import JobVM, reference_output

pytestmark = [pytest.mark.criu, pytest.mark.usefixtures("criu_available")]


def _interrupt_and_restore(bare_vm, storage, kind, megabytes=200, steps=50, agent_env=None, backup_config=None):
    expected = reference_output(bare_vm, compute_command(megabytes, steps, 0))
    # Given a job running on the primary VM
    primary = JobVM(
        bare_vm(shared_storage=storage), command=compute_command(megabytes, steps, 0.1), agent_env=agent_env
    )
    primary.agent("start")
    wait_for(lambda: len(primary.progress()) >= 5, what="progress")

    # When it is checkpointed, then its VM is lost and a VM with another address restores it
    outcome = primary.agent("checkpoint", kind, "1")
    # The VM's free memory holds the dump: CRIU wrote it to a tmpfs mounted for it, which is gone again
    assert outcome["scratch"] == "memory"
    assert primary.vm.run(["mountpoint", "-q", "/var/lib/spotcr/memory-scratch"]).returncode != 0
    # (a final dump ends with the job gone: CRIU left it stopped, the agent killed it and saw it go)
    assert primary.agent("status")["job_alive"] == (kind == "periodic")
    if kind == "periodic":
        wait_for(lambda: len(primary.progress()) >= 8, what="progress after the periodic dump")
        # and its memory was sampled once CRIU let it run again, for a final dump to tell how much changed since
        assert primary.agent("memory-changed", outcome["checkpoint_id"])["sampled"] == 512
    primary.vm.terminate()
    backup_vm = bare_vm(shared_storage=storage)
    assert backup_vm.address != primary.vm.address
    backup = JobVM(backup_vm, generation=2, mode="restore", agent_env=agent_env, **(backup_config or {}))
    restored = backup.agent("restore", "2")

    # Then the job continues from the checkpoint there and ends as an uninterrupted run; it ran again before its
    # memory had all arrived (lazily) unless the job says not to
    assert restored["checkpoint_id"] == outcome["checkpoint_id"]
    assert restored["lazy"] == (backup_config or {}).get("lazy_restore", True)
    assert restored["running_seconds"] <= restored["seconds"]
    assert backup.agent("wait-exit", "60")["exit_code"] == 0
    progress, stdout = expected
    assert (backup.workdir / "progress.log").read_text() == progress
    assert (backup.workdir / ".spotcr" / "stdout.log").read_text() == stdout
    completed = primary.events("CheckpointCompleted")
    assert [e["checkpoint_id"] for e in completed] == [outcome["checkpoint_id"]]
    assert completed[0]["bytes_total"] > megabytes << 20
    assert [e["checkpoint_id"] for e in backup.events("RestoreCompleted")] == [outcome["checkpoint_id"]]
    assert [e["exit_code"] for e in backup.events("JobExited")] == [0]
    assert primary.events("JobExited") == []
    return primary, backup


def test_periodic_checkpoint_restores_on_a_directory_store(bare_vm, storage):
    # 15 s of steps: the job outlives its periodic dump's upload on a loaded machine
    _interrupt_and_restore(bare_vm, storage, "periodic", steps=150)


def test_final_dump_restores_on_a_directory_store(bare_vm, storage):
    _interrupt_and_restore(bare_vm, storage, "final")


def test_a_job_tagged_off_lazy_restore_is_restored_whole(bare_vm, storage):
    _interrupt_and_restore(bare_vm, storage, "final", megabytes=32, backup_config={"lazy_restore": False})


@pytest.fixture
def s3_for_vms(vm_network):
    """A moto S3 server on the VM network's gateway, which every bare VM reaches; the agent's environment for it."""
    port = free_port()
    server = ThreadedMotoServer(ip_address=vm_network.gateway, port=port)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://{vm_network.gateway}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        yield env
    finally:
        server.stop()


def test_periodic_checkpoint_restores_on_s3(bare_vm, storage, s3_for_vms):
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_for_vms["AWS_ENDPOINT_URL"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket="spotcr-test")
    agent_env = {**s3_for_vms, "SPOTCR_TEST_STORE": "s3:spotcr-test"}
    # moto ingests about 70 MiB/s: a smaller job, of 15 s of steps so that it outlives the upload and shows it ran
    # on meanwhile even on a loaded machine (4 s was not always enough on 2 cores)
    _interrupt_and_restore(bare_vm, storage, "periodic", megabytes=64, steps=150, agent_env=agent_env)
    # And the checkpoint went to the bucket
    assert s3.list_objects_v2(Bucket="spotcr-test")["KeyCount"] > 0


def test_a_final_dump_whose_streaming_breaks_is_shipped_from_scratch_and_restores(bare_vm, storage):
    # The store's upload breaks off while CRIU still writes the final dump (a network blip): tests.agent.vm_agent
    _interrupt_and_restore(bare_vm, storage, "final", megabytes=64, agent_env={"SPOTCR_TEST_STORE": "streaming-breaks"})
