"""GPU jobs without a GPU: detection from a fake /proc and a fake nvidia-smi, the plugin's limits, CRIU's argv, the
manifest's GPU record and the restore's refusal before any image is downloaded. The GPU path itself: make test-gpu."""

import os
import re
import shutil
from collections.abc import Collection
from pathlib import Path

import pytest
from spotcr_agent import gpu
from spotcr_agent.criu import Criu, explain
from spotcr_agent.host import HostInfo
from spotcr_agent.restore import RestoreError, Restorer
from spotcr_agent.scratch import ScratchTooSmall, require_room
from spotcr_agent.state import StateFile
from spotcr_agent.store import CheckpointMeta, CheckpointStore, Manifest
from spotcr_agent.store.errors import CorruptCheckpoint

FIXTURES = Path(__file__).parent / "gpu_fixtures"
H100 = "NVIDIA H100 80GB HBM3"
DRIVER_580 = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)\n"
DRIVER_570 = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.172.08  Tue Jul  8 17:53:47 UTC 2025\n"
DRIVER_535 = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.247.01  Thu Apr 10 18:42:49 UTC 2025\n"
HOST = HostInfo(criu_version="4.1.1", kernel="6.1", arch="x86_64", cpu_flags=("sse2",))


class FakeMachine:
    """A fake /proc (the job's processes, the NVIDIA driver's files), a PATH with a fake nvidia-smi, a plugin dir."""

    def __init__(self, root: Path, *, driver: str = DRIVER_580, gpus: int = 1, model: str = H100) -> None:
        self.proc = root / "proc"
        self.bin = root / "bin"
        self.plugins = root / "lib" / "criu"
        self.bin.mkdir(parents=True)
        self.plugins.mkdir(parents=True)
        (self.plugins / gpu.PLUGIN).write_bytes(b"\x7fELF")
        shutil.copy(FIXTURES / "nvidia-smi", self.bin / "nvidia-smi")
        nvidia = self.proc / "driver" / "nvidia"
        nvidia.mkdir(parents=True)
        (nvidia / "version").write_text(driver)
        for index in range(gpus):
            info = nvidia / "gpus" / f"0000:{index + 0x18:02x}:00.0"
            info.mkdir(parents=True)
            (info / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 123\nBus Type: \t PCIe\n")
        self.smi(gpus=f"{model}, Disabled\n" * gpus, apps="")

    def mig_minors(self) -> None:
        """The driver's table of capability minors: config, monitor, then each GPU instance's and its compute's."""
        caps = self.proc / "driver" / "nvidia-caps"
        caps.mkdir(exist_ok=True)
        (caps / "mig-minors").write_text("config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi1/ci0/access 21\n")

    def smi(self, *, gpus: str | None = None, apps: str | None = None) -> None:
        if gpus is not None:
            (self.bin / "gpus.csv").write_text(gpus)
        if apps is not None:
            (self.bin / "apps.csv").write_text(apps)

    def process(
        self,
        pid: int,
        *,
        children: tuple[int, ...] = (),
        fds: tuple[str, ...] = (),
        maps: tuple[str, ...] = (),
        comm: str = "python3",
    ) -> None:
        task = self.proc / str(pid) / "task" / str(pid)
        task.mkdir(parents=True)
        (task / "children").write_text(" ".join(map(str, children)))
        (self.proc / str(pid) / "fd").mkdir()
        for number, target in enumerate(("/dev/null", *fds)):
            os.symlink(target, self.proc / str(pid) / "fd" / str(number))
        lines = ["55d0c0000000-55d0c0001000 r--p 00000000 08:01 42  /usr/bin/python3.12"]
        lines += [f"7f00{i:08x}000-7f00{i:08x}fff rw-s 00000000 00:05 7  {path}" for i, path in enumerate(maps)]
        (self.proc / str(pid) / "maps").write_text("\n".join(lines) + "\n")
        (self.proc / str(pid) / "comm").write_text(comm + "\n")

    def check(self, pid: int = 100, **options: object) -> gpu.JobGpus | None:
        from spotcr_agent.scratch import job_tree

        return gpu.check_job(
            job_tree(pid, self.proc),
            proc=self.proc,
            path=str(self.bin),
            arch=str(options.get("arch", "x86_64")),
            criu_binary="no-such-criu",
            plugin_dirs=(self.plugins,),
        )

    def machine(self) -> gpu.Machine:
        return gpu.read_machine(self.proc, str(self.bin), "x86_64")


@pytest.fixture
def machine(tmp_path):
    return FakeMachine(tmp_path / "machine")


def _training_job(machine: FakeMachine) -> None:
    """A launcher (100) whose child (101) trains on GPU 0: the device by fd, nvidiactl and the UVM device mapped."""
    machine.process(100, children=(101,), comm="bash")
    machine.process(101, fds=("/dev/nvidia0", "/dev/nvidiactl"), maps=("/dev/nvidiactl", "/dev/nvidia-uvm"))
    machine.smi(apps="101, 1950\n4242, 512\n")  # 4242: another user of the GPU, not the job


def test_a_job_without_a_gpu_dumps_and_restores_without_the_plugin(machine, tmp_path):
    # Given a job whose processes hold no NVIDIA device, on a machine that has one
    machine.process(100, children=(101,))
    machine.process(101)

    # When the agent checks it before a dump
    found = machine.check()

    # Then it is not a GPU job, and CRIU's argv loads no plugin
    assert found is None
    criu = Criu("criu")
    assert "--libdir" not in criu.dump_argv(100, tmp_path / "img", tmp_path / "log", leave_running=True)
    assert "--libdir" not in criu.restore_argv(tmp_path / "img", tmp_path / "log")


def test_a_gpu_job_is_found_with_its_device_memory_and_criu_loads_the_plugin(machine, tmp_path):
    # Given a job whose child holds GPU 0 and 1950 MiB of device memory
    _training_job(machine)

    # When the agent checks it before a dump
    found = machine.check()

    # Then the child is the GPU process, its device memory is counted, the plugin found, the GPU recorded
    assert found is not None
    assert found.pids == (101,)
    assert found.devices == (0,)
    assert found.device_memory_bytes == 1950 << 20
    assert found.plugin_dir == machine.plugins
    assert found.record() == {
        "model": H100,
        "count": 1,
        "driver": "580.159.04",
        "devices": [0],
        "processes": 1,
        "device_memory_bytes": 1950 << 20,
    }
    # And CRIU's dump and restore both load the plugin from its directory
    criu = Criu("criu")
    dump = criu.dump_argv(101, tmp_path / "img", tmp_path / "log", leave_running=False, libdir=found.plugin_dir)
    restore = criu.restore_argv(tmp_path / "img", tmp_path / "log", libdir=found.plugin_dir)
    for argv in (dump, restore):
        assert argv[argv.index("--libdir") + 1] == str(machine.plugins)


def test_without_nvidia_smi_the_device_memory_is_unknown_not_zero(machine):
    _training_job(machine)
    (machine.bin / "nvidia-smi").unlink()

    found = machine.check()

    assert found is not None
    assert found.device_memory_bytes is None
    assert found.machine.model == H100  # from the driver's own /proc files


@pytest.mark.parametrize(
    ("driver", "cuda_checkpoint", "refusal"),
    [
        (DRIVER_535, False, "NVIDIA driver 535.247.01 is too old for CUDA checkpoints: r550 or later"),
        (DRIVER_570, False, "NVIDIA driver 570.172.08 (r550 to r570) needs NVIDIA's cuda-checkpoint utility on PATH"),
        (DRIVER_570, True, None),
        (DRIVER_580, False, None),
    ],
)
def test_the_driver_decides_whether_cuda_checkpoint_is_needed(tmp_path, driver, cuda_checkpoint, refusal):
    machine = FakeMachine(tmp_path / "machine", driver=driver)
    _training_job(machine)
    if cuda_checkpoint:
        (machine.bin / "cuda-checkpoint").write_text("#!/bin/sh\n")
        (machine.bin / "cuda-checkpoint").chmod(0o755)

    if refusal is None:
        assert machine.check() is not None
    else:
        with pytest.raises(gpu.GpuUnsupported, match=refusal.replace("(", r"\(").replace(")", r"\)")):
            machine.check()


def test_the_driver_version_is_read_from_either_kernel_module(tmp_path):
    for text, version in ((DRIVER_580, "580.159.04"), (DRIVER_570, "570.172.08")):
        (tmp_path / "driver" / "nvidia").mkdir(parents=True, exist_ok=True)
        (tmp_path / "driver" / "nvidia" / "version").write_text(text)
        assert gpu.read_driver(tmp_path) == version
    assert gpu.read_driver(tmp_path / "none") == ""


def test_arm64_is_refused_with_the_reason(machine):
    _training_job(machine)
    with pytest.raises(gpu.GpuUnsupported, match="CUDA plugin supports x86-64 only; this machine is aarch64"):
        machine.check(arch="aarch64")


def test_mig_is_refused_whether_nvidia_smi_or_the_job_shows_it(machine):
    _training_job(machine)
    machine.smi(gpus=f"{H100}, Enabled\n")
    with pytest.raises(gpu.GpuUnsupported, match="MIG GPU instance; CUDA checkpoints do not support MIG"):
        machine.check()

    # Without nvidia-smi, a job holding a GPU instance's capability device gives it away, as does any
    # capability device where the driver's table of minors cannot be read
    (machine.bin / "nvidia-smi").unlink()
    machine.process(102, fds=("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap21"))
    with pytest.raises(gpu.GpuUnsupported, match="do not support MIG"):
        machine.check(102)
    machine.mig_minors()
    with pytest.raises(gpu.GpuUnsupported, match="do not support MIG"):
        machine.check(102)


def test_a_capability_device_that_is_no_gpu_instance_is_not_taken_for_mig(machine):
    # Seen on an H100 with driver 580 and MIG disabled: a PyTorch job holds a capability device, and CRIU's CUDA
    # plugin dumps it; the driver's table names that minor as no GPU instance's
    machine.process(100, fds=("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-caps/nvidia-cap2"))
    machine.mig_minors()
    found = machine.check()
    assert found is not None and found.devices == (0,)


def test_mps_is_refused_naming_its_daemon(machine):
    _training_job(machine)
    machine.process(900, comm="nvidia-cuda-mps")  # the kernel cuts nvidia-cuda-mps-control to 15 characters
    with pytest.raises(gpu.GpuUnsupported, match=r"shared through MPS \(nvidia-cuda-mps pid 900\)"):
        machine.check()


def test_a_gpu_job_without_the_plugin_installed_is_refused(machine):
    _training_job(machine)
    (machine.plugins / gpu.PLUGIN).unlink()
    with pytest.raises(gpu.GpuUnsupported, match=r"cuda_plugin.so\) is not installed .*install-criu.sh"):
        machine.check()


def test_the_plugin_is_found_beside_the_criu_binary_of_the_vm_artifact(tmp_path):
    # /opt/spotcr/criu/bin/criu and /opt/spotcr/criu/lib/criu/cuda_plugin.so, as install-artifact.sh lays them out
    criu = tmp_path / "criu" / "bin" / "criu"
    criu.parent.mkdir(parents=True)
    criu.write_text("#!/bin/sh\n")
    criu.chmod(0o755)
    plugins = tmp_path / "criu" / "lib" / "criu"
    plugins.mkdir(parents=True)
    assert gpu.plugin_dir(str(criu), dirs=()) is None
    (plugins / gpu.PLUGIN).write_bytes(b"\x7fELF")
    assert gpu.plugin_dir(str(criu), dirs=()) == plugins


def test_a_cuda_plugin_failure_in_criu_log_is_explained():
    log = "(00.5) Error (criu/plugin.c:240): cuda_plugin: PAUSE_DEVICES failed with 2 for pid 101\n"
    assert explain(log).startswith("CRIU's CUDA plugin could not checkpoint the job's GPU state (UVM managed memory")


def test_device_memory_counts_in_the_room_a_dump_needs(tmp_path):
    # Given scratch with 3 GiB free and a job with 1 GiB in host memory
    def estimate(pid, workdir):
        return 1 << 30

    def free(path):
        return 3 << 30

    # When the job holds 1 GiB on the GPU it fits; with 2 GiB on the GPU it does not, and the refusal says so
    require_room(tmp_path, 1, estimate=estimate, free=free, gpu_bytes=1 << 30)
    with pytest.raises(ScratchTooSmall, match="the job's memory, GPU memory and work dir"):
        require_room(tmp_path, 1, estimate=estimate, free=free, gpu_bytes=2 << 30)


RECORD = {"model": H100, "count": 1, "driver": "580.159.04", "devices": [0], "processes": 1, "device_memory_bytes": 1}


@pytest.mark.parametrize(
    ("gpus", "model", "driver", "refusal"),
    [
        (0, H100, DRIVER_580, "holds GPU state of 1 x NVIDIA H100 80GB HBM3; this machine has no NVIDIA GPU"),
        (1, "NVIDIA A10G", DRIVER_580, "this machine has 1 x NVIDIA A10G \\(needs the same model and count\\)"),
        (2, H100, DRIVER_580, "this machine has 2 x NVIDIA H100 80GB HBM3 \\(needs the same model and count\\)"),
        (1, H100, DRIVER_570, "ran on NVIDIA driver 580.159.04 and this machine has 570.172.08"),
        (1, H100, DRIVER_580, None),
    ],
)
def test_a_restore_needs_the_same_gpu_model_count_and_driver(tmp_path, gpus, model, driver, refusal):
    machine = FakeMachine(tmp_path / "machine", gpus=gpus, model=model, driver=driver)
    problem = gpu.restore_problem(RECORD, machine.machine())
    if refusal is None:
        assert problem is None
    else:
        assert problem is not None
        assert re.search(refusal, problem), problem


def _meta(checkpoint_id: str, record: dict | None) -> CheckpointMeta:
    return CheckpointMeta(
        job_id="job-1",
        checkpoint_id=checkpoint_id,
        generation=1,
        kind="periodic",
        criu_version="4.1.1",
        kernel="6.1",
        arch="x86_64",
        cpu_flags=("sse2",),
        gpu=record,
    )


def test_the_manifest_records_the_gpu_and_refuses_a_malformed_record(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "pages-1.img").write_bytes(b"x" * 4096)
    (tmp_path / "store").mkdir()
    store = CheckpointStore.for_directory(tmp_path / "store", "job-1")

    with_gpu = store.commit(images, _meta("0000000000001-g1-periodic", RECORD)).manifest
    without = store.commit(images, _meta("0000000000002-g1-periodic", None)).manifest

    assert store.load(with_gpu.checkpoint_id).gpu == RECORD
    assert store.load(without.checkpoint_id).gpu is None
    assert b'"gpu"' not in without.to_json()  # manifests of jobs without a GPU are as before
    broken = with_gpu.to_json().replace(b'"count":1', b'"count":0')
    with pytest.raises(CorruptCheckpoint, match="gpu count 0 is not a positive whole number"):
        Manifest.from_json(broken, with_gpu.checkpoint_id)


class _CountingStore:
    """The real directory store, counting what the restore downloads."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.job_id = store.job_id
        self.backend = store.backend
        self.fetched: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    def fetch(self, checkpoint_id: str, dest: Path, later: Collection[str] = ()) -> Manifest:
        self.fetched.append(checkpoint_id)
        return self.store.fetch(checkpoint_id, dest, later)


def test_a_machine_without_the_gpu_refuses_the_restore_before_downloading_images(tmp_path, machine):
    # Given a committed checkpoint of a job that held one H100, and a backup with an A10G
    images = tmp_path / "images"
    images.mkdir()
    (images / "pages-1.img").write_bytes(b"x" * 4096)
    (tmp_path / "store").mkdir()
    store = _CountingStore(CheckpointStore.for_directory(tmp_path / "store", "job-1"))
    store.store.commit(images, _meta("0000000000001-g1-periodic", RECORD))
    a10g = FakeMachine(tmp_path / "a10g", model="NVIDIA A10G")
    state = StateFile(tmp_path / "state")
    restorer = Restorer(
        job_id="job-1",
        workdir=tmp_path / "work",
        scratch_dir=tmp_path / "scratch",
        state=state,
        store=store,  # type: ignore[arg-type]
        criu=Criu("criu"),
        host=lambda: HOST,
        gpus=a10g.machine,
        backoff_s=(),
    )

    # When the backup restores the job
    with pytest.raises(RestoreError) as refused:
        restorer.restore(1)

    # Then it refuses, naming both GPUs, and downloaded no image
    assert "holds GPU state of 1 x NVIDIA H100 80GB HBM3; this machine has 1 x NVIDIA A10G" in str(refused.value)
    assert store.fetched == []


def test_the_bench_finds_the_device_memory_whose_final_dump_fits_the_notice():
    from bench.gpu import largest_fitting

    gib = 1 << 30
    # The research's two H100 points: 1.9 GiB dumped in 3.3 s, 17 GiB in 26.7 s
    rows = [
        {"device_memory_bytes": 1.9 * gib, "final_dump_seconds": 3.3},
        {"device_memory_bytes": 17 * gib, "final_dump_seconds": 26.7},
    ]
    fits = largest_fitting(rows, 120)
    assert fits is not None
    assert 77 * gib < fits < 78 * gib
    assert largest_fitting(rows[:1], 120) is None
