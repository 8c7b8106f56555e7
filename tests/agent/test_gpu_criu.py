"""make test-gpu: a real CUDA job through the agent's checkpoint and restore, with the real CRIU and its CUDA plugin.

Each VM is a bare local VM (rehearsal.vm): the host's /dev (the GPU's device nodes) and a /proc of its own, which
shows the NVIDIA driver's files as any procfs does. The job (tests/agent/jobs/gpu_train.py) runs with PyTorch
where SPOTCR_GPU_PYTHON (default /opt/torch/.venv/bin/python, else this interpreter) has it, else with the CUDA
driver API through ctypes. Marked `gpu`: plain `make test` leaves it out; on a machine without an NVIDIA GPU it fails,
saying so, rather than skip.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from spotcr_agent import gpu

from bench.gpu import gpu_command
from tests.support import wait_for

from .vm_agent import JobVM, reference_output

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("criu_available", "nvidia_gpu")]
RESULTS = Path(__file__).parents[2] / "bench" / "results" / "gpu_test.json"


@pytest.fixture(scope="module")
def nvidia_gpu() -> gpu.Machine:
    machine = gpu.read_machine()
    if machine.count == 0:
        pytest.fail("no NVIDIA GPU on this machine (no /proc/driver/nvidia/gpus): make test-gpu needs one")
    problem = gpu.support_problem(machine)
    if problem:
        pytest.fail(f"CUDA checkpoints cannot work here: {problem}")
    if gpu.plugin_dir() is None:
        pytest.fail(f"CRIU's CUDA plugin ({gpu.PLUGIN}) is not installed: run `make criu`")
    return machine


@pytest.mark.parametrize("kind", ["periodic", "final"])
def test_a_cuda_job_restores_with_the_result_of_an_uninterrupted_run(bare_vm, storage, nvidia_gpu, kind):
    mib, steps = 1024, 60
    expected = reference_output(bare_vm, gpu_command(steps, 0, mib))
    # Given a CUDA job holding about 1 GiB of device memory on the primary VM
    primary = JobVM(bare_vm(shared_storage=storage), command=gpu_command(steps, 0.2, mib))
    primary.agent("start")
    wait_for(lambda: len(primary.progress()) >= 10, timeout=120, what="progress on the GPU")

    # When it is checkpointed (with the CUDA plugin), its VM is lost, and another VM restores it
    started = time.monotonic()
    outcome = primary.agent("checkpoint", kind, "1")
    checkpoint_s = time.monotonic() - started
    primary.vm.terminate()
    backup = JobVM(bare_vm(shared_storage=storage), generation=2, mode="restore")
    started = time.monotonic()
    restored = backup.agent("restore", "2")
    restore_s = time.monotonic() - started

    # Then the job ends on the backup with the same progress and final state as an uninterrupted run
    assert restored["checkpoint_id"] == outcome["checkpoint_id"]
    assert backup.agent("wait-exit", "300")["exit_code"] == 0
    progress, stdout = expected
    assert (backup.workdir / "progress.log").read_text() == progress
    assert (backup.workdir / ".spotcr" / "stdout.log").read_text() == stdout
    _record(kind, nvidia_gpu, outcome, checkpoint_s, restore_s, stdout)  # the figures, also if what follows fails
    # And the checkpoint counted the device memory the job holds
    assert outcome["gpu_memory_bytes"] is not None and outcome["gpu_memory_bytes"] >= mib << 20
    assert outcome["bytes_total"] >= outcome["gpu_memory_bytes"]


def _record(kind, machine, outcome, checkpoint_s, restore_s, stdout) -> None:
    figures = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    figures[kind] = {
        "gpu": f"{machine.count} x {machine.model}",
        "driver": machine.driver,
        "job": stdout.split()[0],  # weights (PyTorch) or device (ctypes)
        "device_memory_bytes": outcome["gpu_memory_bytes"],
        "checkpoint_bytes": outcome["bytes_total"],
        "checkpoint_seconds": round(checkpoint_s, 2),
        "frozen_seconds": outcome["frozen_seconds"],
        "restore_seconds": round(restore_s, 2),
        "result": "same as an uninterrupted run",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n")
