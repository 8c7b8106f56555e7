"""A job sees a /proc of its own PID namespace, before and after CRIU moves it to another bare VM; its IPC goes too."""

import json
import shutil
import sys

import pytest

from tests.support import wait_for

pytestmark = pytest.mark.criu

# Each step: what the job reads about itself from /proc, where it runs, and a counter it keeps in
# System V shared memory (as MPI's shared-memory transport does), which lives in the job's IPC namespace.
JOB = """
import ctypes, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
segment = libc.shmget(0, 4096, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
counter = ctypes.c_long.from_address(libc.shmat(segment, None, 0))
while not os.path.exists("stop"):
    pid = os.getpid()
    with open("/proc/self/stat") as stat:
        self_pid = int(stat.read().split()[0])
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status.read().splitlines())
    counter.value += 1
    line = [pid, self_pid, int(fields["Pid"]), fields["Name"].strip(), socket.gethostname(), counter.value]
    with open("proc.log", "a") as log:
        log.write(" ".join(map(str, line)) + "\\n")
    time.sleep(0.1)
"""

START = """
import json, os, sys
from pathlib import Path
from spotcr_agent.runner import start_job
job = start_job((sys.executable, "job.py"), Path("/var/lib/spotcr/work"), dict(os.environ))
print(json.dumps({"pid": job.pid}))
"""

DUMP = """
import sys
from pathlib import Path
from spotcr_agent.criu import Criu
Criu().dump(int(sys.argv[1]), Path("/var/lib/spotcr/images"), Path("/var/lib/spotcr/logs"), leave_running=False)
"""

RESTORE = """
from pathlib import Path
from spotcr_agent.criu import Criu
print(Criu().restore(Path("/var/lib/spotcr/images"), Path("/var/lib/spotcr/logs")))
"""


def python(vm, script, *args):
    result = vm.run([sys.executable, "-c", script, *args], timeout_s=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def lines(path):
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_a_job_reads_its_own_proc_entry_before_and_after_a_restore_on_another_vm(bare_vm, criu_bin):
    # Given a job on VM A that records what /proc says about itself
    first, second = bare_vm(), bare_vm()
    work_a = first.host_path("/var/lib/spotcr/work")
    work_a.mkdir(parents=True)
    (work_a / "job.py").write_text(JOB)
    pid = json.loads(python(first, START))["pid"]
    wait_for(lambda: len(lines(work_a / "proc.log")) >= 3)
    # When it is dumped there, its work dir and images carried over, and it is restored on VM B
    python(first, DUMP, str(pid))
    before = lines(work_a / "proc.log")
    for name in ("work", "images"):
        shutil.copytree(first.host_path(f"/var/lib/spotcr/{name}"), second.host_path(f"/var/lib/spotcr/{name}"))
    python(second, RESTORE)
    work_b = second.host_path("/var/lib/spotcr/work")
    wait_for(lambda: len(lines(work_b / "proc.log")) >= len(before) + 3)
    (work_b / "stop").touch()
    wait_for((work_b / ".spotcr" / "exit-code").exists)
    # Then on both VMs, getpid(), /proc/self and /proc/<getpid()> all name the job itself
    records = lines(work_b / "proc.log")
    hosts = {record[4] for record in records}
    assert hosts == {f"ip-{vm.address.replace('.', '-')}" for vm in (first, second)}, records
    for record in records:
        assert record[0] == record[1] == record[2], record
        assert record[3].startswith("python"), record
    # And its System V shared memory came along: the counter goes on from where it was
    assert [int(record[5]) for record in records] == list(range(1, len(records) + 1))
    assert (work_b / ".spotcr" / "exit-code").read_text().split() == ["0"]
    assert "Traceback" not in (work_b / ".spotcr" / "stderr.log").read_text()
