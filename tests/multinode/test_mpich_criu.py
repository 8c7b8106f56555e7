"""An MPICH job over TCP between two bare local VMs, one rank on each (Hydra's manual launcher standing in for
spotcr's), through a coordinated checkpoint and a restore of both nodes on backups that take over their
addresses: the result is an uninterrupted run's."""

import shlex
import sys
from pathlib import Path

import pytest
from spotcr_agent.nodes import coordinated_checkpoint

from tests.agent.vm_agent import RUN_ID, JobVM, reference_run
from tests.support import wait_for
from tests.workloads.build import build_all

from .support import AgentNode, unlock

pytestmark = pytest.mark.criu

HYDRA_MANUAL = str(Path(__file__).parent / "jobs" / "hydra_manual.py")
STEPS, PACE_MS = 100, 40


def test_an_mpich_job_over_two_vms_restores_from_a_coordinated_checkpoint_with_its_addresses(
    bare_vm, tmp_path, criu_bin
):
    program = (str(build_all() / "mpi"), str(STEPS), str(PACE_MS))
    reference = reference_run(bare_vm(), ("mpiexec", "-n", "2", *program))
    volumes = [tmp_path / "node-0", tmp_path / "node-1"]
    for volume in volumes:
        volume.mkdir()
    # Given an MPICH job of two ranks, one on each node, over TCP between the nodes' addresses
    vms = [bare_vm(shared_storage=volume) for volume in volumes]
    hosts = ",".join(vm.address for vm in vms)
    node0 = JobVM(vms[0], command=(sys.executable, HYDRA_MANUAL, hosts, "-iface", "eth0", "-n", "2", *program))
    node0.agent("start")
    launch = node0.workdir / "launch-1.txt"
    wait_for(launch.exists, what="Hydra's launch command for node 1")
    node1 = JobVM(vms[1], command=tuple(shlex.split(launch.read_text())))
    node1.agent("start")
    wait_for(lambda: len(node0.progress()) >= 20, what="the job's progress")
    job_nodes = [AgentNode(0, node0), AgentNode(1, node1)]

    # When a coordinated periodic checkpoint is taken, the job runs on, and then both nodes are lost
    manifest = coordinated_checkpoint(
        job_nodes, job_id="job-1", run_id=RUN_ID, generation=1, sequence=1, kind="periodic", commit=lambda m: None
    )
    at_checkpoint = len(node0.progress())
    wait_for(lambda: len(node0.progress()) >= at_checkpoint + 10, what="progress after the checkpoint")
    for node in job_nodes:
        node.job.vm.terminate()
    # And a backup for each node takes over its address and restores its part; all unlock once all are restored
    backups = []
    for part, volume in zip(manifest.nodes, volumes, strict=True):
        backup = JobVM(bare_vm(shared_storage=volume, takeover=part.address), generation=2, mode="restore")
        backup.agent("restore", "2", part.checkpoint_id)
        backups.append(backup)
    for backup in backups:
        unlock(backup.vm)

    # Then the job ends on both nodes with the result of an uninterrupted run
    for backup in backups:
        assert backup.agent("wait-exit", "120")["exit_code"] == 0
    assert (backups[0].workdir / "result.txt").read_text() == (reference / "result.txt").read_text()
    assert (backups[0].workdir / "progress.log").read_text() == (reference / "progress.log").read_text()
