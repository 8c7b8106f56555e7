"""Whether a running job holds what a workload is about: `python -m tests.workloads.probe STATE_DIR CHECK ...`.

Runs inside the job's VM (its /proc); prints one JSON line {"held": {check: detail or null}}. Checks:
  maps:PREFIX         a process maps a file whose path starts with PREFIX
  open:PREFIX         a process has a file open whose path starts with PREFIX
  unlinked:DIR:BYTES  a process holds an unlinked file under DIR of at least BYTES
  spilled:DIR:PREFIX  DIR (as the job sees it) holds entries named PREFIX...
  threads:N           a process of the job has at least N threads
  processes:NAME:N    at least N processes of the job have a name starting with NAME
  tcp:PORT            an established TCP connection from or to PORT in the job's network namespace
  tcp-vm:PORT         the same, on the VM's own address (not loopback)
  listen-vm:          a process of the job listens on the VM's own address (not loopback, not all addresses)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from spotcr_agent.runner import process_tree
from spotcr_agent.state import StateFile

ESTABLISHED, LISTEN = "01", "0A"
LOOPBACK_OR_ANY = ("0100007F", "00000000", "00000000000000000000000001000000", "00000000000000000000000000000000")


def _links(pid: int) -> list[tuple[str, Path]]:
    found = []
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []
    for fd in fds:
        try:
            found.append((os.readlink(fd), fd))
        except OSError:
            continue
    return found


def _check(tree: list[int], check: str) -> str | None:
    kind, _, arg = check.partition(":")
    for pid in tree:
        proc = Path(f"/proc/{pid}")
        try:
            if kind == "maps":
                for line in (proc / "maps").read_text().splitlines():
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(arg):
                        return f"{pid} maps {fields[5]}"
            elif kind == "open":
                for target, _ in _links(pid):
                    if target.startswith(arg):
                        return f"{pid} holds {target}"
            elif kind == "unlinked":
                directory, size = arg.rsplit(":", 1)
                for target, fd in _links(pid):
                    unlinked = target.startswith(directory + "/") and target.endswith(" (deleted)")
                    if unlinked and fd.stat().st_size >= int(size):
                        return f"{pid} holds {target} of {fd.stat().st_size} bytes"
            elif kind == "spilled":
                directory, prefix = arg.split(":", 1)
                names = sorted(n for n in os.listdir(f"{proc}/root{directory}") if n.startswith(prefix))
                if names:
                    return f"{directory} holds {', '.join(names[:4])}"
            elif kind == "threads":
                threads = len(os.listdir(proc / "task"))
                if threads >= int(arg):
                    return f"{pid} runs {threads} threads"
            elif kind == "processes":
                name, count = arg.split(":", 1)
                named = [p for p in tree if Path(f"/proc/{p}/comm").read_text().startswith(name)]
                return f"{len(named)} processes named {name}" if len(named) >= int(count) else None
            elif kind in ("tcp", "tcp-vm"):
                for table in ("tcp", "tcp6"):
                    for line in (proc / "net" / table).read_text().splitlines()[1:]:
                        local, remote, state = line.split()[1:4]
                        ports = {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)}
                        on_loopback = local.startswith(("0100007F", "00000000000000000000000001000000"))
                        if state == ESTABLISHED and int(arg) in ports and not (kind == "tcp-vm" and on_loopback):
                            return f"established {local} {remote}"
            elif kind == "listen-vm":
                sockets = {target[8:-1] for target, _ in _links(pid) if target.startswith("socket:[")}
                for table in ("tcp", "tcp6"):
                    for line in (proc / "net" / table).read_text().splitlines()[1:]:
                        fields = line.split()
                        local, state, inode = fields[1], fields[3], fields[9]
                        if state == LISTEN and inode in sockets and local.rsplit(":", 1)[0] not in LOOPBACK_OR_ANY:
                            return f"{pid} listens on {local}"
            else:
                raise SystemExit(f"unknown check {check!r}")
        except (OSError, ValueError):
            continue
    return None


def main(state_dir: str, *checks: str) -> dict[str, str | None]:
    tree = process_tree(StateFile(Path(state_dir)).read().job_pid)
    return {check: _check(tree, check) for check in checks}


if __name__ == "__main__":
    print(json.dumps({"held": main(*sys.argv[1:])}))
