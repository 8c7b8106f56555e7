"""spotcr-launch on loopback: node 0's side asks node 1's agent over the agents' port, node 1's agent starts the relay
as its share, and the command's output and exit code come home (the VM and MPI test is test_launcher_criu.py)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from spotcr_agent import launch
from spotcr_agent.nodeport import Gate, NodePort, agent_actions

from tests.support import wait_for

LAUNCHER = str(Path(__file__).parent / "jobs" / "spotcr-launch")
NODES = ("127.0.0.1", "127.0.0.3")  # node 0 and node 1, both on loopback
KEY = secrets.token_hex(32)


class ShareAgent:
    """Node 1's agent as far as a launch goes: it starts the share (the relay) once, as a job."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(nodes=NODES, node_index=1, launcher=LAUNCHER)
        self.shares: list[subprocess.Popen[bytes]] = []

    def start_job(self, share: tuple[str, ...] = ()) -> int | None:
        if self.shares:
            return None
        self.shares.append(subprocess.Popen(share))
        return self.shares[0].pid

    def status(self) -> Any:
        return SimpleNamespace(job_status="running" if self.shares else "none")


@pytest.fixture
def node_1() -> Any:
    agent = ShareAgent()
    with NodePort(NODES[1], 0, Gate(bytes.fromhex(KEY)), agent_actions(agent, NODES[1], NODES[0])) as served:
        yield agent, served.port
    for share in agent.shares:
        share.wait(10)


def environ(key: str = KEY) -> dict[str, str]:
    return {**os.environ, launch.NODES_ENV: ",".join(NODES), launch.NODE_ENV: "0", launch.KEY_ENV: key}


def test_a_command_launched_on_another_node_sends_its_output_and_exit_code_home(node_1: Any, capfdbinary: Any) -> None:
    agent, port = node_1
    # As Hydra runs its ssh launcher: an ssh flag, the host, the command's words quoted for a remote shell
    argv = ["-x", NODES[1], "sh", "-c", "'echo from node 1; echo to stderr >&2; exit 3'"]
    assert launch.launch(argv, environ(), port=port) == 3
    out, err = capfdbinary.readouterr()
    assert (out, err) == (b"from node 1\n", b"to stderr\n")
    [share] = agent.shares
    assert share.wait(10) == 3 and tuple(share.args[:2]) == (LAUNCHER, "--relay")

    # And a second launch on the same node is refused: one share per node
    with pytest.raises(launch.LaunchError, match="did not start the share: its job is running here"):
        launch.launch([NODES[1], "true"], environ(), port=port)


def test_a_launch_waits_for_a_node_whose_agent_does_not_serve_its_port_yet(capfdbinary: Any) -> None:
    # Given node 1's agent not serving yet: its port refuses connections
    with socket.create_server((NODES[1], 0)) as probe:
        port = probe.getsockname()[1]
    agent = ShareAgent()

    def serve_later() -> None:
        time.sleep(1.0)
        with NodePort(NODES[1], port, Gate(bytes.fromhex(KEY)), agent_actions(agent, NODES[1], NODES[0])):
            time.sleep(5.0)

    later = threading.Thread(target=serve_later)
    later.start()
    # When node 0's mpiexec launches there meanwhile, then the launch goes through once the port is up
    try:
        assert launch.launch([NODES[1], "echo", "late"], environ(), port=port) == 0
    finally:
        later.join()
    assert capfdbinary.readouterr().out == b"late\n"


def test_a_launch_signed_with_another_key_starts_nothing(node_1: Any) -> None:
    agent, port = node_1
    with pytest.raises(launch.LaunchError, match="refused launch: bad signature"):
        launch.launch([NODES[1], "true"], environ(secrets.token_hex(32)), port=port)
    assert agent.shares == []


@pytest.mark.parametrize(
    ("argv", "host", "command"),
    [
        (["-x", "10.0.0.2", '"/usr/bin/hydra_pmi_proxy"', "--proxy-id", "1"], "10.0.0.2", ["/usr/bin/hydra_pmi_proxy"]),
        (
            ["-o", "StrictHostKeyChecking=no", "-p", "22", "ubuntu@10.0.0.2", "orted -mca x 'a b'"],
            "10.0.0.2",
            ["orted"],
        ),
        (["-T", "--", "10.0.0.2", "prog"], "10.0.0.2", ["prog"]),
    ],
)
def test_host_and_command_are_read_as_ssh_would_read_them(argv: list[str], host: str, command: list[str]) -> None:
    found_host, found = launch.split_ssh_argv(argv)
    assert found_host == host and found[: len(command)] == command
    if "'a b'" in argv[-1]:
        assert found == ["orted", "-mca", "x", "a b"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["-x"], "no HOST"), (["10.0.0.2"], "no COMMAND for 10.0.0.2"), (["10.9.9.9", "prog"], "is not a node")],
)
def test_a_launch_that_names_no_node_or_command_is_refused(argv: list[str], message: str) -> None:
    with pytest.raises(launch.LaunchError, match=message):
        launch.launch(argv, environ())


def test_mpiexec_names_its_control_port_by_node_0s_address_through_the_jobs_environment(tmp_path: Path) -> None:
    # Given the environment node 0's agent starts the job with, its launcher a stand-in that records what Hydra runs
    record = tmp_path / "launched"
    stand_in = tmp_path / "record-launch"
    stand_in.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {record}\nexit 1\n')
    stand_in.chmod(0o755)
    hosts, hydra = tmp_path / "hosts", tmp_path / "hydra.conf"
    hosts.write_text("10.9.8.7\n10.9.8.8\n")
    hydra.write_text(launch.hydra_options("10.9.8.7"))
    env = launch.job_env(("10.9.8.7", "10.9.8.8"), 0, KEY, str(stand_in), hosts_file=hosts, hydra_file=hydra)

    # When mpiexec starts two ranks (its launches fail at once: nothing is started, and it waits on; it is stopped)
    mpiexec = subprocess.Popen(
        ["mpiexec", "-n", "2", "true"], env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )

    def launched() -> bool:
        return record.exists() and record.read_text().count("--control-port") >= 2

    try:
        wait_for(launched, what="Hydra's launches", timeout=30)
    finally:
        mpiexec.kill()
        mpiexec.wait(10)

    # Then Hydra asked to start its proxy on each node, naming its control port by node 0's node address
    words = record.read_text().splitlines()
    assert {"10.9.8.7", "10.9.8.8"} <= set(words)
    ports = [words[i + 1] for i, word in enumerate(words) if word == "--control-port"]
    assert ports and all(port.startswith("10.9.8.7:") for port in ports), ports
