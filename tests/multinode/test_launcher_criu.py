"""`mpiexec -n 3 ./prog` just works over three bare local VMs: node 0's agent gives the job the nodes and spotcr-launch
as Hydra's ssh, each node's agent starts its share at the launcher's request over the agents' port; node 0's agent
coordinates a final dump when a node is warned, the warned node's share restores on a backup that takes over its
address, the others in place, and the result is an uninterrupted run's."""

import secrets
import threading
from pathlib import Path

import pytest
from spotcr_agent.nodes import JobManifest

from tests.agent.vm_agent import JobVM, reference_run
from tests.support import wait_for
from tests.workloads.build import build_all

from .support import unlock

pytestmark = [pytest.mark.criu, pytest.mark.workload]

LAUNCHER = str(Path(__file__).parent / "jobs" / "spotcr-launch")
NODES, STEPS, PACE_MS = 3, 100, 40
STOP = "/etc/spotcr/stop-serving"


def serve_ports(jobs, key):
    """Each node's agent serving the agents' port, as its daemon does, until the test touches STOP."""
    servers = []
    for job in jobs:
        network = job.vm.network
        serving = (job.vm.address, str(network.subnet), network.gateway, key, STOP)
        server = threading.Thread(target=job.agent, args=("serve-node", *serving), daemon=True)
        server.start()
        servers.append(server)
    return servers


def stop_serving(jobs, servers):
    for job in jobs:
        (job.vm.dir("etc") / Path(STOP).name).touch()
    for server in servers:
        server.join(30)


def test_mpiexec_starts_every_nodes_share_through_spotcr_launch_and_survives_a_warning(bare_vm, tmp_path, criu_bin):
    program = (str(build_all() / "mpi"), str(STEPS), str(PACE_MS))
    reference = reference_run(bare_vm(), ("mpiexec", "-n", str(NODES), *program))
    volumes = [tmp_path / f"node-{index}" for index in range(NODES)]
    for volume in volumes:
        volume.mkdir()
    # Given a job over three VMs whose command is plain mpiexec, each node's agent serving its port
    vms = [bare_vm(shared_storage=volume) for volume in volumes]
    addresses = tuple(vm.address for vm in vms)
    key = secrets.token_hex(32)
    command = ("mpiexec", "-n", str(NODES), *program)
    jobs = [
        JobVM(vm, command=command, nodes=addresses, node_index=index, launch_key=key, launcher=LAUNCHER)
        for index, vm in enumerate(vms)
    ]
    servers = serve_ports(jobs, key)

    # When node 0's agent starts the job: mpiexec starts the other nodes' shares through spotcr-launch
    jobs[0].agent("start")
    wait_for(lambda: len(jobs[0].progress()) >= 20, what="the job's progress")
    for job in jobs[1:]:
        assert job.agent("status")["job_status"] == "running", "the node's agent runs its share"

    # And node 2 is warned: node 0's agent takes the job's final dump over the agents' port
    manifest = JobManifest.from_json(jobs[0].agent("coordinate", "final", "1", "1"))
    stop_serving(jobs, servers)
    # And its VM goes; a backup takes over its address and restores its part, the others restore in place
    vms[2].terminate()
    backup = bare_vm(shared_storage=volumes[2], takeover=addresses[2])
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
