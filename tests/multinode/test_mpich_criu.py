"""An MPICH job over TCP between three bare local VMs, one rank on each (Hydra's manual launcher standing in for
spotcr's launcher): one node is warned, a coordinated final dump ends the job on all three, the warned node's
share restores on a backup that takes over its address and the others in place; the result is an uninterrupted
run's."""

import shlex
import sys
from pathlib import Path

import pytest
from spotcr_agent.nodes import coordinated_checkpoint

from tests.agent.vm_agent import RUN_ID, JobVM, reference_run
from tests.support import wait_for
from tests.workloads.build import build_all

from .support import AgentNode, unlock

pytestmark = [pytest.mark.criu, pytest.mark.workload]

HYDRA_MANUAL = str(Path(__file__).parent / "jobs" / "hydra_manual.py")
NODES, STEPS, PACE_MS = 3, 100, 40


def test_an_mpich_job_over_three_vms_survives_the_interruption_of_one(bare_vm, tmp_path, criu_bin):
    program = (str(build_all() / "mpi"), str(STEPS), str(PACE_MS))
    reference = reference_run(bare_vm(), ("mpiexec", "-n", str(NODES), *program))
    volumes = [tmp_path / f"node-{index}" for index in range(NODES)]
    for volume in volumes:
        volume.mkdir()
    # Given an MPICH job of three ranks, one on each node, over TCP between the nodes' addresses
    vms = [bare_vm(shared_storage=volume) for volume in volumes]
    hosts = ",".join(vm.address for vm in vms)
    mpiexec = (sys.executable, HYDRA_MANUAL, hosts, "-iface", "eth0", "-n", str(NODES), *program)
    jobs = [JobVM(vms[0], command=mpiexec)]
    jobs[0].agent("start")
    for index in range(1, NODES):
        launch = jobs[0].workdir / f"launch-{index}.txt"
        wait_for(launch.exists, what=f"Hydra's launch command for node {index}")
        jobs.append(JobVM(vms[index], command=tuple(shlex.split(launch.read_text()))))
        jobs[index].agent("start")
    wait_for(lambda: len(jobs[0].progress()) >= 20, what="the job's progress")
    job_nodes = [AgentNode(index, job) for index, job in enumerate(jobs)]

    # When node 2 is warned: a coordinated final dump ends the job on every node
    manifest = coordinated_checkpoint(
        job_nodes,
        job_id="job-1",
        run_id=RUN_ID,
        generation=1,
        sequence=1,
        kind="final",
        commit=lambda m: None,
        serial=job_nodes[0].job.vm.root / "coordinated.lock",
    )
    # And its VM goes; a backup takes over its address and restores its part, the others restore in place
    warned = job_nodes[2]
    warned.job.vm.terminate()
    backup = bare_vm(shared_storage=volumes[2], takeover=warned.address)
    restored = [JobVM(vm, generation=2, mode="restore") for vm in (vms[0], vms[1], backup)]
    for job, part in zip(restored, manifest.nodes, strict=True):
        job.agent("restore", "2", part.checkpoint_id)
    for job in restored:  # only once every node is restored
        unlock(job.vm)

    # Then the job ends on every node with the result of an uninterrupted run
    for job in restored:
        assert job.agent("wait-exit", "120")["exit_code"] == 0
    assert (restored[0].workdir / "result.txt").read_text() == (reference / "result.txt").read_text()
    assert (restored[0].workdir / "progress.log").read_text() == (reference / "progress.log").read_text()
