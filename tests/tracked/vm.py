"""A throwaway VM running Debian 12's own kernel (CONFIG_MEM_SOFT_DIRTY=y) under QEMU, for CRIU's memory tracking.

These machines' kernel has no soft-dirty tracking and their /dev/kvm (kvm_pvm) cannot run a stock kernel, so
the VM runs under QEMU's software emulation (about 12x slower than native: compare ratios, not absolutes). It
has no disk: a small initramfs (static busybox and the virtio/9p modules) mounts this machine's root filesystem
read-only over virtio-9p and switches to it, so the guest runs the host's CRIU, Python and this checkout. A
second, read-write 9p share (`share`) carries the command in and its output out. As on a fresh EC2 VM, /tmp,
/var/tmp, /run and /dev/shm start empty (tmpfs): the agent carries what the job keeps there, so the guest must
not see this machine's. tests/tracked/install-deps.sh
installs QEMU and downloads the kernel (`make test` runs it first); see /work/shared/kvm-vm-notes.md.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shlex
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("SPOTCR_KERNEL_CACHE") or Path.home() / ".cache/spotcr/debian-kernel")
INSTALL = Path(__file__).with_name("install-deps.sh")
SHARE_TAG = "spotcr"
GUEST_SHARE = "/run/spotcr-share"  # where the guest sees the read-write share
# Modules the initramfs loads before it can mount the host's root (no udev there).
INITRD_MODULES = (
    "drivers/virtio/virtio_ring",
    "drivers/virtio/virtio",
    "drivers/virtio/virtio_pci_legacy_dev",
    "drivers/virtio/virtio_pci_modern_dev",
    "drivers/virtio/virtio_pci",
    "net/9p/9pnet",
    "net/9p/9pnet_virtio",
    "fs/netfs/netfs",
    "fs/fscache/fscache",
    "fs/9p/9p",
)
NINEP = "trans=virtio,version=9p2000.L,msize=524288"
INIT = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
for m in {" ".join(m.rsplit("/", 1)[1] for m in INITRD_MODULES)}; do
  insmod /lib/modules/$m.ko || echo "init: insmod $m failed"
done
for i in 1 2 3 4 5 6 7 8 9 10; do mount -t 9p -o ro,cache=loose,{NINEP} hostroot /newroot && break; sleep 0.2; done
mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp
mount -t tmpfs -o mode=1777 tmpfs /newroot/var/tmp
mount -t tmpfs -o mode=755 tmpfs /newroot/run
mkdir -p /newroot{GUEST_SHARE}; mount -t 9p -o {NINEP} {SHARE_TAG} /newroot{GUEST_SHARE}
for d in proc sys dev; do mount --move /$d /newroot/$d; done
mkdir -p /newroot/dev/shm /newroot/dev/pts; mount -t tmpfs tmpfs /newroot/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /newroot/dev/pts
mount -t cgroup2 cgroup2 /newroot/sys/fs/cgroup 2>/dev/null
exec switch_root /newroot /bin/sh {GUEST_SHARE}/guest.sh
echo "init: switch_root failed"; poweroff -f
"""
# Runs as PID 1 in the guest after switch_root: prepares what CRIU needs, runs the command, powers off.
GUEST = """#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/run TMPDIR=/tmp
export PYTHONDONTWRITEBYTECODE=1
S={share}
echo {share}/modprobe >/proc/sys/kernel/modprobe   # CRIU loads modules on demand: the host's kmod, the VM's tree
ip link set lo up                                   # CRIU's TCP check connects to 127.0.0.1
{share}/modprobe tun                                # no udev: /dev/net/tun appears only once tun is loaded
echo "GUEST_READY $(cut -d' ' -f1 /proc/uptime)s kernel $(uname -r)"
cd {cwd} && /bin/sh $S/command.sh >$S/output.log 2>&1
echo $? >$S/rc
sync
echo "GUEST_DONE $(cut -d' ' -f1 /proc/uptime)s rc $(cat $S/rc)"
echo 1 >/proc/sys/kernel/sysrq; echo o >/proc/sysrq-trigger; sleep 30
"""


class VMUnavailable(RuntimeError):
    """The VM cannot run here: QEMU or the kernel is missing (install-deps.sh was not run)."""


@dataclass(frozen=True)
class Kernel:
    version: str
    root: Path  # the package's files, extracted

    @property
    def vmlinux(self) -> Path:
        return self.root.parent / "vmlinux"

    @property
    def config(self) -> Path:
        return self.root / "boot" / f"config-{self.version}"

    @property
    def modules(self) -> Path:
        return self.root / "lib" / "modules" / self.version


@dataclass(frozen=True)
class VMResult:
    rc: int | None  # the command's exit status; None if it never finished
    output: str  # the command's stdout and stderr
    serial: str  # the guest's console
    seconds: float  # QEMU start to power-off
    share: Path


def kernel() -> Kernel:
    """The cached Debian kernel that install-deps.sh fetched."""
    current = CACHE / "current"
    if not current.is_file():
        raise VMUnavailable(f"no Debian kernel in {CACHE}: run {INSTALL}")
    version = current.read_text().strip()
    found = Kernel(version, CACHE / version / "root")
    if not found.vmlinux.is_file():
        raise VMUnavailable(f"the Debian kernel {version} in {CACHE} is incomplete: run {INSTALL}")
    return found


def qemu() -> str:
    binary = shutil.which("qemu-system-x86_64")
    if binary is None:
        raise VMUnavailable(f"qemu-system-x86_64 is not installed: run {INSTALL}")
    return binary


def initrd(found: Kernel) -> Path:
    """The initramfs for this kernel, built once per kernel and init script."""
    digest = hashlib.sha256(INIT.encode()).hexdigest()[:12]
    path = found.root.parent / f"initrd-{digest}.cpio.gz"
    if path.is_file():
        return path
    busybox = shutil.which("busybox") or "/bin/busybox"
    files: list[tuple[str, bytes, int]] = [
        ("bin/busybox", Path(busybox).read_bytes(), 0o755),
        ("init", INIT.encode(), 0o755),
    ]
    for module in INITRD_MODULES:
        data = (found.modules / f"kernel/{module}.ko").read_bytes()
        files.append((f"lib/modules/{module.rsplit('/', 1)[1]}.ko", data, 0o644))
    dirs = ["bin", "dev", "proc", "sys", "newroot", "lib", "lib/modules"]
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(gzip.compress(_cpio(dirs, files), compresslevel=1))
    tmp.rename(path)
    return path


def _cpio(dirs: list[str], files: list[tuple[str, bytes, int]]) -> bytes:
    """A newc cpio archive (what the kernel unpacks as initramfs), with /dev/console."""
    out = io.BytesIO()
    inode = 1

    def entry(name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        nonlocal inode
        fields = [inode, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name) + 1, 0]
        header = "070701" + "".join(f"{v:08x}" for v in fields)
        out.write(header.encode() + name.encode() + b"\0")
        out.write(b"\0" * (-out.tell() % 4))
        out.write(data)
        out.write(b"\0" * (-out.tell() % 4))
        inode += 1

    for name in dirs:
        entry(name, stat.S_IFDIR | 0o755)
    entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1))
    for name, data, mode in files:
        entry(name, stat.S_IFREG | mode, data)
    entry("TRAILER!!!", 0)
    return out.getvalue()


def run(
    command: str, share: Path, *, cwd: Path, memory_mb: int = 1536, cpus: int = 2, timeout: float = 480
) -> VMResult:
    """Boot the VM, run `command` (sh) in `cwd` inside it, power off. `share` is read-write on both sides: here
    at its own path, in the guest at GUEST_SHARE (the guest's /tmp and /run are empty tmpfs)."""
    found = kernel()
    binary = qemu()
    image = initrd(found)
    share.mkdir(parents=True, exist_ok=True)
    for name in ("rc", "output.log"):
        (share / name).unlink(missing_ok=True)
    (share / "command.sh").write_text(command + "\n")
    modprobe = share / "modprobe"
    modprobe.write_text(f'#!/bin/sh\nexec /sbin/modprobe -d {shlex.quote(str(found.root))} "$@"\n')
    modprobe.chmod(0o755)
    (share / "guest.sh").write_text(GUEST.format(share=GUEST_SHARE, cwd=shlex.quote(str(cwd))))
    argv = [
        binary,
        *("-accel", "tcg,thread=multi,tb-size=512", "-cpu", "max", "-M", "q35"),
        *("-m", str(memory_mb), "-smp", str(cpus), "-nographic", "-no-reboot", "-nic", "none"),
        *("-kernel", str(found.vmlinux), "-initrd", str(image)),
        *("-append", "console=ttyS0 panic=-1 quiet loglevel=3"),
        "-virtfs",
        "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        "-virtfs",
        f"local,path={share},mount_tag={SHARE_TAG},security_model=none,multidevs=remap",
    ]
    started = time.monotonic()
    serial = share / "serial.log"
    with serial.open("wb") as console:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:  # also when the test is interrupted: never leave the VM running
            if process.poll() is None:
                process.kill()
                process.wait()
    seconds = time.monotonic() - started
    rc_file = share / "rc"
    rc = int(rc_file.read_text().strip()) if rc_file.is_file() and rc_file.read_text().strip() else None
    output = (share / "output.log").read_text(errors="replace") if (share / "output.log").exists() else ""
    return VMResult(rc, output, serial.read_text(errors="replace"), seconds, share)
