"""Ready means reachable: the agent announces itself only once SSM can deliver commands to this instance.

SendCommand fails with InvalidInstanceId until the instance's SSM Agent has registered, which AWS says
may take from 30 s to minutes after boot. The bootstrap waits until DescribeInstanceInformation lists
this instance as Online (the same record SendCommand checks), so AgentReady and JobStarted, which the
control plane answers with commands, never come before a command can arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

ONLINE = "Online"
DEFAULT_WAIT_S = 600.0
POLL_S = 2.0

PingStatus = Callable[[str], str | None]  # instance id -> SSM's PingStatus, None while not registered


def ssm_ping_status(region: str, client: Any = None) -> PingStatus:
    """DescribeInstanceInformation for one instance (the VM role's ssm:DescribeInstanceInformation)."""
    import boto3

    ssm = client or boto3.client("ssm", region_name=region or None)

    def ping_status(instance_id: str) -> str | None:
        rows = ssm.describe_instance_information(Filters=[{"Key": "InstanceIds", "Values": [instance_id]}])
        statuses = [str(row.get("PingStatus")) for row in rows.get("InstanceInformationList", [])]
        return statuses[0] if statuses else None

    return ping_status


class NotReachable(RuntimeError):
    pass


def wait_for_ssm(
    instance_id: str,
    ping_status: PingStatus,
    *,
    timeout_s: float = DEFAULT_WAIT_S,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Seconds waited until this instance's SSM Agent is Online; NotReachable after timeout_s."""
    started = clock()
    last: str | None = None
    while True:
        try:
            last = ping_status(instance_id)
        except Exception as error:  # throttling or a transient network error: ask again until the deadline
            last = f"error: {error}"
        if last == ONLINE:
            return clock() - started
        if clock() - started >= timeout_s:
            break
        sleep(poll_s)
    seen = "not registered" if last is None else last
    raise NotReachable(
        f"SSM Agent on {instance_id} is not Online after {timeout_s:.0f} s ({seen}): SSM cannot deliver commands to "
        "this instance; check that amazon-ssm-agent runs and the instance has a route to the ssm and ec2messages "
        "endpoints"
    )
