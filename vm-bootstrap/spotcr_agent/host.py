"""What a checkpoint records about the machine it came from, and what a restore compares it with."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostInfo:
    criu_version: str
    kernel: str
    arch: str
    cpu_flags: tuple[str, ...]


def cpu_flags(cpuinfo: str) -> tuple[str, ...]:
    """CPU feature flags from /proc/cpuinfo: 'flags' on x86, 'Features' on arm64."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return tuple(sorted(set(value.split())))
    return ()


def read_host(criu_version: str, cpuinfo_path: Path = Path("/proc/cpuinfo")) -> HostInfo:
    return HostInfo(
        criu_version=criu_version,
        kernel=os.uname().release,
        arch=platform.machine(),
        cpu_flags=cpu_flags(cpuinfo_path.read_text()),
    )
