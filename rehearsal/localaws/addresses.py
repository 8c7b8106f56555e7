"""What moto's AssignPrivateIpAddresses lacks, done as AWS does ("Assign secondary private IPv4 addresses", EC2 User
Guide; the AssignPrivateIpAddresses API reference):
- an address must lie in the network interface's subnet (a node's address moves only within its subnet);
- an address another interface holds is refused (InvalidIPAddress.InUse) unless AllowReassignment, and with it
  moves: it leaves the interface that held it (moto adds it to the new one and leaves it on the old, two holders
  AWS never has); a primary address never moves;
- a terminated instance's primary interface is deleted with it, so its addresses are free (moto keeps it).
Entered into the caller's ExitStack, and undone when it closes."""

from __future__ import annotations

import contextlib
import ipaddress
from typing import Any

from rehearsal.localaws import wrap


def reassigned_addresses(patches: contextlib.ExitStack) -> None:
    from moto.ec2.exceptions import EC2ClientError, InvalidParameterValue
    from moto.ec2.responses.elastic_network_interfaces import ElasticNetworkInterfaces

    def make(original: Any) -> Any:
        def assign(response: Any) -> Any:
            backend = response.ec2_backend
            eni = backend.get_network_interface(response._get_param("NetworkInterfaceId"))
            reassign = response._get_bool_param("AllowReassignment", False)
            subnet = ipaddress.IPv4Network(eni.subnet.cidr_block)
            for address in response._get_param("PrivateIpAddresses", []):
                if ipaddress.IPv4Address(address) not in subnet:
                    raise InvalidParameterValue(f"Address {address} is not in subnet {eni.subnet.id} ({subnet})")
                for other in backend.enis.values():
                    held = [a for a in other.private_ip_addresses if a.get("PrivateIpAddress") == address]
                    gone = other.instance is not None and other.instance.state == "terminated"
                    if other is eni or not held or gone:
                        continue
                    if not reassign or held[0].get("Primary"):
                        raise EC2ClientError("InvalidIPAddress.InUse", f"Address {address} is in use.")
                    other.private_ip_addresses = [a for a in other.private_ip_addresses if a not in held]
            return original(response)

        return assign

    wrap(patches, ElasticNetworkInterfaces, "assign_private_ip_addresses", make)
