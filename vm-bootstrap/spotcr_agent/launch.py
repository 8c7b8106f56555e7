"""spotcr-launch: how mpiexec on node 0 starts its processes on the job's other nodes, with no SSH.

MPICH's Hydra (`HYDRA_LAUNCHER=ssh`, `HYDRA_LAUNCHER_EXEC`) and Open MPI (`plm_rsh_agent`) start a proxy on each
host by running `LAUNCHER [ssh options] HOST COMMAND...`, as they would run ssh. spotcr-launch is that launcher
(docs/design/multinode.md):

1. On node 0 (a child of mpiexec, in node 0's job) it listens on its node address, on a port of the kernel's
   choosing, and asks the agent of the node at HOST over the agents' port (signed with the run's launch key) to
   `launch` COMMAND as that node's share of the job, with the port and a one-time token.
2. That agent starts `spotcr-launch --relay` as its node's share, in the job's namespaces as a job: it connects
   back three times with the token, for COMMAND's stdout, its stderr and a control connection, runs COMMAND with
   the first two as its stdout and stderr (stdin: /dev/null) and sends its exit code over the third.
3. Node 0's side copies the two streams to its own stdout and stderr and exits with that code.

Every process of it lies in one node's job, and its connections are TCP between node addresses: they are locked,
dumped and restored with the rest of the job. HOST being this node's own address, COMMAND runs here in place of
spotcr-launch. The job's environment names the nodes, this node's index and the run's key (`job_env`).
"""

from __future__ import annotations

import hmac
import os
import secrets
import selectors
import shlex
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import nodeport
from .nodes import NodeError, NodeUnreachable

NODES_ENV, NODE_ENV, KEY_ENV = "SPOTCR_NODES", "SPOTCR_NODE", "SPOTCR_LAUNCH_KEY"
STREAMS = ("out", "err", "ctl")  # the relay's three connections, in the order it makes them
CONNECT_TIMEOUT_S = 60.0
# How long a launch waits for the node's agent to answer at all: the nodes boot one by one, and node 0's job may
# start before another node's agent serves its port.
AGENT_WAIT_S = 300.0
# ssh's options that take a value (ssh(1)); any other option before HOST is a flag, such as Hydra's -x.
_SSH_VALUE_OPTIONS = set("BbcDEeFIiJLlmOopQRSWw")
ERROR_EXIT = 255  # what ssh exits with when it cannot run the command


class LaunchError(Exception):
    """The command could not be started on its node; the message says why."""


def hydra_options(address: str) -> str:
    """MPICH's Hydra's config file (mpiexec options it applies to every run): its control port is named by node
    0's node address, which the other nodes reach and a backup takes over. By default Hydra names it by the host
    name, which resolves to each node itself; `-iface` would take the interface's first address, the instance's
    primary one on EC2, which does not move."""
    return f"-localhost {address}\n"


def job_env(
    nodes: Sequence[str], index: int, launch_key: str, launcher: str, *, hosts_file: Path, hydra_file: Path
) -> dict[str, str]:
    """What node 0's job is started with so that `mpiexec -n N ./prog` uses every node through spotcr-launch."""
    return {
        NODES_ENV: ",".join(nodes),
        NODE_ENV: str(index),
        KEY_ENV: launch_key,
        # MPICH's Hydra: the nodes, the launcher, and its options (hydra_options).
        "HYDRA_HOST_FILE": str(hosts_file),
        "HYDRA_CONFIG_FILE": str(hydra_file),
        "HYDRA_LAUNCHER": "ssh",
        "HYDRA_LAUNCHER_EXEC": launcher,
        # Open MPI (4: orte, 5: prte): the same.
        "OMPI_MCA_plm_rsh_agent": launcher,
        "OMPI_MCA_orte_default_hostfile": str(hosts_file),
        "PRTE_MCA_plm_ssh_agent": launcher,
        "PRTE_MCA_prte_default_hostfile": str(hosts_file),
        # TCP between nodes, shared memory within one: CRIU cannot checkpoint InfiniBand or EFA verbs.
        "UCX_TLS": "tcp,sm,self",
        "FI_PROVIDER": "tcp",
    }


def split_ssh_argv(argv: Sequence[str]) -> tuple[str, list[str]]:
    """HOST and COMMAND from what a launcher is given as ssh would be: options first (skipped), then HOST (a
    `user@` part dropped), then the words a remote shell would split the rest into (no shell ever runs them)."""
    index = 0
    while index < len(argv) and argv[index].startswith("-") and argv[index] != "--":
        option = argv[index]
        index += 2 if len(option) == 2 and option[1] in _SSH_VALUE_OPTIONS else 1
    if index < len(argv) and argv[index] == "--":
        index += 1
    if index >= len(argv):
        raise LaunchError("usage: spotcr-launch [ssh options] HOST COMMAND...: no HOST")
    host = argv[index].rsplit("@", 1)[-1]
    command = shlex.split(" ".join(argv[index + 1 :]))
    if not command:
        raise LaunchError(f"usage: spotcr-launch [ssh options] HOST COMMAND...: no COMMAND for {host}")
    return host, command


def launch(argv: Sequence[str], environ: Mapping[str, str], port: int = nodeport.PORT) -> int:
    """Node 0's side: start COMMAND on HOST's node (its agents' port: `port`) and relay it; returns its exit code."""
    host, command = split_ssh_argv(argv)
    nodes = tuple(a for a in environ.get(NODES_ENV, "").split(",") if a)
    if not nodes or not environ.get(KEY_ENV):
        raise LaunchError(f"{NODES_ENV} and {KEY_ENV} are unset: spotcr-launch runs inside a job over several VMs")
    own = nodes[int(environ.get(NODE_ENV, "0"))]
    if host not in nodes:
        raise LaunchError(f"{host} is not a node of this job ({', '.join(nodes)})")
    if host == own:
        os.execvp(command[0], command)  # noqa: S606 (the job's own command, on its own node)
    token = secrets.token_hex(16)
    with socket.create_server((own, 0)) as listener:
        listener.settimeout(CONNECT_TIMEOUT_S)
        node = nodeport.RemoteNode(nodes.index(host), host, bytes.fromhex(environ[KEY_ENV]), port=port)
        _ask_launch(node, {"argv": command, "address": own, "port": listener.getsockname()[1], "token": token})
        streams = _accept(listener, token)
    return _relay_home(streams)


def _ask_launch(node: nodeport.RemoteNode, body: Mapping[str, Any], wait_s: float = AGENT_WAIT_S) -> None:
    """Ask the node's agent to launch; while it does not answer at all, ask again for up to `wait_s`. A refusal is
    final."""
    deadline = time.monotonic() + wait_s
    pause = 0.2
    while True:
        try:
            node.ask("launch", body)
            return
        except NodeUnreachable as error:
            if time.monotonic() + pause > deadline:
                raise LaunchError(f"{error} (asked for {wait_s:.0f} s)") from error
            time.sleep(pause)
            pause = min(pause * 2, 5.0)
        except NodeError as error:
            raise LaunchError(str(error)) from error


def _accept(listener: socket.socket, token: str) -> dict[str, socket.socket]:
    """The relay's three connections, each proven by the token; anything else that connects is closed."""
    streams: dict[str, socket.socket] = {}
    while len(streams) < len(STREAMS):
        try:
            connection, _ = listener.accept()
        except TimeoutError as error:
            raise LaunchError(f"the node's relay did not connect back within {CONNECT_TIMEOUT_S:.0f} s") from error
        connection.settimeout(CONNECT_TIMEOUT_S)
        hello = _line(connection).split(" ")
        if len(hello) == 2 and hmac.compare_digest(hello[0], token) and hello[1] in STREAMS:
            connection.settimeout(None)
            streams[hello[1]] = connection
        else:
            connection.close()
    return streams


def _line(connection: socket.socket, limit: int = 128) -> str:
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = connection.recv(1)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _relay_home(streams: Mapping[str, socket.socket]) -> int:
    """Copy the command's stdout and stderr here until both end, then take its exit code."""
    targets = {"out": sys.stdout.buffer, "err": sys.stderr.buffer}
    with selectors.DefaultSelector() as selector:
        for name in ("out", "err"):
            selector.register(streams[name], selectors.EVENT_READ, name)
        open_streams = 2
        while open_streams:
            for key, _ in selector.select():
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                if data:
                    targets[key.data].write(data)
                    targets[key.data].flush()
                else:
                    selector.unregister(key.fileobj)
                    open_streams -= 1
    said = _line(streams["ctl"])
    for connection in streams.values():
        connection.close()
    return int(said) if said.lstrip("-").isdigit() else ERROR_EXIT


def relay(address: str, port: int, token: str, command: Sequence[str]) -> int:
    """Node i's side, the node's share: run COMMAND with its output going home to node 0; send its exit code."""
    import subprocess

    streams = {}
    for name in STREAMS:
        streams[name] = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S)
        streams[name].settimeout(None)
        streams[name].sendall(f"{token} {name}\n".encode())
    try:
        child = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=streams["out"].fileno(), stderr=streams["err"].fileno()
        )
    except OSError as error:
        streams["err"].sendall(f"spotcr-launch: cannot run {command[0]}: {error}\n".encode())
        code = ERROR_EXIT
    else:
        streams["out"].close()
        streams["err"].close()
        code = child.wait()
    streams["ctl"].sendall(f"{code}\n".encode())
    streams["ctl"].close()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args[:1] == ["--relay"]:
            address, port, token, separator, *command = args[1:]
            if separator != "--" or not command:
                raise LaunchError("usage: spotcr-launch --relay ADDRESS PORT TOKEN -- COMMAND...")
            return relay(address, int(port), token, command)
        return launch(args, os.environ)
    except (LaunchError, ValueError, OSError) as error:
        print(f"spotcr-launch: {error}", file=sys.stderr)
        return ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
