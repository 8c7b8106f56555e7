"""A coordinated checkpoint of a two-node job over TCP between bare local VMs, with the real CRIU and agents:
one job manifest naming both nodes' parts, restorable on backups that take over both addresses; a node whose
dump fails fails it on both, and the job runs on."""

import secrets
import threading
import time

import pytest
from spotcr_agent.nodeport import RemoteNode
from spotcr_agent.nodes import CheckpointFailed, JobManifest, NodeError, coordinated_checkpoint, read_manifest
from spotcr_agent.store.backends import DirectoryBackend

from tests.agent.vm_agent import RUN_ID, JobVM
from tests.support import wait_for

from .support import AgentNode, dial, expected_progress, serve, unlock

pytestmark = pytest.mark.criu


def start_two_nodes(bare_vm, volumes, steps):
    """Node 0 serves, node 1 dials it; each runs under its agent on its own VM, with its own volume (as EBS)."""
    node0 = JobVM(bare_vm(shared_storage=volumes[0]), command=serve(steps))
    node0.agent("start")
    node1 = JobVM(bare_vm(shared_storage=volumes[1]), command=dial(node0.vm.address, steps))
    node1.agent("start")
    wait_for(lambda: len(node1.progress()) >= 5, what="node 1's progress")
    return [AgentNode(0, node0), AgentNode(1, node1)]


def dumps_apart(job_nodes):
    """Node 1 dumps only once node 0 has dumped and 0.5 s more have passed: 5 steps of the job, had the lock not
    stopped every segment between the nodes meanwhile (as a node with more memory to dump would be later)."""
    dumped = threading.Event()
    job_nodes[0].after_dump = dumped.set

    def later():
        assert dumped.wait(120), "node 0 did not dump"
        time.sleep(0.5)

    job_nodes[1].before_dump = later
    return job_nodes


def volumes_of(tmp_path):
    volumes = [tmp_path / "node-0", tmp_path / "node-1"]
    for volume in volumes:
        volume.mkdir()
    return volumes


def coordinate(job_nodes, commit, serial=None):
    return coordinated_checkpoint(
        job_nodes,
        job_id="job-1",
        run_id=RUN_ID,
        generation=1,
        sequence=1,
        kind="periodic",
        commit=commit,
        serial=serial or job_nodes[0].job.vm.root / "coordinated.lock",
    )


def test_a_coordinated_checkpoint_restores_both_nodes_on_backups_with_their_addresses(bare_vm, tmp_path, criu_bin):
    volumes = volumes_of(tmp_path)
    steps = 100
    # Given a two-node job talking over one TCP connection
    job_nodes = start_two_nodes(bare_vm, volumes, steps)

    # When a coordinated periodic checkpoint is taken, the job on both nodes runs on past it
    manifest = coordinate(dumps_apart(job_nodes), commit=lambda manifest: manifest.write(DirectoryBackend(volumes[0])))
    assert not any(node.locked() for node in job_nodes)
    at_checkpoint = len(job_nodes[1].job.progress())
    wait_for(lambda: len(job_nodes[1].job.progress()) >= at_checkpoint + 5, what="progress after the checkpoint")
    # And both nodes are lost; a backup for each takes over its address and restores its part of the checkpoint
    for node in job_nodes:
        node.job.vm.terminate()
    stored = read_manifest(DirectoryBackend(volumes[0]), "job-1", RUN_ID, manifest.checkpoint_id)
    assert [part.address for part in stored.nodes] == [node.address for node in job_nodes]
    backups = []
    for part, volume in zip(stored.nodes, volumes, strict=True):
        backup = JobVM(bare_vm(shared_storage=volume, takeover=part.address), generation=2, mode="restore")
        assert backup.agent("restore", "2", part.checkpoint_id)["checkpoint_id"] == part.checkpoint_id
        backups.append(backup)
    for backup in backups:  # only once every node is restored
        unlock(backup.vm)

    # Then both nodes carry on over their one connection and end as an uninterrupted run
    for backup in backups:
        assert backup.agent("wait-exit", "60")["exit_code"] == 0
        assert backup.progress() == expected_progress(steps)


def test_a_node_whose_dump_fails_fails_the_checkpoint_on_both_and_the_job_runs_on(bare_vm, tmp_path, criu_bin):
    steps = 60
    # Given a two-node job, and node 1's scratch disk full
    job_nodes = start_two_nodes(bare_vm, volumes_of(tmp_path), steps)
    job_nodes[1].job.agent_env["SPOTCR_TEST_FAULT"] = "full-disk"
    committed: list[JobManifest] = []

    # When a coordinated periodic checkpoint is taken
    with pytest.raises(CheckpointFailed, match="node 1 failed to dump") as failed:
        coordinate(job_nodes, commit=committed.append)

    # Then no checkpoint exists, both nodes are unlocked, and the job runs on to the end as an uninterrupted run
    assert "No space left on device" in failed.value.reason
    assert committed == []
    assert not any(node.locked() for node in job_nodes)
    for node in job_nodes:
        assert node.job.agent("wait-exit", "60")["exit_code"] == 0
        assert node.job.progress() == expected_progress(steps)


def test_a_final_dump_moves_the_warned_node_to_a_backup_and_restores_the_other_in_place(bare_vm, tmp_path, criu_bin):
    volumes = volumes_of(tmp_path)
    steps = 80
    # Given a two-node job talking over one TCP connection
    job_nodes = start_two_nodes(bare_vm, volumes, steps)

    # When node 1 is warned: a coordinated final dump ends the job on both nodes and leaves both locked
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
    assert all(node.locked() for node in job_nodes)
    # And node 1's VM goes; a backup takes over its address and restores its part, node 0 restores in place
    job_nodes[1].job.vm.terminate()
    moved = JobVM(bare_vm(shared_storage=volumes[1], takeover=job_nodes[1].address), generation=2, mode="restore")
    in_place = JobVM(job_nodes[0].job.vm, generation=2, mode="restore")
    for node, part in zip((in_place, moved), manifest.nodes, strict=True):
        node.agent("restore", "2", part.checkpoint_id)
    for node in (in_place, moved):
        unlock(node.vm)

    # Then both carry on over their one connection and end as an uninterrupted run
    for node in (in_place, moved):
        assert node.agent("wait-exit", "60")["exit_code"] == 0
        assert node.progress() == expected_progress(steps)


def test_the_coordinator_drives_both_nodes_over_the_agents_port(bare_vm, tmp_path, criu_bin):
    steps = 80
    # Given a two-node job, each node's agent serving the agents' port on its node address under the run's key
    job_nodes = start_two_nodes(bare_vm, volumes_of(tmp_path), steps)
    key = secrets.token_bytes(32)
    servers = []
    for node in job_nodes:
        network = node.job.vm.network
        serving = (node.address, str(network.subnet), network.gateway, key.hex(), "/etc/spotcr/stop-serving")
        server = threading.Thread(target=node.job.agent, args=("serve-node", *serving), daemon=True)
        server.start()
        servers.append(server)
    remote = [RemoteNode(n.index, n.address, key, order={"generation": 1, "sequence": 1}) for n in job_nodes]
    wait_for(lambda: _answers(remote), what="both nodes' ports")

    # When the coordinator takes a periodic checkpoint over their ports (a request without the key is refused)
    with pytest.raises(NodeError, match="refused lock: bad signature"):
        RemoteNode(1, job_nodes[1].address, secrets.token_bytes(32)).lock()
    manifest = coordinate(remote, commit=lambda m: None, serial=tmp_path / "coordinated.lock")
    for node in job_nodes:
        (node.job.vm.dir("etc") / "stop-serving").touch()
    for server in servers:
        server.join(30)

    # Then each node committed its part, both are unlocked, and the job runs on to the end as an uninterrupted run
    for node, part in zip(job_nodes, manifest.nodes, strict=True):
        assert part.checkpoint_id in node.job.agent("checkpoint-ids")["ids"]
    assert not any(node.locked() for node in job_nodes)
    for node in job_nodes:
        assert node.job.agent("wait-exit", "60")["exit_code"] == 0
        assert node.job.progress() == expected_progress(steps)


def _answers(remote):
    """Whether every node's port answers (an unlock of an unlocked node changes nothing)."""
    try:
        for node in remote:
            node.unlock()
    except NodeError:
        return False
    return True


def test_node_0s_agent_coordinates_the_nodes_its_daemons_serve(bare_vm, tmp_path, criu_bin):
    steps = 80
    volumes = volumes_of(tmp_path)
    # Given a two-node job whose agents know the job's nodes and the run's launch key, each agent's daemon running
    # (it serves the agents' port on the node address)
    vms = [bare_vm(shared_storage=volume) for volume in volumes]
    addresses = (vms[0].address, vms[1].address)
    key = secrets.token_hex(32)
    commands = (serve(steps), dial(addresses[0], steps))
    jobs = [
        JobVM(vm, command=command, nodes=addresses, node_index=index, launch_key=key)
        for index, (vm, command) in enumerate(zip(vms, commands, strict=True))
    ]
    for job in jobs:
        job.agent("start")
    daemons = [threading.Thread(target=job.agent, args=("service", "until-exit", "170"), daemon=True) for job in jobs]
    for daemon in daemons:
        daemon.start()
    wait_for(lambda: len(jobs[1].progress()) >= 5, what="node 1's progress")

    # When node 0's agent takes the job's checkpoint, as a dump order has it do
    manifest = JobManifest.from_json(jobs[0].agent("coordinate", "periodic", "1", "1"))

    # Then every node committed its part at the order's generation, node 0 wrote the job manifest on its storage,
    # no node is left locked, and the job runs on to the end as an uninterrupted run
    assert [part.address for part in manifest.nodes] == list(addresses)
    for job, part in zip(jobs, manifest.nodes, strict=True):
        assert part.checkpoint_id in job.agent("checkpoint-ids")["ids"]
        assert "-g1-s1-periodic" in part.checkpoint_id
    assert read_manifest(DirectoryBackend(volumes[0]), "job-1", RUN_ID, manifest.checkpoint_id) == manifest
    for daemon in daemons:
        daemon.join(180)
    for job in jobs:
        assert job.progress() == expected_progress(steps)
        assert [event["exit_code"] for event in job.events("JobExited")] == [0]  # the daemon reported its end
    assert not any(AgentNode(i, job).locked() for i, job in enumerate(jobs))
