"""The checkpoint's VM address, kept on the restoring VM's loopback so the job's sockets bound to it come back.

Every backup has another private address. Under the established TCP policy (spotcr:tcp), a restore adds each
address that the checkpoint's VM had and that the job's sockets used to this VM's loopback (a /32 or /128) before
CRIU runs: listeners bind again, and connections with both ends in the job (MPI ranks over UCX's TCP transport)
come back established. A connection from such an address to a peer outside the job cannot work from here (the
peer answers the old VM), so it is reset before the job resumes (criu.py). The trade-off: on this VM, that one
address is local, so traffic from here to a host that later gets it in the VPC stays on this VM.
The aliases are recorded in the agent's state dir and removed when the job ends and before a later restore adds
its own; only addresses the checkpoint recorded as its VM's own are ever added.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import carry

log = logging.getLogger(__name__)

RECORD = "aliases.json"  # in the agent's state dir: the addresses this agent added to loopback
LOOPBACK = "lo"


class AliasError(RuntimeError):
    """An address could not be added to loopback; the message names it and what `ip` said."""


def _ip(*args: str, binary: str = "ip") -> str:
    result = subprocess.run([binary, *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise AliasError(f"ip {' '.join(args)} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def added(state_dir: Path) -> list[str]:
    """The addresses an earlier restore on this VM added to loopback and that are still there."""
    try:
        return list(json.loads((state_dir / RECORD).read_text()))
    except FileNotFoundError:
        return []
    except ValueError as error:
        raise AliasError(f"{state_dir / RECORD} is not JSON: {error}") from error


def vm_addresses(state_dir: Path) -> list[str]:
    """This VM's own addresses: global ones on its interfaces other than loopback, and those a restore kept here
    (a job restored here still uses its first VM's address, and a later checkpoint must carry it on)."""
    found = set(added(state_dir))
    for interface in json.loads(_ip("-j", "addr", "show") or "[]"):
        if interface.get("ifname") == LOOPBACK:
            continue
        for info in interface.get("addr_info", []):
            if info.get("scope") == "global" and "local" in info:
                found.add(str(info["local"]))
    return sorted(found)


def _usable(address: str) -> bool:
    parsed = ipaddress.ip_address(address)
    return not (parsed.is_unspecified or parsed.is_loopback or parsed.is_link_local)


def wanted(record: Mapping[str, Any], tcp: str) -> list[str]:
    """The checkpoint VM's addresses that the job's listeners or connections were bound to (none under close)."""
    if tcp == "close":
        return []
    own = set(record.get("vm_addresses", []))  # checkpoints before it was recorded alias nothing
    scan = record["scan"]
    used = {listener.rsplit(" ", 1)[0] for listener in scan["listening"]} | set(scan["established"])
    return sorted(address for address in used & own if _usable(address))


def outside_connections(record: Mapping[str, Any], aliased: Sequence[str]) -> list[str]:
    """Connections from an aliased address whose other end is not in the job: they cannot work from here."""
    connections = set(record["scan"].get("connections", []))
    outside = []
    for connection in sorted(connections):
        local, local_port, remote, remote_port = connection.split()
        if local in aliased and f"{remote} {remote_port} {local} {local_port}" not in connections:
            outside.append(connection)
    return outside


def keep(state_dir: Path, addresses: Sequence[str]) -> list[str]:
    """Remove an earlier restore's aliases, then add each address this VM lacks to loopback; returns those added."""
    release(state_dir)
    kept: list[str] = []
    try:
        for address in addresses:
            if carry.address_here(address):
                continue
            prefix = "/32" if ipaddress.ip_address(address).version == 4 else "/128"
            extra = () if prefix == "/32" else ("nodad",)  # usable at once: no duplicate detection on loopback
            _ip("addr", "add", address + prefix, "dev", LOOPBACK, *extra)
            kept.append(address)
            (state_dir / RECORD).write_text(json.dumps(kept))
    except Exception:
        release(state_dir)
        raise
    if kept:
        log.info("kept the checkpoint's VM address %s on loopback for the job's sockets", ", ".join(kept))
    return kept


def release(state_dir: Path) -> None:
    """Remove the aliases this agent added (the job ended, or another restore comes); what is gone is skipped."""
    for address in added(state_dir):
        prefix = "/32" if ipaddress.ip_address(address).version == 4 else "/128"
        try:
            _ip("addr", "del", address + prefix, "dev", LOOPBACK)
        except AliasError as error:
            log.warning("could not remove the alias %s from loopback: %s", address, error)
    (state_dir / RECORD).unlink(missing_ok=True)
