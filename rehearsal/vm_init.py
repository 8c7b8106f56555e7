"""PID 1 of a local VM: bind the VM's private directories, boot the agent, reap orphans.

Usage (inside `unshare --mount --pid --fork --mount-proc`):
    python -m rehearsal.vm_init READY-FILE SRC=DST ... [-- BOOT-COMMAND ...] [-- NEXT-COMMAND ...]
Boot commands run in order; each must succeed before the next starts; the last one is left running.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

AGENT = "/opt/spotcr/bin/spotcr-agent"
DEFAULT_BOOT = [[AGENT, "bootstrap"], [AGENT, "daemon"]]


def main(argv: list[str]) -> int:
    ready, argv = argv[0], argv[1:]
    binds: list[str] = []
    commands: list[list[str]] = []
    for arg in argv:
        if arg == "--":
            commands.append([])
        elif commands:
            commands[-1].append(arg)
        else:
            binds.append(arg)
    for bind in binds:
        source, target = bind.split("=", 1)
        subprocess.run(["mount", "--bind", source, target], check=True)
    with open(ready, "w") as marker:
        marker.write(f"{os.getpid()}\n")
    steps = [c for c in commands if c] or DEFAULT_BOOT
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
