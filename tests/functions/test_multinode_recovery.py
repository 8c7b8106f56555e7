"""The control plane recovers a job over several VMs (docs/design/multinode.md): the fencing write names the node,
node 0's agent takes every node's final dump, a backup in the job's subnet takes over the node and its address, and
node 0's agent restores every node; the agents are played, the handlers and the workflow are real."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError
from spotcr_contracts import events
from spotcr_contracts import tags as tag_names
from spotcr_functions import recovery
from spotcr_functions.handlers import _edge
from spotcr_functions.models import Status

from rehearsal.controlplane import (
    ControlPlane,
    agent_event,
    checkpoint_id,
    ec2_event,
    finish_checkpoint,
    finish_exit,
    finish_restore,
    now_iso,
    route,
)
from tests.functions.support import JOB, credentials, node_tags, register, state
from tests.workflow.support import order_periodic, ordered_sequence

pytestmark = pytest.mark.claim("At most one live copy")


def running_job(plane: ControlPlane, nodes: int = 3) -> tuple[list[str], str]:
    """A job running on `nodes` VMs with one coordinated periodic checkpoint; its instances and that checkpoint."""
    instances = [register(plane, node_tags(index, nodes)) for index in range(nodes)]
    route(agent_event(events.JobStarted(JOB, instances[0], 0, now_iso(), pid=4242)))
    sequence = order_periodic(plane, JOB, instances[0])
    periodic = checkpoint_id("periodic", 0, sequence=sequence)
    run_id = plane.job(JOB).run_id
    finish_checkpoint(
        events.CheckpointCompleted(
            JOB, instances[0], 0, now_iso(), run_id=run_id, checkpoint_id=periodic, kind="periodic"
        )
    )
    assert plane.job(JOB).checkpoint_id == periodic
    return instances, periodic


def addresses_of(plane: ControlPlane, instance_id: str) -> list[str]:
    [interface] = plane.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0][
        "NetworkInterfaces"
    ]
    return [a["PrivateIpAddress"] for a in interface["PrivateIpAddresses"]]


@pytest.mark.parametrize("lost", [2, 0])
@pytest.mark.parametrize("event", ["spot-interruption-warning", "state-change-terminated"])
def test_a_node_warned_or_lost_moves_to_a_backup_with_its_address_and_node_0_restores_the_job(
    plane: ControlPlane, vending: list[dict[str, Any]], lost: int, event: str
) -> None:
    # Given a job running on three VMs with a coordinated periodic checkpoint
    instances, periodic = running_job(plane)
    record = plane.job(JOB)
    address, subnet = record.node(lost).address, record.subnet_id
    warned = event == "spot-interruption-warning"

    # When node `lost` is warned (or goes without a warning)
    route(ec2_event(event, instances[lost]))

    # Then one fencing write names the node, and a warning's final dump is ordered to node 0 (its agent dumps all)
    record = plane.job(JOB)
    assert (record.status, record.generation, record.interrupted_node) == (Status.RECOVERING, 1, lost)
    assert record.recovering_from == instances[lost]
    dumps = plane.sent_commands("final-dump")
    assert [d["instances"] for d in dumps] == ([[instances[0]]] if warned else [])

    # And one backup launches in the job's subnet, tagged as that node, and learns the node it takes over
    record = plane.wait_until(lambda: (r := plane.job(JOB)).backup_instance_id and r, "the backup launch")
    backup = str(record.backup_instance_id)
    [launched] = plane.backups()
    assert launched["SubnetId"] == subnet
    backup_tags = plane.instance_tags(backup)
    assert (backup_tags[tag_names.NODE], backup_tags[tag_names.NODES]) == (str(lost), "3")
    status, body = credentials(backup)
    assert status == 200, body
    assert (body["Node"], body["Nodes"]) == (lost, [node.address for node in record.nodes])

    # When node 0 commits the job's final dump (warned) and the backup's agent is ready
    restored = periodic
    if warned:
        plane.wait_for_token(JOB, "final-dump")
        sequence = ordered_sequence(plane, instances[0], "final")
        restored = checkpoint_id("final", 1, sequence=sequence)
        finish_checkpoint(
            events.CheckpointCompleted(
                JOB, instances[0], 1, now_iso(), run_id=record.run_id, checkpoint_id=restored, kind="final"
            )
        )
    route(agent_event(events.AgentReady(JOB, backup, 1, now_iso(), mode="restore")))

    # Then the interrupted node is terminated, its address moves to the backup, and the restore goes to node 0
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    node_0 = backup if lost == 0 else instances[0]
    assert restore["instances"] == [node_0]
    assert restore["parameters"]["CheckpointId"] == restored
    assert state(plane, instances[lost]) == "terminated"
    assert address in addresses_of(plane, backup)
    assert plane.job(JOB).node(lost).instance_id == backup

    # When node 0's agent answers that every node restored
    finish_restore(events.RestoreCompleted(JOB, node_0, 1, now_iso(), checkpoint_id=restored, seconds=2.0, pid=7))

    # Then the job runs at generation 1 on its nodes, node 0's instance the job's, every other node untouched
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    record = plane.job(JOB)
    assert (record.status, record.generation, record.instance_id) == (Status.RUNNING, 1, node_0)
    expected = [backup if index == lost else instance for index, instance in enumerate(instances)]
    assert [node.instance_id for node in record.nodes] == expected
    assert record.interrupted_node is None and record.checkpoint_id == restored
    for index, instance_id in enumerate(instances):
        if index != lost:
            assert state(plane, instance_id) == "running"
            assert tag_names.ERROR not in plane.instance_tags(instance_id)

    # And its next periodic dump is ordered to node 0 again
    order_periodic(plane, JOB, node_0)
    assert plane.sent_commands("checkpoint")[-1]["instances"] == [node_0]


@pytest.mark.parametrize(("second", "event"), [(2, "spot-interruption-warning"), (0, "state-change-terminated")])
def test_nodes_lost_together_each_move_to_a_backup_of_its_own_and_one_restore_brings_the_job_back(
    plane: ControlPlane, vending: list[dict[str, Any]], second: int, event: str
) -> None:
    # Given a job over three VMs recovering node 1, its backup launched
    instances, periodic = running_job(plane)
    addresses = [node.address for node in plane.job(JOB).nodes]
    route(ec2_event("state-change-terminated", instances[1]))
    record = plane.wait_until(lambda: (r := plane.job(JOB)).backup_instance_id and r, "the backup launch")
    backup_1 = str(record.backup_instance_id)

    # When another node goes too before the restore is ordered (a wave; node 0, the job's instance, included)
    route(ec2_event(event, instances[second]))

    # Then it joins the recovery: no new generation, no failure
    record = plane.job(JOB)
    assert (record.status, record.generation, list(record.lost_nodes)) == (Status.RECOVERING, 1, [second])

    # When the first backup is ready, the workflow launches the lost node's own backup, tagged as that node
    route(agent_event(events.AgentReady(JOB, backup_1, 1, now_iso(), mode="restore")))
    record = plane.wait_until(lambda: (r := plane.job(JOB)).lost_nodes[second].backup and r, "the second backup")
    backup_2 = record.lost_nodes[second].backup
    assert plane.instance_tags(backup_2)[tag_names.NODE] == str(second)
    status, body = credentials(backup_2)
    assert (status, body.get("Node")) == (200, second), body
    assert plane.sent_commands("restore") == []  # not before that backup is ready

    # When it is ready too
    route(agent_event(events.AgentReady(JOB, backup_2, 1, now_iso(), mode="restore")))

    # Then both lost instances are terminated, each address moved to its backup, and one restore goes to node 0
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    node_0 = backup_2 if second == 0 else instances[0]
    assert restore["instances"] == [node_0]
    assert restore["parameters"]["CheckpointId"] == periodic
    for index, backup in ((1, backup_1), (second, backup_2)):
        assert state(plane, instances[index]) in ("shutting-down", "terminated")
        assert addresses[index] in addresses_of(plane, backup)

    # When node 0's agent answers that every node restored, the job runs on its nodes at generation 1
    finish_restore(events.RestoreCompleted(JOB, node_0, 1, now_iso(), checkpoint_id=periodic, seconds=2.0, pid=7))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"
    record = plane.job(JOB)
    expected = {1: backup_1, second: backup_2}
    assert [node.instance_id for node in record.nodes] == [
        expected.get(i, instance) for i, instance in enumerate(instances)
    ]
    assert (record.status, record.generation, record.instance_id, record.lost_nodes) == (Status.RUNNING, 1, node_0, {})


def test_a_node_lost_after_the_restore_was_ordered_fails_the_job_and_retires_every_node(plane: ControlPlane) -> None:
    # Given a job over three VMs whose node 1 went, its restore ordered to node 0
    instances, periodic = running_job(plane)
    route(ec2_event("state-change-terminated", instances[1]))
    record = plane.wait_until(lambda: (r := plane.job(JOB)).backup_instance_id and r, "the backup launch")
    route(agent_event(events.AgentReady(JOB, str(record.backup_instance_id), 1, now_iso(), mode="restore")))
    plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")

    # When node 2 goes too: the restore in flight would miss it
    route(ec2_event("spot-interruption-warning", instances[2]))

    # Then the job fails naming the node and its newest checkpoint, and every VM is retired
    record = plane.job(JOB)
    assert record.status == Status.FAILED
    assert f"node 2 ({instances[2]}" in str(record.reason) and "after the restore was ordered" in str(record.reason)
    assert f"newest checkpoint is {periodic}" in str(record.reason)
    for instance_id in [*instances, plane.backups()[0]["InstanceId"]]:
        assert state(plane, instance_id) in ("shutting-down", "terminated")


def test_node_0s_failure_after_a_node_is_lost_is_undone_by_the_recovery_its_success_is_kept(
    plane: ControlPlane,
) -> None:
    # Given a job over two VMs whose node 1 went without a warning
    instances, _ = running_job(plane, nodes=2)
    run_id = plane.job(JOB).run_id
    route(ec2_event("state-change-terminated", instances[1]))

    # When MPI on node 0 fails for the lost peer, and its agent reports the exit at either generation
    for generation in (0, 1):
        exited = events.JobExited(JOB, instances[0], generation, now_iso(), run_id=run_id, exit_code=1)
        finish_exit(exited)

    # Then the recovery goes on: the restore will bring the job back from its checkpoint
    record = plane.job(JOB)
    assert (record.status, record.generation) == (Status.RECOVERING, 1)

    # And a success reported before the restore is the job's end: restoring it would run it twice
    finish_exit(events.JobExited(JOB, instances[0], 0, now_iso(), run_id=run_id, exit_code=0, result="s3://b/r"))
    record = plane.job(JOB)
    assert (record.status, record.exit_code) == (Status.COMPLETED, 0)


def test_a_node_whose_warning_lost_the_race_to_fence_the_job_joins_the_recovery(plane: ControlPlane) -> None:
    # Given a job over three VMs, read as running by node 2's warning handler
    instances, _ = running_job(plane)
    seen = plane.job(JOB)

    # When node 1's warning fences the job first, then node 2's handler goes on from what it read
    route(ec2_event("spot-interruption-warning", instances[1]))
    deps = _edge.deps()
    answer = recovery._node_interrupted(deps, seen, instances[2], now_iso(), reason="wave", final_dump=True)

    # Then node 2 joins node 1's recovery instead of being dropped as a duplicate
    record = plane.job(JOB)
    assert answer["action"] == "joined", answer
    assert (record.generation, record.interrupted_node, list(record.lost_nodes)) == (1, 1, [2])


def volumes_by_instance(plane: ControlPlane) -> dict[str, str]:
    """Every attached volume of the job, by the instance it is attached to."""
    volumes = plane.ec2.describe_volumes(Filters=[{"Name": "tag:spotcr:job", "Values": [JOB]}])["Volumes"]
    return {a["InstanceId"]: v["VolumeId"] for v in volumes for a in v["Attachments"] if a["State"] == "attached"}


def test_with_ebs_each_node_has_its_own_volume_which_moves_with_the_node_and_goes_when_the_job_ends(
    plane: ControlPlane, vending: list[dict[str, Any]]
) -> None:
    # Given a job over three VMs with EBS storage: one volume per node, attached to it at its registration
    instances = [register(plane, node_tags(i, extra={tag_names.STORAGE: "ebs"})) for i in range(3)]
    record = plane.job(JOB)
    volumes = [node.volume_id for node in record.nodes]
    assert all(volumes) and len(set(volumes)) == 3
    assert volumes_by_instance(plane) == dict(zip(instances, volumes, strict=True))
    route(ec2_event("state-change-running", instances[1]))  # a duplicate registration keeps the node's volume
    assert [node.volume_id for node in plane.job(JOB).nodes] == volumes
    route(agent_event(events.JobStarted(JOB, instances[0], 0, now_iso(), pid=4242)))

    # When node 1 and then node 2 go without a warning, before the restore
    route(ec2_event("state-change-terminated", instances[1]))
    record = plane.wait_until(lambda: (r := plane.job(JOB)).backup_instance_id and r, "the backup launch")
    backup_1 = str(record.backup_instance_id)
    route(ec2_event("state-change-terminated", instances[2]))
    route(agent_event(events.AgentReady(JOB, backup_1, 1, now_iso(), mode="restore")))
    record = plane.wait_until(lambda: (r := plane.job(JOB)).lost_nodes[2].backup and r, "the second backup")
    backup_2 = record.lost_nodes[2].backup
    route(agent_event(events.AgentReady(JOB, backup_2, 1, now_iso(), mode="restore")))

    # Then, once their instances are terminated, each lost node's volume is on its backup before the restore
    [restore] = plane.wait_until(lambda: plane.sent_commands("restore"), "the restore command")
    assert restore["instances"] == [instances[0]]
    assert volumes_by_instance(plane) == {instances[0]: volumes[0], backup_1: volumes[1], backup_2: volumes[2]}
    assert [node.volume_id for node in plane.job(JOB).nodes] == volumes
    finish_restore(events.RestoreCompleted(JOB, instances[0], 1, now_iso(), checkpoint_id="", seconds=2.0, pid=7))
    assert plane.wait_for_execution()["status"] == "SUCCEEDED"

    # When the job ends and its nodes' instances are terminated: every node's volume goes with its instance
    run_id = plane.job(JOB).run_id
    finish_exit(events.JobExited(JOB, instances[0], 1, now_iso(), run_id=run_id, exit_code=0, result="s3://b/r"))
    assert plane.job(JOB).status == Status.COMPLETED
    for instance_id in (instances[0], backup_1, backup_2):
        plane.ec2.terminate_instances(InstanceIds=[instance_id])
        route(ec2_event("state-change-terminated", instance_id))
    assert plane.ec2.describe_volumes(Filters=[{"Name": "tag:spotcr:job", "Values": [JOB]}])["Volumes"] == []
    assert [node.volume_id for node in plane.job(JOB).nodes] == ["", "", ""]


def test_a_node_whose_volume_is_still_attached_waits_for_its_instance_to_let_it_go(
    plane: ControlPlane, vending: list[dict[str, Any]]
) -> None:
    # Given a job over two VMs with EBS storage recovering node 1, whose old instance still holds its volume
    instances = [register(plane, node_tags(i, 2, extra={tag_names.STORAGE: "ebs"})) for i in range(2)]
    record = plane.job(JOB)
    backup = plane.launch_job_instance({tag_names.JOB: JOB}, f"{record.az}")
    volume = record.node(1).volume_id
    deps = _edge.deps()

    # Then the hand-over waits (the workflow retries), naming the volume and who holds it, and attaches nothing
    with pytest.raises(recovery.PrimaryStillRunning, match=f"node 1's volume {volume} is attached to {instances[1]}"):
        recovery._take_over_volume(deps, record, 1, backup)
    assert volumes_by_instance(plane)[instances[1]] == volume

    # When the instance is terminated, the volume goes to the backup; a second try changes nothing
    plane.ec2.terminate_instances(InstanceIds=[instances[1]])
    recovery._take_over_volume(deps, record, 1, backup)
    recovery._take_over_volume(deps, record, 1, backup)
    assert volumes_by_instance(plane) == {instances[0]: record.node(0).volume_id, backup: volume}


def test_a_primary_address_ec2_has_not_freed_yet_is_waited_for_not_failed(
    plane: ControlPlane, vending: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given node 1's instance terminated, whose interface EC2 has not deleted yet (its primary address still held)
    instances = [register(plane, node_tags(i, 2)) for i in range(2)]
    record = plane.job(JOB)
    backup = plane.launch_job_instance({tag_names.JOB: JOB}, record.az)
    plane.ec2.terminate_instances(InstanceIds=[instances[1]])
    deps = _edge.deps()
    held = deps.cloud.describe_instance(instances[1])
    errors = {"InvalidIPAddress.InUse": f"Address {record.node(1).address} is in use.", "UnauthorizedOperation": "no"}

    def refuse(code: str) -> Any:
        def move(interface_id: str, address: str) -> None:
            raise ClientError({"Error": {"Code": code, "Message": errors[code]}}, "AssignPrivateIpAddresses")

        return move

    # Then the address move waits (the workflow retries) while EC2 says the address is in use
    monkeypatch.setattr(deps.cloud, "move_private_address", refuse("InvalidIPAddress.InUse"))
    with pytest.raises(recovery.PrimaryStillRunning, match=f"still held by the interface of {instances[1]}"):
        recovery._take_over_address(deps, record, 1, backup, held)
    # And any other refusal fails the step as it is
    monkeypatch.setattr(deps.cloud, "move_private_address", refuse("UnauthorizedOperation"))
    with pytest.raises(ClientError, match="UnauthorizedOperation"):
        recovery._take_over_address(deps, record, 1, backup, held)
