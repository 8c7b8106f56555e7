"""A job over several VMs registers as one job: one record listing its nodes, one run, one launch key; every node
learns the others' addresses with its store credentials once all are registered (docs/design/multinode.md)."""

from __future__ import annotations

from typing import Any

import pytest
from spotcr_contracts import events
from spotcr_contracts import tags as tag_names
from spotcr_contracts.nodes import LAUNCH_KEY
from spotcr_functions.models import Status

from rehearsal.controlplane import (
    REGION,
    ControlPlane,
    agent_event,
    checkpoint_id,
    ec2_event,
    finish_checkpoint,
    finish_exit,
    now_iso,
    route,
)
from tests.functions.support import JOB, credentials, node_tags, register
from tests.workflow.support import order_periodic

pytestmark = pytest.mark.claim("One identity per run")


def test_three_nodes_registered_in_any_order_are_one_job_with_one_run(
    plane: ControlPlane, vending: list[dict[str, Any]]
) -> None:
    # Given three nodes of one job, whose registrations come in the order 2, 0, 1
    second = register(plane, node_tags(2))
    status, body = credentials(second)
    assert status == 404 and "1 of its 3 nodes registered" in body["error"], "a node waits for the others"
    first = register(plane, node_tags(0))
    middle = register(plane, node_tags(1))
    route(ec2_event("state-change-running", middle))  # a duplicate event changes nothing

    # Then one record lists them, node 0's instance is the job's, and each node carries the one run
    record = plane.job(JOB)
    assert record.status == Status.PENDING and record.node_count == 3
    assert [node.instance_id for node in record.nodes] == [first, middle, second]
    assert record.instance_id == first
    assert record.launch_key and LAUNCH_KEY.fullmatch(record.launch_key)
    assert tag_names.NODE not in record.tags and record.tags[tag_names.NODES] == "3"
    for instance_id in (first, middle, second):
        assert plane.instance_tags(instance_id)[tag_names.RUN] == record.run_id

    # And each node's credentials name every node's address, its own index and the run's launch key
    addresses = [node.address for node in record.nodes]
    assert len(set(addresses)) == 3
    for index, instance_id in enumerate((first, middle, second)):
        status, body = credentials(instance_id)
        assert status == 200, body
        assert (body["Nodes"], body["Node"], body["LaunchKey"]) == (addresses, index, record.launch_key)

    # And node 0's start starts the job, after which no node joins any more
    route(agent_event(_started(first)))
    assert plane.job(JOB).status == Status.RUNNING
    late = register(plane, node_tags(1))
    assert "already runs on" in plane.instance_tags(late)[tag_names.ERROR]
    assert [node.instance_id for node in plane.job(JOB).nodes] == [first, middle, second]


def _started(instance_id: str) -> Any:
    return events.JobStarted(JOB, instance_id, 0, now_iso(), pid=4242)


@pytest.mark.parametrize(
    ("tags", "az", "refusal"),
    [
        (node_tags(0), f"{REGION}a", "node 0 of job mpi-7 is i-"),
        (node_tags(1, nodes=4), f"{REGION}a", "already runs on"),
        (node_tags(1, extra={tag_names.INTERVAL: "60"}), f"{REGION}a", "spotcr:interval differs between the"),
        (node_tags(1), f"{REGION}b", "a node's address moves only within its subnet"),
    ],
    ids=["index-taken", "other-count", "other-tags", "other-subnet"],
)
def test_a_node_that_is_not_the_jobs_is_refused_and_never_gets_the_run(
    plane: ControlPlane, tags: dict[str, str], az: str, refusal: str
) -> None:
    first = register(plane, node_tags(0))
    other = register(plane, tags, az)
    refused = plane.instance_tags(other)
    assert refusal in refused[tag_names.ERROR] and tag_names.RUN not in refused
    assert [node.instance_id for node in plane.job(JOB).nodes] == [first]


@pytest.mark.parametrize(
    ("tags", "refusal"),
    [
        ({tag_names.NODES: "3"}, "spotcr:node: a job over several VMs has both"),
        ({tag_names.NODES: "3", tag_names.NODE: "3"}, "spotcr:node: must be between 0 and 2"),
        ({tag_names.NODES: "17", tag_names.NODE: "0"}, "spotcr:nodes: must be between 1 and 16"),
    ],
)
def test_node_tags_that_make_no_job_are_refused_with_the_tag_named(
    plane: ControlPlane, tags: dict[str, str], refusal: str
) -> None:
    job_tags = {tag_names.JOB: JOB, tag_names.COMMAND: "/opt/job/run", tag_names.STORAGE: "efs", **tags}
    instance_id = register(plane, job_tags)
    assert refusal in plane.instance_tags(instance_id)[tag_names.ERROR]


def test_a_periodic_dump_is_ordered_to_node_0_only_and_its_job_checkpoint_recorded(plane: ControlPlane) -> None:
    # Given a job running on three nodes
    instances = [register(plane, node_tags(index)) for index in range(3)]
    route(agent_event(_started(instances[0])))

    # When its periodic dump is due: the order goes to node 0, whose agent coordinates every node's dump
    sequence = order_periodic(plane, JOB, instances[0])
    assert [c["instances"] for c in plane.sent_commands("checkpoint")] == [[instances[0]]]

    # Then node 0's result line, naming the job checkpoint, is the job's newest checkpoint
    checkpoint = checkpoint_id("periodic", 0, sequence=sequence)
    finish_checkpoint(
        events.CheckpointCompleted(
            JOB, instances[0], 0, now_iso(), run_id=plane.job(JOB).run_id, checkpoint_id=checkpoint, kind="periodic"
        )
    )
    record = plane.job(JOB)
    assert (record.status, record.checkpoint_id) == (Status.RUNNING, checkpoint)


def test_only_node_0s_exit_ends_the_job_another_nodes_share_ending_moves_nothing(plane: ControlPlane) -> None:
    # Given a job running on three nodes, whose other nodes' agents started their shares at mpiexec's launch
    instances = [register(plane, node_tags(index)) for index in range(3)]
    route(agent_event(_started(instances[0])))
    run_id = plane.job(JOB).run_id
    for instance_id in instances[1:]:
        route(agent_event(events.JobStarted(JOB, instance_id, 0, now_iso(), run_id=run_id, pid=7)))

    # When node 2's share ends first (its MPI proxy exits), then node 0's command (mpiexec) exits
    finish_exit(events.JobExited(JOB, instances[2], 0, now_iso(), run_id=run_id, exit_code=0, result="s3://b/r2"))
    assert plane.job(JOB).status == Status.RUNNING, "a share's end is not the job's"
    finish_exit(events.JobExited(JOB, instances[0], 0, now_iso(), run_id=run_id, exit_code=0, result="s3://b/r0"))

    # Then the job ended once, with node 0's exit and result
    record = plane.job(JOB)
    assert (record.status, record.exit_code, record.result) == (Status.COMPLETED, 0, "s3://b/r0")
