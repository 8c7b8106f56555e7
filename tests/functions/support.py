"""What the function tests share: store-credentials' settings and its requests, as AWS sends them; a job over
several VMs' nodes."""

from __future__ import annotations

import copy
import json
from typing import Any

from spotcr_contracts import tags as tag_names

from rehearsal.controlplane import ACCOUNT, EVENTS, REGION, ControlPlane, ec2_event, invoke_function, route

SAMPLE = json.loads((EVENTS / "function-url" / "request-aws-iam.json").read_text())
JOB_ROLE = "spotcr-JobRole-1A2B3C4D5E6F"
STORE_ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/spotcr-StoreRole-0F1E2D3C4B5A"
BUCKET = "spotcr-checkpoints"


def request(job: str | None, user_arn: str | None) -> dict[str, Any]:
    event = copy.deepcopy(SAMPLE)
    event["rawQueryString"] = f"job={job}" if job is not None else ""
    event["queryStringParameters"] = {"job": job} if job is not None else None
    if user_arn is None:
        event["requestContext"]["authorizer"] = None
    else:
        event["requestContext"]["authorizer"]["iam"]["userArn"] = user_arn
    return event


def instance_session(instance_id: str, role: str = JOB_ROLE) -> str:
    return f"arn:aws:sts::{ACCOUNT}:assumed-role/{role}/{instance_id}"


def answer(event: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = invoke_function("store-credentials", event)
    return response["statusCode"], json.loads(response["body"])


# A job over several VMs (test_multinode_registration.py, test_multinode_recovery.py).
JOB = "mpi-7"


def node_tags(index: int, nodes: int = 3, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {
        tag_names.JOB: JOB,
        tag_names.COMMAND: "mpiexec -n 6 /opt/job/solver",
        tag_names.STORAGE: "efs",
        tag_names.NODES: str(nodes),
        tag_names.NODE: str(index),
        **(extra or {}),
    }


def register(plane: ControlPlane, job_tags: dict[str, str], az: str = f"{REGION}a") -> str:
    """A node as the user starts it, registered by its running state change."""
    instance_id = plane.launch_job_instance(job_tags, az)
    route(ec2_event("state-change-running", instance_id))
    return instance_id


def credentials(instance_id: str) -> tuple[int, dict[str, Any]]:
    """The store-credentials answer to that instance, for the job over several VMs."""
    return answer(request(JOB, instance_session(instance_id)))


def state(plane: ControlPlane, instance_id: str) -> str:
    reservations = plane.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    return str(reservations[0]["Instances"][0]["State"]["Name"])
