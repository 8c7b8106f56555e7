"""The nodes of a job over several VMs (docs/design/multinode.md): one definition for the functions, the agent and
the CLI. Standard library only, as the rest of spotcr_contracts.

A node is one VM's share of the job, known by its index (spotcr:node) for the whole run, and its node address: the
private address its share's connections to the other nodes name at both ends, which a backup takes over.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The run's launch key: it signs every request on the agents' port (spotcr_agent.nodeport). Minted with the run by
# the registration, handed only to the run's own nodes with their store credentials.
LAUNCH_KEY_BYTES = 32
LAUNCH_KEY = re.compile(r"^[0-9a-f]{64,}$")


def new_launch_key() -> str:
    return secrets.token_hex(LAUNCH_KEY_BYTES)


@dataclass(frozen=True)
class NodeRecord:
    """One node of the job: its index, the instance that holds its address now, that address, and for EBS storage
    the node's own volume (its parts of the job's checkpoints), which moves with the address."""

    index: int
    instance_id: str
    address: str
    volume_id: str = ""

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"node index must be 0 or more, got {self.index}")
        ipaddress.IPv4Address(self.address)  # ValueError naming it when it is no IPv4 address

    def to_item(self) -> dict[str, Any]:
        item = {"index": self.index, "instance_id": self.instance_id, "address": self.address}
        return item | ({"volume_id": self.volume_id} if self.volume_id else {})

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> NodeRecord:
        return cls(
            index=int(item["index"]),
            instance_id=str(item["instance_id"]),
            address=str(item["address"]),
            volume_id=str(item.get("volume_id", "")),
        )


def addresses(nodes: tuple[NodeRecord, ...], count: int) -> tuple[str, ...] | None:
    """Every node's address in index order, or None while fewer than `count` nodes are known."""
    by_index = {node.index: node.address for node in nodes}
    if sorted(by_index) != list(range(count)):
        return None
    return tuple(by_index[index] for index in range(count))
