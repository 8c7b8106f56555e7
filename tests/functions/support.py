"""What the function tests share: store-credentials' settings and its requests, as AWS sends them."""

from __future__ import annotations

import copy
import json
from typing import Any

from rehearsal.controlplane import ACCOUNT, EVENTS, invoke_function

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
