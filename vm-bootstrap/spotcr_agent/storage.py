"""The job's storage on the VM: mounting it at bootstrap, releasing it for a move, opening the store."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import efs_iam, store_credentials
from .config import AgentConfig
from .store import CheckpointStore
from .store.backends import Backend, S3Backend

log = logging.getLogger(__name__)

EBS_LINK_PREFIX = "nvme-Amazon_Elastic_Block_Store_vol"
DEVICE_WAIT_S = 300.0
NFS_OPTIONS = "nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport"


class StorageError(RuntimeError):
    """The job's storage cannot be used; the message says which storage and why."""


Run = Callable[[list[str]], None]


def run(argv: list[str]) -> None:
    result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        output = (result.stderr or result.stdout).strip().splitlines()
        raise StorageError(f"`{' '.join(argv)}` failed ({result.returncode}): {output[-1] if output else ''}")


def is_mount(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """Whether something is mounted at path; unlike os.path.ismount, this also sees bind mounts."""
    target = os.path.realpath(path)
    for line in mountinfo.read_text().splitlines():
        mount_point = line.split()[4]
        if re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), mount_point) == target:
            return True
    return False


@functools.cache
def _store_session(url: str, job_id: str, region: str) -> Any:
    return store_credentials.session(store_credentials.fetcher(url, job_id, region), region)


def store_session(config: AgentConfig) -> Any:
    """The boto3 session for the checkpoint bucket: the job's own vended credentials, or None for the AWS
    environment's (no store-credentials URL configured)."""
    if not config.store_credentials_url:
        return None
    return _store_session(config.store_credentials_url, config.job_id, config.region)


def open_store(config: AgentConfig) -> CheckpointStore:
    """The job's checkpoint store; a file-system storage must be mounted (never fill the root disk)."""
    # A job over several VMs shares its store: each node's own checkpoints (its parts of the job's) have a part of
    # the run's of their own; the job manifests stay at the run's (spotcr_agent.nodes).
    part = f"node-{config.node_index}" if config.nodes else ""
    if config.storage == "s3":
        session = store_session(config)
        return CheckpointStore.for_s3(
            config.bucket, config.job_id, region=config.region, session=session, run_id=config.run_id, part=part
        )
    if not is_mount(mounted_at(config)):
        raise StorageError(
            f"storage {config.storage}: {mounted_at(config)} is not mounted; run `spotcr-agent bootstrap`"
        )
    return CheckpointStore.for_directory(config.mount_point, config.job_id, run_id=config.run_id, part=part)


def result_backend(config: AgentConfig, job_storage: Backend) -> Backend:
    """Where a finished job's result goes: the checkpoint bucket, which outlives a finished job's EBS volume
    (deleted with it unless kept); without a bucket (an agent run by hand), the job's own storage."""
    if config.storage == "s3" or not config.bucket:
        return job_storage
    return S3Backend(
        config.bucket, region=config.region or None, session=store_session(config), scope=f"jobs/{config.job_id}/"
    )


def find_ebs_device(volume_id: str, devices_dir: Path, wait_s: float = DEVICE_WAIT_S) -> Path:
    """The NVMe device of an attached EBS volume, by its /dev/disk/by-id link; waits for the attachment."""
    wanted = f"{EBS_LINK_PREFIX}{volume_id.replace('-', '').removeprefix('vol')}" if volume_id else ""
    deadline = time.monotonic() + wait_s
    while True:
        links = sorted(p for p in devices_dir.glob(f"{EBS_LINK_PREFIX}*") if "-part" not in p.name)
        if wanted:
            if (devices_dir / wanted).exists():
                return (devices_dir / wanted).resolve()
        else:
            root = _root_disk()
            candidates = [p.resolve() for p in links if p.resolve().name != root]
            if len(candidates) == 1:
                return candidates[0]
            if len(candidates) > 1:
                raise StorageError(f"storage ebs: {len(candidates)} EBS volumes attached; set ebs_volume_id")
        if time.monotonic() >= deadline:
            what = f"volume {volume_id}" if volume_id else "a data volume"
            raise StorageError(f"storage ebs: {what} did not appear under {devices_dir} within {wait_s:.0f} s")
        time.sleep(1.0)


def _root_disk() -> str:
    """Name of the disk holding / (e.g. nvme0n1), so it is never taken for the job's volume."""
    device = os.stat("/").st_dev
    try:
        block = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}").resolve()
    except OSError:
        return ""
    return block.parent.name if (block / "partition").exists() else block.name


def has_filesystem(device: Path) -> bool:
    result = subprocess.run(
        ["blkid", "-o", "value", "-s", "TYPE", str(device)], capture_output=True, text=True, check=False
    )
    return result.returncode == 0 and bool(result.stdout.strip())


def handed_over_at_restore(config: AgentConfig) -> bool:
    """A backup's EBS volume is moved to it only after its AgentReady, so it cannot wait for it at boot."""
    return config.mode == "restore" and config.storage == "ebs"


def prepare(
    config: AgentConfig,
    devices_dir: Path = Path("/dev/disk/by-id"),
    runner: Run = run,
    device_wait_s: float = DEVICE_WAIT_S,
) -> None:
    """Make the job's storage usable at config.mount_point; a mount point already mounted is used as is."""
    if config.storage == "s3":
        return
    if config.storage == "efs" and not config.efs_id:
        raise StorageError("storage efs: no file system id configured")
    if config.storage == "fsx" and not (config.fsx_dns and config.fsx_mount_name):
        raise StorageError("storage fsx: file system DNS name and mount name must be configured")
    mount_point = mounted_at(config)
    if is_mount(mount_point):
        log.info("%s is already mounted; using it as is", mount_point)
    else:
        mount_point.mkdir(parents=True, exist_ok=True)
        if config.storage == "ebs":
            device = find_ebs_device(config.ebs_volume_id, devices_dir, device_wait_s)
            if not has_filesystem(device):
                log.info("formatting %s (first use of the volume)", device)
                runner(["mkfs.ext4", "-q", "-L", "spotcr", str(device)])
            runner(["mount", "-o", "noatime", str(device), str(mount_point)])
        elif config.storage == "efs" and config.efs_isolation:
            runner(_isolated_efs_mount(config))
        elif config.storage == "efs" and shutil.which("mount.efs"):
            runner(["mount", "-t", "efs", "-o", "tls", f"{config.efs_id}:/", str(mount_point)])
        elif config.storage == "efs":
            # Without amazon-efs-utils: plain NFS 4.1 with the options AWS recommends for EFS.
            source = f"{config.efs_id}.efs.{config.region}.amazonaws.com:/"
            runner(["mount", "-t", "nfs4", "-o", NFS_OPTIONS, source, str(mount_point)])
        elif config.storage == "fsx":
            source = f"{config.fsx_dns}@tcp:/{config.fsx_mount_name}"
            runner(["mount", "-t", "lustre", "-o", "relatime,flock", source, str(mount_point)])
    check_writable(mount_point, config.storage)


def mounted_at(config: AgentConfig) -> Path:
    """Where the storage is mounted: the mount point, or for isolated EFS the job's own directory below it.

    The job's access point is rooted at /jobs/<job> on the file system (functions' efs_access), so mounting it at
    <mount point>/jobs/<job> keeps the store's layout, on the VM and on the file system, what it is without it."""
    if config.storage == "efs" and config.efs_isolation:
        return config.mount_point / "jobs" / config.job_id
    return config.mount_point


def _isolated_efs_mount(config: AgentConfig) -> list[str]:
    """The job's own access point, mounted with its vended credentials (the file system refuses anything else)."""
    if not shutil.which(efs_iam.MOUNT_HELPER):
        raise StorageError(
            "storage efs: efs_isolation needs mount.efs, which the agent asset's install-artifact.sh installs as "
            "/sbin/mount.efs (amazon-efs-utils); it is not on this VM's PATH"
        )
    if not config.store_credentials_url:
        raise StorageError("storage efs: efs_isolation needs the store-credentials URL (the mount's credentials)")
    credentials = efs_credentials(config)()
    access_point = str(credentials.get("efs_access_point_id", ""))
    if not access_point:
        raise StorageError(f"storage efs: the store-credentials URL named no EFS access point for job {config.job_id}")
    efs_iam.write_profile(credentials)
    return efs_iam.mount_argv(config.efs_id, access_point, mounted_at(config), config.region)


def efs_credentials(config: AgentConfig) -> store_credentials.Fetch:
    return store_credentials.fetcher(config.store_credentials_url, config.job_id, config.region)


def keep_efs_credentials(config: AgentConfig, stop: threading.Event) -> threading.Thread | None:
    """While the agent runs, the isolated EFS mount's profile is rewritten before its credentials expire."""
    if config.storage != "efs" or not config.efs_isolation:
        return None
    return efs_iam.start(efs_credentials(config), stop)


def check_writable(mount_point: Path, storage: str) -> None:
    probe = mount_point / f".spotcr-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as error:
        raise StorageError(f"storage {storage}: {mount_point} is not writable: {error.strerror}") from error


def release(config: AgentConfig, runner: Run = run) -> str:
    """Let the storage move to another VM: for EBS, flush and unmount so the volume can be detached."""
    if config.storage != "ebs":
        return f"storage {config.storage} needs no release"
    os.sync()
    if not is_mount(config.mount_point):
        return f"{config.mount_point} is not mounted"
    runner(["umount", str(config.mount_point)])
    return f"unmounted {config.mount_point}"
