"""`mpiexec -n 3 ./prog` just works over three bare local VMs, and survives the interruption of one: node 0's agent
gives the job the nodes and spotcr-launch as Hydra's ssh, and each other node's agent starts its share at the
launcher's request over the agents' port. When node 2 is warned, node 0's agent takes the job's final dump over the
agents' port; node 2's share restores on a backup that takes over its address, the others in place, all at node
0's agent's order over the same port; the result is an uninterrupted run's."""

import functools
import secrets
import threading
from pathlib import Path

import pytest
from spotcr_agent.nodeport import RemoteNode
from spotcr_agent.nodes import JobManifest, NodeError, NodeUnreachable

from tests.agent.vm_agent import JobVM, reference_run
from tests.support import wait_for
from tests.workloads.build import build_all

pytestmark = [pytest.mark.criu, pytest.mark.workload]

LAUNCHER = str(Path(__file__).parent / "jobs" / "spotcr-launch")
NODES, STEPS, PACE_MS = 3, 100, 40
STOP = "/etc/spotcr/stop-serving"


class Serving:
    """Each node's agent serving the agents' port, as its daemon does, until `stop()`."""

    def __init__(self, jobs, key):
        self.jobs = jobs
        self.threads = []
        for job in jobs:
            (job.vm.dir("etc") / Path(STOP).name).unlink(missing_ok=True)
            network = job.vm.network
            serving = (job.vm.address, str(network.subnet), network.gateway, key, STOP)
            thread = threading.Thread(target=job.agent, args=("serve-node", *serving), daemon=True)
            thread.start()
            self.threads.append(thread)
        for address in (job.vm.address for job in jobs):
            wait_for(functools.partial(_answers, address, key), what=f"the port of {address}")

    def stop(self):
        for job in self.jobs:
            (job.vm.dir("etc") / Path(STOP).name).touch()
        for thread in self.threads:
            thread.join(30)


def _answers(address, key):
    """Whether the node's port is up: any answer, a refusal of an action it does not have included."""
    try:
        RemoteNode(0, address, bytes.fromhex(key)).ask("ping")
    except NodeUnreachable:
        return False
    except NodeError:
        return True
    return True


class MpiJob:
    """An MPICH job over three bare VMs whose command is plain mpiexec, each node's agent serving its port; node 0's
    agent has started it, and mpiexec started the other nodes' shares through spotcr-launch."""

    def __init__(self, bare_vm, tmp_path):
        self.bare_vm = bare_vm
        program = (str(build_all() / "mpi"), str(STEPS), str(PACE_MS))
        self.command = ("mpiexec", "-n", str(NODES), *program)
        self.reference = reference_run(bare_vm(), self.command)
        self.volumes = [tmp_path / f"node-{index}" for index in range(NODES)]
        for volume in self.volumes:
            volume.mkdir()
        self.vms = [bare_vm(shared_storage=volume) for volume in self.volumes]
        self.addresses = tuple(vm.address for vm in self.vms)
        self.nodes = {"nodes": self.addresses, "launch_key": secrets.token_hex(32), "launcher": LAUNCHER}
        self.jobs = [
            JobVM(vm, command=self.command, node_index=index, **self.nodes) for index, vm in enumerate(self.vms)
        ]
        self.serving = Serving(self.jobs, self.nodes["launch_key"])
        self.jobs[0].agent("start")
        wait_for(lambda: len(self.jobs[0].progress()) >= 20, what="the job's progress")

    def restore_after_losing(self, lost, checkpoint, *, silently=False):
        """Node `lost`'s VM goes (`silently`: its link first, as when its host fails, so its peers see no reset);
        a backup takes over its address (locked until the restore), and node 0's agent restores every node's part
        of `checkpoint` over the agents' port, the backup's and the others' in place."""
        self.serving.stop()
        if silently:
            self.vms[lost].network.release(self.addresses[lost])
            for index, node in enumerate(self.jobs):
                assert index == lost or node.agent("status")["job_alive"], f"node {index}'s share runs on"
        self.vms[lost].terminate()
        backup = self.bare_vm(shared_storage=self.volumes[lost], takeover=self.addresses[lost])
        vms = [backup if index == lost else vm for index, vm in enumerate(self.vms)]
        restored = [
            JobVM(vm, generation=2, mode="restore", command=self.command, node_index=index, **self.nodes)
            for index, vm in enumerate(vms)
        ]
        serving = Serving(restored, self.nodes["launch_key"])
        restore = restored[0].agent("coordinate-restore", "2", checkpoint.checkpoint_id, "2")
        serving.stop()
        assert restore["checkpoint_id"] == checkpoint.checkpoint_id
        for job, part in zip(restored, checkpoint.nodes, strict=True):
            assert job.agent("status")["last_checkpoint"] == part.checkpoint_id
        return restored

    def ends_as_an_uninterrupted_run(self, restored):
        for job in restored:
            assert job.agent("wait-exit", "120")["exit_code"] == 0
        reference = self.reference
        assert (restored[0].workdir / "result.txt").read_text() == (reference / "result.txt").read_text()
        assert (restored[0].workdir / "progress.log").read_text() == (reference / "progress.log").read_text()


def test_an_mpich_job_over_three_vms_started_by_plain_mpiexec_survives_the_interruption_of_one(
    bare_vm, tmp_path, criu_bin
):
    # Given an MPICH job over three VMs started by plain mpiexec: every node's agent runs its share
    job = MpiJob(bare_vm, tmp_path)
    for node in job.jobs[1:]:
        assert node.agent("status")["job_status"] == "running", "the node's agent runs its share"

    # When node 2 is warned: node 0's agent takes the job's final dump over the agents' port, and after node 2's
    # VM goes, restores every node's part, node 2's on a backup with its address
    manifest = JobManifest.from_json(job.jobs[0].agent("coordinate", "final", "1", "1"))
    restored = job.restore_after_losing(2, manifest)

    # Then the job ends on every node with the result of an uninterrupted run
    job.ends_as_an_uninterrupted_run(restored)


def test_an_mpich_job_over_three_vms_survives_a_node_lost_without_a_warning(bare_vm, tmp_path, criu_bin):
    # Given an MPICH job over three VMs, with a coordinated periodic checkpoint taken, running on
    job = MpiJob(bare_vm, tmp_path)
    manifest = JobManifest.from_json(job.jobs[0].agent("coordinate", "periodic", "1", "1"))
    progress = len(job.jobs[0].progress())
    wait_for(lambda: len(job.jobs[0].progress()) > progress + 5, what="progress after the periodic checkpoint")

    # When node 1's VM is lost silently with no warning (no final dump): the other nodes' shares still run, and
    # node 0's agent restores every node from the periodic checkpoint, ending the shares still running first
    restored = job.restore_after_losing(1, manifest, silently=True)

    # Then the job ends on every node with the result of an uninterrupted run
    job.ends_as_an_uninterrupted_run(restored)
