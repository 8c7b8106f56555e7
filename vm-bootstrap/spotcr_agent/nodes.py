"""A node of a multi-node job: the lock on TCP between the job's nodes, and the coordinated checkpoint
(docs/design/multinode.md).

The lock drops TCP from the job's other nodes to this node's address. It serves twice:
- A backup that takes over an interrupted node's private address boots locked: it must not answer the other
  nodes for that address before the job's sockets are restored there, or its kernel would reset every
  connection it has no socket for. The other nodes retransmit meanwhile, as they do while the node is gone.
- A coordinated checkpoint locks every node before any node dumps and unlocks them only after the last dump:
  no segment crosses between nodes while their sockets are dumped one node after another, so every pair of
  socket images agrees (what one side sent and the other never got stays in the sender's queue).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from spotcr_contracts.commands import checkpoint_id
from spotcr_contracts.layout import run_prefix
from spotcr_contracts.results import KINDS

from .state import exclusive

if TYPE_CHECKING:  # spotcr-launch imports this module with the standard library only
    from .store.backends import Backend

log = logging.getLogger(__name__)

LOCK_CHAIN = "SPOTCR-NODE-LOCK"
# The agents' port (spotcr_agent.nodeport): the lock never drops it, since the coordinator drives locked nodes
# over it. The job's own connections between nodes must not use it.
AGENTS_PORT = 7080
JOB_MANIFESTS = "nodes"  # <run prefix>nodes/<checkpoint id>.json: one per coordinated checkpoint


class NodeError(RuntimeError):
    """A node's network step failed; the message names the command and what it said."""


class NodeUnreachable(NodeError):
    """A node's agent did not answer at all (its port not up yet, or the node gone)."""


def lock_rules(address: str, peers: str, unlocked: str = "") -> list[list[str]]:
    """The iptables rules (filter table) that drop TCP from `peers` (addresses or CIDRs, comma-separated) to
    `address`, but for the agents' port (requests to it, and answers from another node's, since the coordinator's
    node is locked too); `unlocked` is one source among them that still gets through (the rehearsal's local
    cloud)."""
    port = str(AGENTS_PORT)
    rules = [["-N", LOCK_CHAIN]]
    rules += [["-A", LOCK_CHAIN, "-p", "tcp", way, port, "-j", "RETURN"] for way in ("--dport", "--sport")]
    if unlocked:
        rules.append(["-A", LOCK_CHAIN, "-s", unlocked, "-j", "RETURN"])
    rules.append(["-A", LOCK_CHAIN, "-p", "tcp", "-s", peers, "-d", address, "-j", "DROP"])
    rules.append(["-I", "INPUT", "-j", LOCK_CHAIN])
    return rules


def locked(iptables: str = "iptables") -> bool:
    """Whether this VM's network holds the lock."""
    argv = [iptables, "-w", "-S", LOCK_CHAIN]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def lock(address: str, peers: str, unlocked: str = "", iptables: str = "iptables") -> None:
    """Lock this VM's `address` against TCP from `peers`; a VM already locked is left as it is."""
    if not locked(iptables):
        _run(iptables, lock_rules(address, peers, unlocked))


def unlock(iptables: str = "iptables") -> None:
    """Lift the lock (the job's sockets are restored here, or every node has dumped); a VM without one is left
    as it is."""
    if locked(iptables):
        _run(iptables, [["-D", "INPUT", "-j", LOCK_CHAIN], ["-F", LOCK_CHAIN], ["-X", LOCK_CHAIN]])


Run = Callable[..., "subprocess.CompletedProcess[str]"]


def hold_address(address: str, primary: Callable[[], str], run: Run = subprocess.run, *, route: bool = True) -> str:
    """Put the node address on the interface that holds this instance's own address (`primary`, asked only when
    needed), unless an interface holds it already; returns that interface's name. EC2 assigns a secondary private
    address to the interface, but Debian configures only the primary one. With `route`, connections to the subnet
    then leave from the node address (`route_from`), so every connection between nodes names node addresses at both
    ends, and a backup that takes the address over takes them all. A backup holds the address without `route` until
    its share is restored: before the control plane moves the address to it, EC2 drops what it sends from it."""
    interfaces = _interfaces(run)
    if address in interfaces:
        return interfaces[address][0]
    own = primary()
    if own not in interfaces:
        raise NodeError(f"no interface holds this instance's address {own!r}, so none can hold node address {address}")
    name, network = interfaces[own][0], interfaces[own][1].network
    if ipaddress.IPv4Address(address) not in network:
        raise NodeError(f"node address {address} is not in {network}, the subnet of this instance's {own}")
    _ip(run, ["ip", "addr", "add", f"{address}/{network.prefixlen}", "dev", name])
    log.info("node address %s put on %s", address, name)
    if route:
        _route(run, name, network, address)
    return name


def route_from(address: str, run: Run = subprocess.run) -> None:
    """Make the node address the source of new connections to its subnet, unless it is its interface's own first
    address (which is the source already)."""
    interfaces = _interfaces(run)
    if address not in interfaces:
        raise NodeError(f"no interface holds node address {address}")
    name, network = interfaces[address][0], interfaces[address][1].network
    if next(held for held, (interface, _) in interfaces.items() if interface == name) != address:
        _route(run, name, network, address)


def _route(run: Run, name: str, network: ipaddress.IPv4Network, address: str) -> None:
    _ip(run, ["ip", "route", "replace", str(network), "dev", name, "src", address])
    log.info("connections to %s leave from node address %s", network, address)


def _ip(run: Run, argv: list[str]) -> None:
    result = run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NodeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def _interfaces(run: Run) -> dict[str, tuple[str, ipaddress.IPv4Interface]]:
    """Each IPv4 address this VM holds: its interface's name, and the address with its network."""
    shown = run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    held = {}
    for line in shown.splitlines():
        words = line.split()
        if len(words) > 3 and words[2] == "inet":
            held[words[3].split("/")[0]] = (words[1], ipaddress.IPv4Interface(words[3]))
    return held


def drop_connections(address: str, ss: str = "ss") -> None:
    """Destroy every TCP connection left on `address` but the agents' port's (the kernel's SOCK_DESTROY, `ss -K`).
    A share killed for a restore leaves its connections closing (their FINs dropped by the peers' locks, or unanswered
    by a lost node), and CRIU cannot put a connection back while the kernel still holds one with the same ends."""
    port = f":{AGENTS_PORT}"
    keep = ["(", "sport", "!=", port, "and", "dport", "!=", port, ")"]
    result = subprocess.run(
        [ss, "-K", "-t", "-n", "state", "all", "src", address, "and", *keep],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise NodeError(f"ss -K on {address} failed: {result.stderr.strip() or result.stdout.strip()}")


def _run(iptables: str, rules: list[list[str]]) -> None:
    for rule in rules:
        result = subprocess.run([iptables, "-w", *rule], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NodeError(f"`{iptables} {' '.join(rule)}` failed: {result.stderr.strip()}")


class Node(Protocol):
    """One node's agent as the coordinator drives it (over the agents' port on EC2, `vm.run` in the rehearsal)."""

    index: int
    address: str

    def lock(self) -> None:
        """Lock TCP from the job's other nodes to this node's address."""

    def dump(self, kind: str) -> None:
        """Dump this node's share: a periodic dump answers once the share runs again, its images possibly still on
        their way to the store; a final one once they are stored (the share ends there)."""

    def commit(self) -> str:
        """Wait until this node's dump is committed; its checkpoint id."""

    def unlock(self) -> None:
        """Lift the lock."""

    def restore(self, checkpoint_id: str) -> None:
        """Restore this node's share from exactly this part of a coordinated checkpoint, ending the share first if
        it still runs; it stays locked."""


class CheckpointFailed(RuntimeError):
    """A node failed its step: the checkpoint fails on every node. `index` names the node, `step` the step."""

    def __init__(self, index: int, step: str, reason: str) -> None:
        super().__init__(f"node {index} failed to {step}: {reason}")
        self.index = index
        self.step = step
        self.reason = reason


@dataclass(frozen=True)
class NodePart:
    """One node's share of a coordinated checkpoint: the checkpoint its own store committed."""

    index: int
    address: str
    checkpoint_id: str


@dataclass(frozen=True)
class JobManifest:
    """A coordinated checkpoint of a job of N nodes; it exists once this is written, after every node's part."""

    job_id: str
    run_id: str
    checkpoint_id: str
    nodes: tuple[NodePart, ...]

    def __post_init__(self) -> None:
        indexes = [part.index for part in self.nodes]
        if indexes != list(range(len(indexes))) or len(indexes) < 2:
            raise ValueError(f"a job manifest names nodes 0..N-1 in order, N >= 2; got {indexes}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> JobManifest:
        try:
            parts = tuple(NodePart(**part) for part in value["nodes"])
            return cls(value["job_id"], value["run_id"], value["checkpoint_id"], parts)
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a job manifest: {error}") from error

    def write(self, backend: Backend) -> None:
        """Write it whole or not at all (one put), under the run's prefix in node 0's store: the one every node
        shares (S3, EFS, FSx), or node 0's own EBS volume."""
        backend.put(manifest_key(self.job_id, self.run_id, self.checkpoint_id), json.dumps(self.to_json()).encode())


def manifest_key(job_id: str, run_id: str, checkpoint: str) -> str:
    return f"{run_prefix(job_id, run_id)}{JOB_MANIFESTS}/{checkpoint}.json"


def read_manifest(backend: Backend, job_id: str, run_id: str, checkpoint: str) -> JobManifest:
    return JobManifest.from_json(json.loads(backend.get(manifest_key(job_id, run_id, checkpoint))))


def coordinated_checkpoint(
    nodes: Sequence[Node],
    *,
    job_id: str,
    run_id: str,
    generation: int,
    sequence: int | None,
    kind: str,
    commit: Callable[[JobManifest], None],
    serial: Path,
    clock: Callable[[], float] = time.time,
) -> JobManifest:
    """Lock every node, then dump every node, then (periodic) unlock every node, then wait for every node's commit,
    then commit one job manifest naming every node's part.

    No node dumps before every node is locked, and none is unlocked before every node has dumped (a final dump
    leaves them locked for the restore): while sockets are dumped node after node no segment crosses between
    nodes, so every pair of socket images agrees. The nodes run on while their images go to the store. A node that
    fails fails the checkpoint on all: no manifest is committed, a periodic dump unlocks every node and the job
    runs on; raises CheckpointFailed naming the node.

    `serial` is the coordinator's lock file: one coordinated checkpoint at a time, so a final dump ordered while a
    periodic one runs waits for it, and the periodic one's unlock never lands in the middle of the final dump.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    with exclusive(serial), ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        manifest_id = checkpoint_id(int(clock() * 1000), generation, kind, sequence)
        try:
            _on_every_node(pool, nodes, "lock", lambda node: node.lock())
            _on_every_node(pool, nodes, "dump", lambda node: node.dump(kind))
        except CheckpointFailed as failed:
            log.error("coordinated %s checkpoint %s failed: %s", kind, manifest_id, failed)
            if kind == "periodic":
                _on_every_node(pool, nodes, "unlock", lambda node: node.unlock())
            raise
        if kind == "periodic":
            _on_every_node(pool, nodes, "unlock", lambda node: node.unlock())
        try:
            parts = _on_every_node(pool, nodes, "commit", lambda node: node.commit())
        except CheckpointFailed as failed:
            log.error("coordinated %s checkpoint %s failed: %s", kind, manifest_id, failed)
            raise
        parts_of = tuple(NodePart(node.index, node.address, part) for node, part in zip(nodes, parts, strict=True))
        manifest = JobManifest(job_id, run_id, manifest_id, parts_of)
        commit(manifest)
    return manifest


def coordinated_restore(nodes: Sequence[Node], manifest: JobManifest) -> None:
    """Lock every node (a final dump left them locked; after a node lost without one, the others' shares still
    run), restore every node's part of one coordinated checkpoint at once, each node from exactly its part (a
    share still running is ended first), then unlock every node, only once all are restored: no node's share
    talks to another's before both are back.

    A node that fails fails the restore (CheckpointFailed naming it, step "restore"): nothing is unlocked, the
    restored shares stay locked, and the recovery must end them before it restores an older checkpoint on all."""
    parts = {part.index: part.checkpoint_id for part in manifest.nodes}
    if sorted(parts) != sorted(node.index for node in nodes):
        raise ValueError(f"checkpoint {manifest.checkpoint_id} has parts {sorted(parts)}, not one per node")
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        _on_every_node(pool, nodes, "lock", lambda node: node.lock())
        _on_every_node(pool, nodes, "restore", lambda node: node.restore(parts[node.index]))
        _on_every_node(pool, nodes, "unlock", lambda node: node.unlock())


def _on_every_node(
    pool: ThreadPoolExecutor, nodes: Sequence[Node], step: str, action: Callable[[Node], Any]
) -> list[Any]:
    """Run one step on every node at once; the first node (by index) that failed is raised once all are done."""
    futures = [pool.submit(action, node) for node in nodes]
    results = []
    for node, future in zip(nodes, futures, strict=True):
        try:
            results.append(future.result())
        except Exception as error:  # any node's failure, whatever it is, fails the step on all
            failed = CheckpointFailed(node.index, step, str(error) or type(error).__name__)
            for other in futures:
                other.exception()  # every node has finished the step before anything else happens
            raise failed from error
    return results
