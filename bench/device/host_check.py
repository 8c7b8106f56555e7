"""Where bare local VMs cannot run: `make test-gpu`'s check on this host, through the same agent code.

`python bench/device/host_check.py [--mib 1024] [--steps 60]`: for a periodic and a final checkpoint, the CUDA job
(tests/agent/jobs/gpu_train.py) runs under the agent on this host, is checkpointed with CRIU's CUDA plugin, loses
its work dir and process (as a lost VM would), is restored by a second agent (generation 2) and runs to its end;
its progress log and output must equal an uninterrupted run's. Unlike the test, primary and backup share this
host's /tmp, address and root file system. Prints one line per kind and writes bench/results/gpu-host-check.json.
Exits 1 when a restored job's result differs, 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spotcr_agent import gpu
from spotcr_agent.store import CheckpointStore

from bench.gpu import RESULTS, gpu_command, host_agent, wait_for_progress

STDOUT = Path(".spotcr") / "stdout.log"  # where the agent keeps the job's output, in its work dir
SAME = "same as an uninterrupted run"


def reference(root: Path, command: tuple[str, ...]) -> tuple[str, str]:
    """(progress.log, stdout) of an uninterrupted run."""
    workdir = root / "reference"
    workdir.mkdir()
    run = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=300, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"the uninterrupted GPU job failed ({run.returncode}): {run.stderr[-2000:]}")
    return (workdir / "progress.log").read_text(), run.stdout


def _kill(pid: int) -> None:
    """End the job (the PID 1 of its namespace, so all of it), as a lost VM ends it."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def check(root: Path, kind: str, steps: int, mib: int, expected: tuple[str, str]) -> dict[str, object]:
    (root / "store").mkdir()
    store = CheckpointStore.for_directory(root / "store", f"gpu-check-{kind}")
    command = gpu_command(steps, 0.2, mib)
    primary = host_agent(root, store, command, 1, "run")
    pid = primary.start_job()
    if pid is None:
        raise RuntimeError(f"the GPU job did not start: see {root / 'work' / '.spotcr'}")
    wait_for_progress(root / "work", 10)
    started = time.monotonic()
    outcome = primary.checkpoint(kind, 1)
    checkpoint_s = time.monotonic() - started
    if Path(f"/proc/{pid}").exists():
        _kill(pid)  # a periodic dump leaves the job running
    shutil.rmtree(root / "work")
    backup = host_agent(root, store, command, 2, "restore")
    started = time.monotonic()
    restored = backup.restore(2)
    restore_s = time.monotonic() - started
    deadline = time.monotonic() + 300
    exit_code = None
    while exit_code is None and time.monotonic() < deadline:
        exit_code = backup.watch_job()
        time.sleep(0.05)
    progress, stdout = expected
    same = (
        exit_code == 0
        and restored.checkpoint_id == outcome.checkpoint_id
        and (root / "work" / "progress.log").read_text() == progress
        and (root / "work" / STDOUT).read_text() == stdout
    )
    return {
        "kind": kind,
        "checkpoint_id": outcome.checkpoint_id,
        "restored_checkpoint_id": restored.checkpoint_id,
        "exit_code": exit_code,
        "device_memory_bytes": outcome.gpu_memory_bytes,
        "checkpoint_bytes": outcome.bytes_total,
        "checkpoint_seconds": round(checkpoint_s, 2),
        "frozen_seconds": outcome.frozen_seconds,
        "restore_seconds": round(restore_s, 2),
        "result": SAME if same else "DIFFERS from an uninterrupted run",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="host_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="device memory the job holds")
    parser.add_argument("--steps", type=int, default=60, help="the job's steps")
    args = parser.parse_args(argv)
    machine = gpu.read_machine()
    problem = gpu.support_problem(machine) if machine.count else "no NVIDIA GPU on this machine"
    if problem or gpu.plugin_dir() is None:
        print(f"host_check: CUDA checkpoints cannot work here: {problem or gpu.PLUGIN + ' is not installed'}")
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="spotcr-gpu-check-", dir="/var/tmp") as tmp:
        expected = reference(Path(tmp), gpu_command(args.steps, 0, args.mib))
    for kind in ("periodic", "final"):
        with tempfile.TemporaryDirectory(prefix=f"spotcr-gpu-check-{kind}-", dir="/var/tmp") as tmp:
            row = check(Path(tmp), kind, args.steps, args.mib, expected)
        rows.append(row)
        print(json.dumps(row))
    result = {
        "where": "this host, without bare local VMs (bench/device/host_check.py)",
        "gpu": f"{machine.count} x {machine.model}",
        "driver": machine.driver,
        "job": expected[1].split()[0],  # weights (PyTorch) or device (ctypes)
        "rows": rows,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu-host-check.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(row["result"] == SAME for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
