"""The installed CRIU works on this kernel, including the socket fix for Linux >= 6.16."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.criu

# A counter behind a TCP listener: each connection gets the next number, so state is visible.
COUNTER_SERVER = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen()
count = 0
while True:
    connection, _ = server.accept()
    count += 1
    connection.sendall(str(count).encode())
    connection.close()
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def ask(port: int) -> str:
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as connection:
                return connection.recv(16).decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def namespace_init_pid(marker: str) -> int:
    """Host PID of the process that is PID 1 of its own namespace and carries `marker`."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                status = (entry / "status").read_text()
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if len(nspid) >= 2 and nspid[-1] == "1" and marker in cmdline:
                return int(entry.name)
        time.sleep(0.05)
    raise AssertionError(f"no namespace init carrying {marker}")


def test_tcp_listener_survives_dump_and_restore(criu_bin: str, tmp_path: Path) -> None:
    # Given a job holding a TCP listener, started as criu-notes prescribes, that has served once
    port = free_port()
    script = tmp_path / f"counter-{port}.py"
    script.write_text(COUNTER_SERVER)
    log = os.open(tmp_path / "job.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    subprocess.run(
        ["setsid", "-f", "unshare", "-p", "-f", "setsid", sys.executable, str(script), str(port)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        check=True,
    )
    os.close(log)
    pid = namespace_init_pid(script.name)
    restored_pid = None
    try:
        assert ask(port) == "1"

        # When CRIU dumps it (the job stops) and restores it into a fresh PID namespace
        images = tmp_path / "images"
        images.mkdir()
        dump = subprocess.run(
            [criu_bin, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v4"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert dump.returncode == 0, (images / "dump.log").read_text()[-3000:]
        restore = subprocess.run(
            [criu_bin, "restore", "-d", "-D", str(images), "-o", "restore.log", "-v4", "--pidfile", "restored.pid"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert restore.returncode == 0, (images / "restore.log").read_text()[-3000:]
        restored_pid = int((images / "restored.pid").read_text())

        # Then the listener answers again and its state carried over
        assert ask(port) == "2"
    finally:
        for victim in (pid, restored_pid):
            if victim:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)


def test_installer_is_idempotent() -> None:
    # Given CRIU already installed, when the installer runs again, then it does nothing and says so
    started = time.monotonic()
    run = subprocess.run(
        ["bash", str(Path(__file__).parents[2] / "vm-bootstrap" / "install-criu.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "nothing to do" in run.stderr
    assert time.monotonic() - started < 10
