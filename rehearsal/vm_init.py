"""PID 1 of a local VM: bind the VM's private directories, give it empty temp dirs, boot, reap orphans.

Usage (inside `unshare --mount --pid --net --uts --fork --mount-proc`):
    python -m rehearsal.vm_init VM-DIR LIFELINE-FD SRC=DST ... [-- BOOT-COMMAND ...] [-- NEXT-COMMAND ...]
The VM ends when LIFELINE-FD (the read end of a pipe the host holds) reads end-of-file.
It writes VM-DIR/ready once its mounts are made, then waits for VM-DIR/go (the host has set up the
network; the file holds the VM's address). Boot commands run in order; each must succeed before the
next starts; the last one is left running.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from spotcr_agent.mounts import unescape

AGENT = "/opt/spotcr/bin/spotcr-agent"
DEFAULT_BOOT = [[AGENT, "bootstrap"], [AGENT, "daemon"]]
# What a fresh instance has empty: nothing there may come from the host or from another VM.
EMPTY_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # noqa: S108 (mount points, not temp files)
GO_TIMEOUT_S = 30
# The host's own mounts below these come and go (other tests' volumes, `ip netns` handles): no VM has them.
HOST_ONLY = (*EMPTY_DIRS, "/run")
STATE = "/var/lib/spotcr"
STATE_SOURCE = "spotcr-state-"  # the source of each VM's own file system for STATE (rehearsal.vm), + a PID in hex


def drop_host_mounts() -> None:
    """Unmount (in the VM's namespace only) what the host has mounted below HOST_ONLY, and every VM's own file
    system but at this VM's STATE.

    A job's mount namespace is dumped with every mount the VM has; a host mount that is gone when
    the backup boots could not be found there at restore, and an EC2 instance never had it. Another
    VM's disk is never an EC2 instance's: seen at its host path, CRIU would restore a job's nested
    mount namespace from the interrupted VM's files, still there while that VM runs.
    """
    points = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            point = unescape(fields[4])
            source = fields[fields.index("-") + 2]
            other_vm = source.startswith(STATE_SOURCE) and point != STATE and not point.startswith(f"{STATE}/")
            if other_vm or any(point.startswith(f"{top}/") for top in HOST_ONLY):
                points.append(point)
    for point in reversed(points):  # the last mounted first: children and stacked mounts before what they cover
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)


def parse(argv: list[str]) -> tuple[list[str], list[list[str]]]:
    binds: list[str] = []
    commands: list[list[str]] = []
    for arg in argv:
        if arg == "--":
            commands.append([])
        elif commands:
            commands[-1].append(arg)
        else:
            binds.append(arg)
    return binds, [c for c in commands if c] or DEFAULT_BOOT


def wait_for_network(vm_dir_fd: int) -> str | None:
    """The VM's address, once the host has written it to VM-DIR/go; None if it never does."""
    deadline = time.monotonic() + GO_TIMEOUT_S
    while True:
        try:
            go = os.open("go", os.O_RDONLY, dir_fd=vm_dir_fd)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
            continue
        address = os.read(go, 100).decode().strip()
        os.close(go)
        return address


def watch_lifeline(fd: int) -> None:
    """End the VM (PID 1 exiting kills its namespace) once the process that booted it is gone."""
    os.set_inheritable(fd, False)  # no boot command or job may hold it: CRIU would meet a pipe to the host

    def watch() -> None:
        while os.read(fd, 1):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def main(argv: list[str]) -> int:
    vm_dir, (binds, steps) = argv[0], parse(argv[2:])
    watch_lifeline(int(argv[1]))
    for bind in binds:
        source, target = bind.split("=", 1)
        subprocess.run(["mount", "--bind", source, target], check=True)
    # VM-DIR may be under the host's /tmp, which the mounts below hide: keep a handle on it.
    vm_dir_fd = os.open(vm_dir, os.O_RDONLY | os.O_DIRECTORY)
    drop_host_mounts()
    for path in EMPTY_DIRS:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", path], check=True)
    ready = os.open("ready", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=vm_dir_fd)
    os.write(ready, f"{os.getpid()}\n".encode())
    os.close(ready)
    address = wait_for_network(vm_dir_fd)
    os.close(vm_dir_fd)
    if address is None:
        print("vm-init: the host did not set up the network", flush=True)
        return 1
    socket.sethostname(f"ip-{address.replace('.', '-')}")  # as EC2 names instances
    print(f"vm-init: address {address}", flush=True)
    for index, command in enumerate(steps):
        print(f"vm-init: {' '.join(command)}", flush=True)
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        if index < len(steps) - 1 and process.wait() != 0:
            print(f"vm-init: {command[-1]} failed with {process.returncode}; VM stays up", flush=True)
            break
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
