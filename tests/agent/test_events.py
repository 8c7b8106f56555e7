"""The agent's events match the shared vectors in tests/events/agent/, which the functions parse too."""

import json
import re
from pathlib import Path

import boto3
import pytest
from moto import mock_aws
from spotcr_agent.events import EventBridgePublisher, now_iso
from spotcr_contracts.events import EVENT_TYPES, SOURCE, JobExited, parse_detail

from rehearsal.iam import enforce, principals
from tests.localaws.vended import enforced

from .conftest import make_agent, make_config

VECTORS = sorted((Path(__file__).parents[1] / "events" / "agent").glob("*.json"))
COMMON = {"version", "job_id", "instance_id", "generation", "at", "run_id", "event_id"}


def test_there_is_one_vector_per_agent_event():
    assert sorted(p.stem for p in VECTORS) == sorted(EVENT_TYPES)


@pytest.mark.parametrize("vector", VECTORS, ids=lambda p: p.stem)
def test_agent_builds_each_event_as_its_vector(vector, tmp_path, publisher):
    # Given the vector and an agent on the vector's instance
    doc = json.loads(vector.read_text())
    detail = doc["detail"]
    config = make_config(tmp_path, job_id=detail["job_id"], instance_id=detail["instance_id"])
    agent = make_agent(config, publisher)

    # When the agent emits that event through its own code path
    fields = {k: v for k, v in detail.items() if k not in COMMON}
    agent.emit(EVENT_TYPES[doc["detail-type"]], detail["generation"], **fields)

    # Then the PutEvents entry carries exactly the vector (the time is the VM's own)
    entry = publisher.events[-1].to_entry("spotcr-bus")
    assert entry["Source"] == doc["source"] == SOURCE
    assert entry["DetailType"] == doc["detail-type"]
    built = json.loads(entry["Detail"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", built.pop("at"))
    assert re.fullmatch(r"[0-9a-f]{32}", built.pop("event_id"))  # one per event, minted by the agent
    assert built == {k: v for k, v in detail.items() if k not in ("at", "event_id")}
    vector_event = parse_detail(doc["detail-type"], detail)
    assert vector_event == parse_detail(
        doc["detail-type"], {**built, "at": detail["at"], "event_id": detail["event_id"]}
    )


def _event():
    return JobExited(job_id="job-1", instance_id="i-1", generation=1, at=now_iso(), exit_code=0)


@pytest.mark.parametrize("grant", [None, "events:PutEvents"])
@mock_aws
def test_publisher_puts_events_on_the_bus_as_the_job_vms_session_only_with_its_grant(grant):
    # Given the stack's agent bus, and the job VM's instance-profile session, IAM enforced (with or without the grant)
    boto3.client("events", region_name="us-east-1").create_event_bus(Name="spotcr-bus")
    with enforced("spotcr-checkpoints", {"RegistryAgentBus": "spotcr-bus"}) as world:
        key = world.job_vm("i-1")
        if grant:
            world.enforcer.add_key(key, principals.without_grant(world.enforcer.keys[key], grant))
        # When the agent publishes an event, signing as its VM
        with enforce.acting_as(key):
            published = EventBridgePublisher("spotcr-bus", "us-east-1", attempts=1).publish(_event())
    # Then the bus takes it only while the job role holds the grant
    assert published is (grant is None)
    denied = [d.reason for d in world.enforcer.denials]
    assert (len(denied) == 1 and grant in denied[0]) if grant else denied == []


def test_a_failed_publish_is_retried_then_logged_never_raised(caplog):
    class Failing:
        calls = 0

        def put_events(self, Entries):
            Failing.calls += 1
            raise ConnectionError("endpoint unreachable")

    publisher = EventBridgePublisher("spotcr-bus", "us-east-1", attempts=3, backoff_s=0)
    publisher._client = Failing()
    assert publisher.publish(_event()) is False
    assert Failing.calls == 3
    assert "gave up publishing JobExited" in caplog.text
