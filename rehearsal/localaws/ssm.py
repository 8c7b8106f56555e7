"""SSM in the local AWS: commands go to their InstanceIds only; SSM's command status-change event; and managed
instances: only an instance whose SSM agent registered takes commands.

On AWS, SendCommand to an instance whose SSM Agent never registered (not installed, not running, no
role) fails with InvalidInstanceId, and DescribeInstanceInformation lists only registered instances,
with their PingStatus. moto has neither check nor the agent's UpdateInstanceInformation call, so the
local cloud adds both here. Local VMs register through `rehearsal.ssm_agent`, the stand-in for SSM
Agent, which their boot runs where bootstrap.sh installs and starts amazon-ssm-agent.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from rehearsal.localaws import wrap

AGENT_NAME = "amazon-ssm-agent"
ONLINE, CONNECTION_LOST = "Online", "ConnectionLost"


def to_instance_ids_only(patches: contextlib.ExitStack) -> None:
    """moto 5.2 adds every instance to a command sent without Targets; SSM sends to the InstanceIds only."""
    from moto.ssm.models import Command

    wrap(
        patches,
        Command,
        "_get_instance_ids_from_targets",
        lambda original: lambda command: original(command) if command.targets else [],
    )


def command_ended_detail(
    instance_id: str, command_id: str, document_name: str, status: str, requested: datetime
) -> dict[str, str]:
    """The detail of SSM's invocation status-change event (the keys and formats of AWS's sample)."""
    return {
        "command-id": command_id,
        "document-name": document_name,
        "instance-id": instance_id,
        "requested-date-time": (requested if requested.tzinfo else requested.replace(tzinfo=UTC))
        .astimezone(UTC)
        .strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
        + "Z",
        "status": status,
    }


class ManagedInstances:
    """What SSM knows of each instance's agent: registered or not, and its ping status."""

    def __init__(self, account: str) -> None:
        self.account = account
        self._instances: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def register(self, instance_id: str, info: dict[str, Any]) -> None:
        """UpdateInstanceInformation from an agent: registers the instance, or refreshes its ping."""
        now = datetime.now(UTC)
        with self._lock:
            known = self._instances.get(instance_id)
            self._instances[instance_id] = {
                "InstanceId": instance_id,
                "PingStatus": ONLINE,
                "LastPingDateTime": now,
                "RegistrationDate": known["RegistrationDate"] if known else now,
                "AgentVersion": str(info.get("AgentVersion", "")),
                "PlatformType": str(info.get("PlatformType", "Linux")),
                "PlatformName": str(info.get("PlatformName", "")),
                "PlatformVersion": str(info.get("PlatformVersion", "")),
                "ComputerName": str(info.get("ComputerName", "")),
                "IPAddress": str(info.get("IPAddress", "")),
                "ResourceType": "EC2Instance",
                "IsLatestVersion": True,
            }

    def lost(self, instance_id: str) -> None:
        """The instance stopped pinging (terminated): SSM keeps it listed, as ConnectionLost."""
        with self._lock:
            if instance_id in self._instances:
                self._instances[instance_id]["PingStatus"] = CONNECTION_LOST

    def online(self, instance_id: str) -> bool:
        with self._lock:
            return self._instances.get(instance_id, {}).get("PingStatus") == ONLINE

    def describe(self, filters: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """DescribeInstanceInformation with its InstanceIds and PingStatus filters (both lists)."""
        # Filters use Key/Values, the older InstanceInformationFilterList key/valueSet.
        wanted = {str(f.get("Key") or f.get("key")): set(f.get("Values") or f.get("valueSet") or []) for f in filters}
        with self._lock:
            rows = [dict(row) for row in self._instances.values()]
        for key, field in (("InstanceIds", "InstanceId"), ("PingStatus", "PingStatus")):
            if key in wanted:
                rows = [row for row in rows if row[field] in wanted[key]]
        return rows

    def refuse_unregistered(self, instance_ids: Iterable[str]) -> None:
        """SendCommand's check, with SSM's own error code and message."""
        from moto.core.exceptions import JsonRESTError

        missing = [instance_id for instance_id in instance_ids if not self.online(instance_id)]
        if missing:
            listed = ", ".join(f"[{instance_id}]" for instance_id in missing)
            raise JsonRESTError(
                "InvalidInstanceId", f"Instances [{listed}] not in a valid state for account {self.account}"
            )


def install(patches: contextlib.ExitStack, instances: ManagedInstances) -> None:
    """Teach moto's SSM the agent's registration call and DescribeInstanceInformation."""
    from moto.core.responses import ActionResult
    from moto.ssm.responses import SimpleSystemManagerResponse

    def update_instance_information(_missing: Any) -> Callable[[Any], str]:
        def handler(response: Any) -> str:
            instance_id = response._get_param("InstanceId")
            if not instance_id:
                from moto.core.exceptions import JsonRESTError

                raise JsonRESTError("InvalidInstanceId", "UpdateInstanceInformation needs the agent's InstanceId")
            instances.register(str(instance_id), json.loads(response.body or "{}"))
            return "{}"

        return handler

    def describe_instance_information(_missing: Any) -> Callable[[Any], Any]:
        def handler(response: Any) -> Any:
            filters = [
                *(response._get_param("Filters") or []),
                *(response._get_param("InstanceInformationFilterList") or []),
            ]
            return ActionResult({"InstanceInformationList": instances.describe(filters)})

        return handler

    wrap(patches, SimpleSystemManagerResponse, "update_instance_information", update_instance_information)
    wrap(patches, SimpleSystemManagerResponse, "describe_instance_information", describe_instance_information)
