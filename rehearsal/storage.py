"""Local EBS: one sparse image file per volume behind a loop device, made when it is first attached.

A new EBS volume is blank, as on AWS; whoever mounts it first formats it. Attaching a volume to a
local VM puts the Nitro NVMe link that names the volume into that VM's /dev/disk/by-id.
Volumes restored from snapshots (the cross-AZ move) are not modelled: they come up blank.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path


class LoopVolumes:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._devices: dict[str, str] = {}
        self._lock = threading.Lock()

    def device(self, volume_id: str, size_gib: int) -> str:
        """The loop device of a volume, made (blank and sparse) on its first attachment."""
        with self._lock:
            if volume_id in self._devices:
                return self._devices[volume_id]
            self.directory.mkdir(parents=True, exist_ok=True)
            image = self.directory / f"{volume_id}.img"
            with image.open("wb") as handle:
                handle.truncate(size_gib * 2**30)  # sparse: only written blocks use disk
            device = subprocess.run(
                ["losetup", "--find", "--show", str(image)], capture_output=True, text=True, check=True
            ).stdout.strip()
            self._devices[volume_id] = device
            return device

    def release_all(self) -> None:
        with self._lock:
            devices = list(self._devices.items())
            self._devices.clear()
        for volume_id, device in devices:
            subprocess.run(["losetup", "--detach", device], capture_output=True, check=False)
            (self.directory / f"{volume_id}.img").unlink(missing_ok=True)
