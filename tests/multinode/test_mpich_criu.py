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


def test_an_mpich_job_over_three_vms_started_by_plain_mpiexec_survives_the_interruption_of_one(
    bare_vm, tmp_path, criu_bin
):
    program = (str(build_all() / "mpi"), str(STEPS), str(PACE_MS))
    reference = reference_run(bare_vm(), ("mpiexec", "-n", str(NODES), *program))
    volumes = [tmp_path / f"node-{index}" for index in range(NODES)]
    for volume in volumes:
        volume.mkdir()
    # Given a job over three VMs whose command is plain mpiexec, each node's agent serving its port
    vms = [bare_vm(shared_storage=volume) for volume in volumes]
    addresses = tuple(vm.address for vm in vms)
    nodes = {"nodes": addresses, "launch_key": secrets.token_hex(32), "launcher": LAUNCHER}
    command = ("mpiexec", "-n", str(NODES), *program)
    jobs = [JobVM(vm, command=command, node_index=index, **nodes) for index, vm in enumerate(vms)]
    serving = Serving(jobs, nodes["launch_key"])

    # When node 0's agent starts the job: mpiexec starts the other nodes' shares through spotcr-launch
    jobs[0].agent("start")
    wait_for(lambda: len(jobs[0].progress()) >= 20, what="the job's progress")
    for job in jobs[1:]:
        assert job.agent("status")["job_status"] == "running", "the node's agent runs its share"

    # And node 2 is warned: node 0's agent takes the job's final dump over the agents' port
    manifest = JobManifest.from_json(jobs[0].agent("coordinate", "final", "1", "1"))
    serving.stop()
    # And its VM goes; a backup takes over its address (locked until the restore), and node 0's agent restores
    # every node's part over the agents' port, the backup's and the others' in place, then unlocks them
    vms[2].terminate()
    backup = bare_vm(shared_storage=volumes[2], takeover=addresses[2])
    restored = [
        JobVM(vm, generation=2, mode="restore", command=command, node_index=index, **nodes)
        for index, vm in enumerate((vms[0], vms[1], backup))
    ]
    serving = Serving(restored, nodes["launch_key"])
    restore = restored[0].agent("coordinate-restore", "2", manifest.checkpoint_id, "2")
    serving.stop()

    # Then every node restored its own part, and the job ends on every node with the result of an uninterrupted run
    assert restore["checkpoint_id"] == manifest.checkpoint_id
    for job, part in zip(restored, manifest.nodes, strict=True):
        assert job.agent("status")["last_checkpoint"] == part.checkpoint_id
    for job in restored:
        assert job.agent("wait-exit", "120")["exit_code"] == 0
    assert (restored[0].workdir / "result.txt").read_text() == (reference / "result.txt").read_text()
    assert (restored[0].workdir / "progress.log").read_text() == (reference / "progress.log").read_text()
