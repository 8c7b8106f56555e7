"""GPU jobs: final dump and restore seconds and bytes against the device memory the job holds.

`python -m bench gpu [--mib 1024 4096 16384] [--notice 120]`: on this host, with the real agent, CRIU and its CUDA
plugin, a CUDA job (tests/agent/jobs/gpu_train.py: PyTorch where SPOTCR_GPU_PYTHON or /opt/torch/.venv has it,
else the CUDA driver API through ctypes) holding each amount of device memory is final-dumped into a directory
store and restored. Prints the figures, fits dump seconds to device memory, and reports the largest device memory
whose final dump fits the notice. Writes bench/results/gpu.json and gpu.md. Refuses without an NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from spotcr_agent import gpu
from spotcr_agent.agent import Agent, base_job_env
from spotcr_agent.config import AgentConfig
from spotcr_agent.store import CheckpointStore

REPO = Path(__file__).resolve().parent.parent
GPU_JOB = REPO / "tests" / "agent" / "jobs" / "gpu_train.py"
TORCH_PYTHON = Path("/opt/torch/.venv/bin/python")
RESULTS = Path(__file__).with_name("results")
NOTICE_S = 120  # EC2's spot interruption notice
MIB = 1 << 20


def gpu_python() -> str:
    """The interpreter for the GPU job: SPOTCR_GPU_PYTHON, else the GPU machine's PyTorch, else this one."""
    chosen = os.environ.get("SPOTCR_GPU_PYTHON")
    if chosen:
        return chosen
    return str(TORCH_PYTHON) if TORCH_PYTHON.exists() else sys.executable


def gpu_command(steps: int, step_s: float, mib: int) -> tuple[str, ...]:
    return (gpu_python(), str(GPU_JOB), str(steps), str(step_s), str(mib))


class _Quiet:
    def publish(self, event: object) -> bool:
        return True


def host_agent(root: Path, store: CheckpointStore, command: tuple[str, ...], generation: int, mode: str) -> Agent:
    """The agent for a job on this host (no VM), its work dir and state under `root`, its checkpoints in `store`."""
    config = AgentConfig(
        job_id=store.job_id,
        instance_id="i-bench",
        storage="efs",
        generation=generation,
        mode=mode,
        workdir=root / "work",
        state_dir=root / f"state-{generation}",
        mount_point=root / "store",
        command=command,
        local_dirs=(),  # the benchmark's job runs on this host, whose /tmp is everyone's, not a job VM's own
    )
    return Agent(config=config, publisher=_Quiet(), job_env=base_job_env(os.environ), store_factory=lambda _: store)


def wait_for_progress(workdir: Path, steps: int, timeout_s: float = 300) -> None:
    """Wait until the GPU job in `workdir` has logged `steps` steps (its start includes CUDA's, seconds)."""
    progress = workdir / "progress.log"
    deadline = time.monotonic() + timeout_s
    while not (progress.exists() and len(progress.read_text().splitlines()) >= steps):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the GPU job in {workdir} logged fewer than {steps} steps in {timeout_s:.0f} s")
        time.sleep(0.1)


def _one(root: Path, mib: int) -> dict[str, float]:
    (root / "store").mkdir(parents=True)
    store = CheckpointStore.for_directory(root / "store", f"gpu-{mib}")
    command = gpu_command(1_000_000, 0.05, mib)
    primary = host_agent(root, store, command, 1, "run")
    primary.start_job()
    wait_for_progress(root / "work", 5)
    dumped = primary.checkpoint("final", 1)
    restored = host_agent(root, store, command, 2, "restore").restore(2)
    os.kill(restored.pid, signal.SIGKILL)
    return {
        "device_mib": mib,
        "device_memory_bytes": dumped.gpu_memory_bytes or 0,
        "final_dump_seconds": dumped.seconds,
        "frozen_seconds": dumped.frozen_seconds,
        "checkpoint_bytes": dumped.bytes_total,
        "restore_seconds": restored.seconds,
    }


def largest_fitting(rows: list[dict[str, float]], notice_s: float) -> float | None:
    """Device memory (bytes) whose final dump takes notice_s by a least-squares line; None with fewer than 2 sizes."""
    points = [(r["device_memory_bytes"], r["final_dump_seconds"]) for r in rows]
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    if slope <= 0:
        return None
    return max(0.0, (notice_s - (mean_y - slope * mean_x)) / slope)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__)
    parser.add_argument("--mib", type=int, nargs="+", default=[1024, 4096, 16384], help="device memory sizes")
    parser.add_argument("--notice", type=float, default=NOTICE_S, help="seconds the final dump may take")
    args = parser.parse_args(argv)
    machine = gpu.read_machine()
    if machine.count == 0:
        print("bench gpu: no NVIDIA GPU on this machine (no /proc/driver/nvidia/gpus)", file=sys.stderr)
        return 2
    problem = gpu.support_problem(machine) or (None if gpu.plugin_dir() else f"{gpu.PLUGIN} is not installed")
    if problem:
        print(f"bench gpu: CUDA checkpoints cannot work here: {problem}", file=sys.stderr)
        return 2
    rows = []
    for mib in args.mib:
        with tempfile.TemporaryDirectory(prefix="spotcr-bench-gpu-", dir="/var/tmp") as root:
            row = _one(Path(root), mib)
        rows.append(row)
        print(
            f"{mib:>6} MiB on the GPU: final dump {row['final_dump_seconds']:.2f} s "
            f"({row['checkpoint_bytes'] / 1e9:.2f} GB), restore {row['restore_seconds']:.2f} s"
        )
    fits = largest_fitting(rows, args.notice)
    summary = f"{fits / (1 << 30):.1f} GiB" if fits is not None else "unknown (needs two sizes)"
    print(f"largest device memory whose final dump fits {args.notice:.0f} s: {summary}")
    result = {
        "gpu": f"{machine.count} x {machine.model}",
        "driver": machine.driver,
        "job_python": gpu_python(),  # with PyTorch the job trains a model, without it uses the driver API
        "notice_seconds": args.notice,
        "rows": rows,
        "largest_device_memory_bytes_fitting_notice": fits,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# GPU jobs: {result['gpu']}, driver {machine.driver}",
        "",
        "| device memory | final dump | checkpoint | restore |",
        "|---|---|---|---|",
        *(
            f"| {r['device_mib']} MiB | {r['final_dump_seconds']:.2f} s | {r['checkpoint_bytes'] / 1e9:.2f} GB "
            f"| {r['restore_seconds']:.2f} s |"
            for r in rows
        ),
        "",
        f"Largest device memory whose final dump fits {args.notice:.0f} s: {summary}.",
    ]
    (RESULTS / "gpu.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
