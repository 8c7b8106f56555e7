"""The installed CRIU works on this kernel, including the socket fix for Linux >= 6.16, between bare local VMs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rehearsal.vm import LocalVM

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


# Inside a VM: the PID (as the VM sees it) of the process that is PID 1 of its own namespace and carries argv[1].
FIND_INIT = """
import sys, time
from pathlib import Path
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
        if len(nspid) >= 2 and nspid[-1] == "1" and sys.argv[1] in cmdline:
            print(entry.name)
            sys.exit(0)
    time.sleep(0.05)
sys.exit(f"no namespace init carrying {sys.argv[1]}")
"""

# Inside a VM: connect to the counter on loopback (retrying while it comes up) and print what it answers.
ASK = """
import socket, sys, time
deadline = time.monotonic() + 10
while True:
    try:
        with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2) as connection:
            print(connection.recv(16).decode())
            break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
"""

# Inside a VM: the external-mount options CRIU needs for the VM's own mounts (/dev/null, ...), one a line.
MOUNT_OPTIONS = """
import sys
from spotcr_agent import mounts
options = mounts.dump_options(int(sys.argv[2])) if sys.argv[1] == "dump" else mounts.restore_options()
print("\\n".join(options))
"""

PORT = 7420
STATE = "/var/lib/spotcr"


def in_vm(vm: LocalVM, argv: list[str], what: str) -> str:
    result = vm.run(argv, timeout_s=120)
    assert result.returncode == 0, f"{what} on {vm.instance_id}: {result.stdout}{result.stderr}"
    return result.stdout.strip()


def mount_options(vm: LocalVM, pid: str = "") -> list[str]:
    return in_vm(vm, [sys.executable, "-c", MOUNT_OPTIONS, "dump" if pid else "restore", pid], "mount options").split()


def test_tcp_listener_survives_dump_and_restore_on_another_vm(criu_bin: str, bare_vm: Callable[..., LocalVM]) -> None:
    # Given a job holding a TCP listener on a bare VM, started as criu-notes prescribes, that has served once
    first, second = bare_vm(), bare_vm()
    work = first.host_path(f"{STATE}/work")
    work.mkdir(parents=True)
    (work / "counter.py").write_text(COUNTER_SERVER)
    # In its own PID and mount namespaces with a fresh /proc, as the agent starts jobs (spotcr_agent.runner)
    namespaces = "unshare --pid --fork --mount --propagation private --mount-proc"
    # (its descriptors opened in there: a file opened through the VM's mounts is not in the job's namespace)
    job = f"exec {sys.executable} counter.py {PORT} </dev/null >job.log 2>&1"
    start = f"cd {STATE}/work && exec setsid -f {namespaces} setsid sh -c '{job}' </dev/null >/dev/null 2>&1"
    in_vm(first, ["sh", "-c", start], "starting the job")
    pid = in_vm(first, [sys.executable, "-c", FIND_INIT, "counter.py"], "finding the job")
    assert in_vm(first, [sys.executable, "-c", ASK, str(PORT)], "asking the job") == "1"

    # When CRIU dumps it there (the job stops), and restores it on another VM into a fresh PID namespace
    images = f"{STATE}/images"
    first.host_path(images).mkdir()
    dump_argv = [criu_bin, "dump", "-t", pid, "-D", images, "-o", "dump.log", "-v4", *mount_options(first, pid)]
    dump = first.run(dump_argv, timeout_s=120)
    assert dump.returncode == 0, (first.host_path(images) / "dump.log").read_text()[-3000:]
    for name in ("work", "images"):
        shutil.copytree(first.host_path(f"{STATE}/{name}"), second.host_path(f"{STATE}/{name}"))
    first.terminate()
    restore_argv = [criu_bin, "restore", "-d", "-D", images, "-o", "restore.log", "-v4", "--pidfile", "restored.pid"]
    restore_argv += mount_options(second)
    restore = second.run(restore_argv, timeout_s=120)
    assert restore.returncode == 0, (second.host_path(images) / "restore.log").read_text()[-3000:]
    assert (second.host_path(images) / "restored.pid").read_text().strip()

    # Then the listener answers again there and its state carried over
    assert in_vm(second, [sys.executable, "-c", ASK, str(PORT)], "asking the restored job") == "2"


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
