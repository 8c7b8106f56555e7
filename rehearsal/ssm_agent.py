"""The rehearsal's stand-in for SSM Agent: registers its VM with the local cloud's SSM, as amazon-ssm-agent does.

Run inside a local VM by its boot, where bootstrap.sh installs and starts amazon-ssm-agent. It reads the
instance id from the VM's IMDS and calls UpdateInstanceInformation (the agent's own registration call,
which boto3 does not model), then exits: the VM's life stands in for the agent's pings.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import urllib.request

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

AGENT_VERSION = "3.3.0.0-rehearsal"


def imds(path: str) -> str:
    endpoint = os.environ.get("SPOTCR_IMDS_ENDPOINT", "http://169.254.169.254")  # where EC2 serves it
    token_request = urllib.request.Request(  # noqa: S310 (the VM's own IMDS on loopback)
        f"{endpoint}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    )
    with urllib.request.urlopen(token_request, timeout=5) as reply:  # noqa: S310
        token = reply.read().decode()
    request = urllib.request.Request(f"{endpoint}/latest/{path}", headers={"X-aws-ec2-metadata-token": token})  # noqa: S310
    with urllib.request.urlopen(request, timeout=5) as reply:  # noqa: S310
        return str(reply.read().decode()).strip()


def register(instance_id: str, endpoint: str, region: str) -> None:
    body = json.dumps(
        {
            "InstanceId": instance_id,
            "AgentName": "amazon-ssm-agent",
            "AgentVersion": AGENT_VERSION,
            "AgentStatus": "Active",
            "PlatformType": "Linux",
            "PlatformName": "Debian GNU/Linux",
            "PlatformVersion": "12",
            "ComputerName": platform.node(),
        }
    )
    request = AWSRequest(
        method="POST",
        url=endpoint + "/",
        data=body,
        headers={"Content-Type": "application/x-amz-json-1.1", "X-Amz-Target": "AmazonSSM.UpdateInstanceInformation"},
    )
    credentials = Credentials(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    SigV4Auth(credentials, "ssm", region).add_auth(request)
    prepared = urllib.request.Request(  # noqa: S310 (the local cloud on loopback)
        endpoint + "/", data=body.encode(), headers=dict(request.headers.items()), method="POST"
    )
    with urllib.request.urlopen(prepared, timeout=10) as reply:  # noqa: S310
        reply.read()


def main() -> int:
    instance_id = imds("meta-data/instance-id")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    register(instance_id, os.environ["AWS_ENDPOINT_URL"].rstrip("/"), region)
    print(f"ssm-agent stand-in: {instance_id} registered with SSM", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
