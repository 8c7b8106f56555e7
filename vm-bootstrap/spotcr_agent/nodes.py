"""A node of a multi-node job: the lock on TCP between the job's nodes (docs/design/multinode.md).

The lock drops TCP from the job's other nodes to this node's address. It serves twice:
- A backup that takes over an interrupted node's private address boots locked: it must not answer the other
  nodes for that address before the job's sockets are restored there, or its kernel would reset every
  connection it has no socket for. The other nodes retransmit meanwhile, as they do while the node is gone.
- A coordinated checkpoint locks every node before any node dumps and unlocks them only after the last dump:
  no segment crosses between nodes while their sockets are dumped one node after another, so every pair of
  socket images agrees (what one side sent and the other never got stays in the sender's queue).
"""

from __future__ import annotations

import subprocess

LOCK_CHAIN = "SPOTCR-NODE-LOCK"


class NodeError(RuntimeError):
    """A node's network step failed; the message names the command and what it said."""


def lock_rules(address: str, peers: str, unlocked: str = "") -> list[list[str]]:
    """The iptables rules (filter table) that drop TCP from `peers` (addresses or CIDRs, comma-separated) to
    `address`; `unlocked` is one source among them that still gets through (the rehearsal's local cloud)."""
    rules = [["-N", LOCK_CHAIN]]
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


def _run(iptables: str, rules: list[list[str]]) -> None:
    for rule in rules:
        result = subprocess.run([iptables, "-w", *rule], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NodeError(f"`{iptables} {' '.join(rule)}` failed: {result.stderr.strip()}")
