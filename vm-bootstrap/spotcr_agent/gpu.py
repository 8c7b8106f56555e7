"""GPU jobs: which processes of the job hold an NVIDIA GPU, whether CRIU's CUDA plugin can checkpoint them here,
and what a checkpoint records about the GPUs (model, count, driver) for a restore to compare with its machine.

The plugin (cuda_plugin.so, built with CRIU by install-criu.sh) suspends CUDA in each GPU process before CRIU
dumps it: it waits for submitted work, copies device memory into the process's host memory and releases the GPU;
after a restore it resumes them. The images hold the device memory, so a dump grows by what the job holds there.
Limits (NVIDIA's and CRIU's documentation): x86-64 only; no MIG, MPS, UVM managed memory or CUDA IPC memory; the
restore needs the same GPU model and count. The first two are refused here; the last two cannot be seen from /proc
(every CUDA process maps /dev/nvidia-uvm), so the plugin fails the dump and criu.explain() names the limits.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

PLUGIN = "cuda_plugin.so"
# Where install-criu.sh (developer machines, CI: PREFIX/lib/criu) and the VM artifact (/opt/spotcr/criu/lib/criu,
# beside the criu binary) put the plugin. Not CRIU's compiled-in /usr/lib/criu: CRIU would load it for every job.
PLUGIN_DIRS = (Path("/usr/local/lib/criu"),)
OLDEST_DRIVER = 550  # CUDA's checkpoint support begins with r550
DRIVER_API_FROM = 580  # from r580 the plugin calls the driver's checkpoint API; r550-r570 need cuda-checkpoint
CUDA_CHECKPOINT = "cuda-checkpoint"
NVIDIA_SMI = "nvidia-smi"
X86_64 = "x86_64"
MIB = 1 << 20
_CAPS_PREFIX = "/dev/nvidia-caps/nvidia-cap"
# The device files a GPU process holds: /dev/nvidia0..N (the GPUs), nvidiactl, nvidia-uvm, nvidia-caps/* (MIG).
_NVIDIA_PATH = re.compile(r"^/dev/nvidia(?:\d+|ctl|-uvm|-uvm-tools|-modeset|-caps/\S+)$")
_GPU_PATH = re.compile(r"^/dev/nvidia(\d+)$")
_DRIVER = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+)\.(\d+)(?:\.(\d+))?")
_MPS_COMM = "nvidia-cuda-mps"  # nvidia-cuda-mps-control and -server, as /proc/<pid>/comm cuts them to 15 characters


class GpuUnsupported(RuntimeError):
    """The job holds a GPU that CRIU's CUDA plugin cannot checkpoint or restore here; the message says why."""


@dataclass(frozen=True)
class Machine:
    """This machine's NVIDIA GPUs and driver: what a checkpoint records and a restore compares."""

    model: str  # e.g. "NVIDIA H100 80GB HBM3"; "" without a GPU
    count: int
    driver: str  # e.g. "580.159.04"; "" without a loaded driver
    mig: bool = False  # MIG mode enabled on any GPU (nvidia-smi)
    arch: str = X86_64

    @property
    def driver_major(self) -> int:
        return int(self.driver.split(".")[0]) if self.driver else 0


@dataclass(frozen=True)
class JobGpus:
    """What the job holds on the GPU at a dump, and where CRIU finds the plugin that suspends it."""

    machine: Machine
    pids: tuple[int, ...]  # the job's processes that hold an NVIDIA device
    devices: tuple[int, ...]  # the GPUs they hold (/dev/nvidiaN)
    device_memory_bytes: int | None  # None: nvidia-smi is not installed, so unknown
    plugin_dir: Path

    def record(self) -> dict[str, Any]:
        """The checkpoint's record (manifest field `gpu`): a restore needs this model, count and driver."""
        return {
            "model": self.machine.model,
            "count": self.machine.count,
            "driver": self.machine.driver,
            "devices": list(self.devices),
            "processes": len(self.pids),
            "device_memory_bytes": self.device_memory_bytes,
        }


def criu_options(plugin_dir: Path | None) -> list[str]:
    """CRIU's options for a job: the CUDA plugin's directory when it holds a GPU, nothing otherwise."""
    return ["--libdir", str(plugin_dir)] if plugin_dir is not None else []


def read_driver(proc: Path = Path("/proc")) -> str:
    """The loaded NVIDIA kernel module's version (e.g. '580.159.04'); '' when no NVIDIA driver is loaded."""
    try:
        text = (proc / "driver/nvidia/version").read_text()
    except OSError:
        return ""
    match = _DRIVER.search(text)
    return ".".join(part for part in match.groups() if part is not None) if match else ""


def _gpu_models(proc: Path) -> list[str]:
    """One model name per GPU the driver sees (/proc/driver/nvidia/gpus/<bus id>/information)."""
    models = []
    for info in sorted((proc / "driver/nvidia/gpus").glob("*/information")):
        try:
            lines = info.read_text().splitlines()
        except OSError:
            continue
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model:")), "")
        models.append(model or "unknown NVIDIA GPU")
    return models


def nvidia_smi(args: list[str], path: str | None = None) -> str | None:
    """nvidia-smi's output, or None when it is not installed (a driver without its utilities)."""
    binary = shutil.which(NVIDIA_SMI, path=path)
    if binary is None:
        return None
    result = subprocess.run([binary, *args], capture_output=True, text=True, check=False, timeout=60)
    if result.returncode != 0:
        raise GpuUnsupported(f"nvidia-smi {' '.join(args)} failed: {(result.stderr or result.stdout).strip()[:300]}")
    return result.stdout


def _csv(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split(",")] for line in text.splitlines() if line.strip()]


def read_machine(proc: Path = Path("/proc"), path: str | None = None, arch: str | None = None) -> Machine:
    """This machine's GPUs (from the driver's /proc files) and whether MIG is on (nvidia-smi, when installed)."""
    models = _gpu_models(proc)
    driver = read_driver(proc)
    mig = False
    if driver and models:
        out = nvidia_smi(["--query-gpu=name,mig.mode.current", "--format=csv,noheader"], path)
        mig = out is not None and any(row[-1] == "Enabled" for row in _csv(out))
    distinct = sorted(set(models))
    return Machine(
        model=" + ".join(distinct),
        count=len(models),
        driver=driver,
        mig=mig,
        arch=arch or platform.machine(),
    )


def nvidia_files(pid: int, proc: Path = Path("/proc")) -> set[str]:
    """The NVIDIA device files a process holds open or mapped."""
    held: set[str] = set()
    try:
        for fd in (proc / str(pid) / "fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if _NVIDIA_PATH.match(target):
                held.add(target)
    except OSError:
        return held
    try:
        maps = (proc / str(pid) / "maps").read_text()
    except OSError:
        return held
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and _NVIDIA_PATH.match(parts[5].strip()):
            held.add(parts[5].strip())
    return held


def gpu_holders(pids: Iterable[int], proc: Path = Path("/proc")) -> dict[int, set[str]]:
    """The processes among `pids` that hold an NVIDIA device, with the device files each holds."""
    holders = {}
    for pid in pids:
        files = nvidia_files(pid, proc)
        if files:
            holders[pid] = files
    return holders


def _mig_instances(held: Iterable[str], proc: Path) -> list[str]:
    """The MIG instances among the held capability devices (/dev/nvidia-caps/nvidia-capN, N its minor).

    A plain CUDA process holds capability devices too (seen on driver 580 with MIG disabled), so a device counts
    only when the driver's table of minors names it as a GPU instance's (gpuG/giI/...). Without that table, any
    capability device is taken as MIG: refusing a dump is recoverable, a dump CRIU cannot restore is not.
    """
    minors = [name.removeprefix(_CAPS_PREFIX) for name in held if name.startswith(_CAPS_PREFIX)]
    if not minors:
        return []
    try:
        table = (proc / "driver/nvidia-caps/mig-minors").read_text()
    except OSError:
        return minors
    names = {minor: name for name, minor in (line.split() for line in table.splitlines() if len(line.split()) == 2)}
    return [names[minor] for minor in minors if "/gi" in names.get(minor, "")]


def _mps_processes(proc: Path) -> list[int]:
    found = []
    for comm in proc.glob("[0-9]*/comm"):
        try:
            if comm.read_text().startswith(_MPS_COMM):
                found.append(int(comm.parent.name))
        except (OSError, ValueError):
            continue
    return sorted(found)


def device_memory(pids: Iterable[int], path: str | None = None) -> int | None:
    """Device memory the processes hold (nvidia-smi's compute apps), in bytes; None without nvidia-smi."""
    out = nvidia_smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], path)
    if out is None:
        return None
    wanted = set(pids)
    total = 0
    for row in _csv(out):
        if len(row) >= 2 and row[0].isdigit() and int(row[0]) in wanted and row[1].isdigit():
            total += int(row[1]) * MIB
    return total


def plugin_dir(criu_binary: str = "criu", dirs: Iterable[Path] = PLUGIN_DIRS) -> Path | None:
    """The directory holding CRIU's CUDA plugin: beside the criu binary (the VM artifact), else install-criu.sh's."""
    found = shutil.which(criu_binary)
    candidates = [Path(found).resolve().parent.parent / "lib" / "criu"] if found else []
    for directory in [*candidates, *dirs]:
        if (directory / PLUGIN).is_file():
            return directory
    return None


def support_problem(machine: Machine, path: str | None = None) -> str | None:
    """Why CUDA checkpoints cannot work on this machine's architecture and driver; None when they can."""
    if machine.arch != X86_64:
        return f"CRIU's CUDA plugin supports x86-64 only; this machine is {machine.arch}"
    if not machine.driver:
        return "no NVIDIA driver is loaded (/proc/driver/nvidia/version is missing)"
    major = machine.driver_major
    if major < OLDEST_DRIVER:
        return (
            f"NVIDIA driver {machine.driver} is too old for CUDA checkpoints: r{OLDEST_DRIVER} or later is needed "
            f"(r{DRIVER_API_FROM} or later needs no {CUDA_CHECKPOINT})"
        )
    if major < DRIVER_API_FROM and shutil.which(CUDA_CHECKPOINT, path=path) is None:
        return (
            f"NVIDIA driver {machine.driver} (r{OLDEST_DRIVER} to r570) needs NVIDIA's {CUDA_CHECKPOINT} utility on "
            f"PATH for CUDA checkpoints; install it or use a driver of r{DRIVER_API_FROM} or later"
        )
    return None


def check_job(
    tree: Iterable[int],
    *,
    proc: Path = Path("/proc"),
    path: str | None = None,
    arch: str | None = None,
    criu_binary: str = "criu",
    plugin_dirs: Iterable[Path] = PLUGIN_DIRS,
) -> JobGpus | None:
    """Before a dump: None when no process of the job holds an NVIDIA GPU; else what it holds, or GpuUnsupported."""
    pids = list(tree)
    holders = gpu_holders(pids, proc)
    if not holders:
        return None
    machine = read_machine(proc, path, arch)
    held = set().union(*holders.values())
    problem = support_problem(machine, path)
    if problem:
        raise GpuUnsupported(f"the job holds an NVIDIA GPU, but {problem}")
    if machine.mig or _mig_instances(held, proc):
        raise GpuUnsupported("the job uses a MIG GPU instance; CUDA checkpoints do not support MIG")
    mps = _mps_processes(proc)
    if mps:
        raise GpuUnsupported(
            f"the GPU is shared through MPS (nvidia-cuda-mps pid {', '.join(map(str, mps[:3]))}); "
            "CUDA checkpoints do not support MPS"
        )
    directory = plugin_dir(criu_binary, plugin_dirs)
    if directory is None:
        raise GpuUnsupported(
            f"the job holds an NVIDIA GPU and CRIU's CUDA plugin ({PLUGIN}) is not installed beside {criu_binary} "
            f"or in {', '.join(map(str, plugin_dirs))}; run vm-bootstrap/install-criu.sh"
        )
    devices = sorted({int(m.group(1)) for name in held if (m := _GPU_PATH.match(name))})
    return JobGpus(
        machine=machine,
        pids=tuple(sorted(holders)),
        devices=tuple(devices),
        device_memory_bytes=device_memory(holders, path),
        plugin_dir=directory,
    )


def restore_problem(recorded: Mapping[str, Any], machine: Machine, path: str | None = None) -> str | None:
    """Why this machine cannot restore a checkpoint holding GPU state (`recorded`: JobGpus.record()); None if it can."""
    wanted = f"{recorded['count']} x {recorded['model']}"
    if machine.count == 0:
        return f"the checkpoint holds GPU state of {wanted}; this machine has no NVIDIA GPU"
    here = f"{machine.count} x {machine.model}"
    if (machine.model, machine.count) != (recorded["model"], recorded["count"]):
        return f"the checkpoint holds GPU state of {wanted}; this machine has {here} (needs the same model and count)"
    if machine.driver != recorded["driver"]:
        return (
            f"the job ran on NVIDIA driver {recorded['driver']} and this machine has {machine.driver or 'none'}; "
            "the job has the driver's own library mapped (launch the backup from the same image)"
        )
    problem = support_problem(machine, path)
    if problem:
        return f"the checkpoint holds GPU state, but {problem}"
    if machine.mig:
        return "the checkpoint holds GPU state and MIG is enabled here; CUDA checkpoints do not support MIG"
    return None


class _Criu(Protocol):
    binary: str


def for_dump(tree: list[int], criu: _Criu) -> JobGpus | None:
    """check_job on this machine's /proc: the Checkpointer's default (CRIU's binary is read only for a GPU job)."""
    if not gpu_holders(tree):
        return None
    return check_job(tree, criu_binary=criu.binary)
