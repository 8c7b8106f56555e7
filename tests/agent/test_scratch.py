"""Where a dump's images go: a tmpfs mounted for it when free memory holds it, else the scratch dir, else refused."""

import os
import subprocess
from pathlib import Path

import pytest
from spotcr_agent import scratch
from spotcr_agent.scratch import GIB, ScratchTooSmall

MIB = 1 << 20


def _mounted(path: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(path)], check=False).returncode == 0


def _options(path: Path) -> list[str]:
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    return next(fields[3].split(",") for fields in reversed(mounts) if fields[1] == str(path))


HUGE_TMPFS = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").exists()


def test_free_memory_decides_whether_a_memory_scratch_fits():
    # Given a dump of 3 GiB on a 16 GiB VM (the reserve beside it is 10%: 1.6 GiB)
    def estimate(pid, workdir):
        return 3 * GIB

    def total():
        return 16 * GIB

    # Then it goes to memory when 5 GiB are free, and not when 4 GiB are
    assert scratch.memory_room(1, None, estimate=estimate, available=lambda: 5 * GIB, total=total) == 3 * GIB
    assert scratch.memory_room(1, None, estimate=estimate, available=lambda: 4 * GIB, total=total) is None


def test_a_dump_that_fits_in_memory_gets_a_tmpfs_sized_to_it_removed_afterwards(tmp_path):
    # Given a disk scratch dir and room in memory for a 64 MiB dump
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    disk.mkdir()

    # When the dump's scratch is chosen
    with scratch.dump_scratch(disk, memory, os.getpid(), room=lambda pid, workdir: 64 * MIB) as (where, kind):
        # Then it is a tmpfs of that size at the memory path
        assert (where, kind) == (memory, "memory")
        assert _mounted(memory) and scratch.on_tmpfs(memory)
        assert os.statvfs(memory).f_blocks * os.statvfs(memory).f_frsize == 64 * MIB
        # in huge pages where the kernel has them
        assert ("huge=within_size" in _options(memory)) == HUGE_TMPFS
        (memory / "cp-1" / "images").mkdir(parents=True)

    # And it is unmounted once the dump is committed, leaving nothing on the disk
    assert not _mounted(memory)
    assert list(disk.iterdir()) == []


def test_a_kernel_that_refuses_huge_pages_for_tmpfs_gets_a_memory_scratch_in_small_ones(tmp_path, monkeypatch):
    # Given a kernel that refuses the huge-page option (an option no kernel knows stands in for it)
    monkeypatch.setattr(scratch, "HUGE_PAGES", "huge=no-such-policy")
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    disk.mkdir()

    # When the dump's scratch is chosen, then it is still a tmpfs in memory, mounted without the option
    with scratch.dump_scratch(disk, memory, os.getpid(), room=lambda pid, workdir: 64 * MIB) as (where, kind):
        assert (where, kind) == (memory, "memory") and scratch.on_tmpfs(memory)
        assert not any(option.startswith("huge=") and option != "huge=never" for option in _options(memory))
    assert not _mounted(memory)


def test_a_failed_dump_in_memory_leaves_crius_logs_on_the_disk(tmp_path):
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    disk.mkdir()
    with pytest.raises(RuntimeError), scratch.dump_scratch(disk, memory, os.getpid(), room=lambda p, w: 64 * MIB):
        (memory / "cp-1" / "logs").mkdir(parents=True)
        (memory / "cp-1" / "logs" / "dump.log").write_text("Error (criu/cr-dump.c:1): boom\n")
        raise RuntimeError("criu dump failed")
    assert not _mounted(memory)
    assert (disk / "cp-1" / "logs" / "dump.log").read_text().startswith("Error")


def test_without_room_in_memory_the_dump_goes_to_the_disk_and_is_refused_there_when_it_cannot_fit(tmp_path):
    # Given no room in memory for the dump
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    disk.mkdir()
    with scratch.dump_scratch(disk, memory, os.getpid(), room=lambda p, w: None) as (where, kind):
        assert (where, kind) == (disk, "disk")
        assert not _mounted(memory)

    # And on a disk too small (a 1 MiB tmpfs as the scratch dir, so not a memory scratch of its own choosing)
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "spotcr-test", str(small)], check=True)
    try:
        with pytest.raises(ScratchTooSmall, match="not enough local scratch"):  # noqa: SIM117
            with scratch.dump_scratch(small, memory, os.getpid(), room=lambda p, w: 64 * MIB):
                pytest.fail("the dump was not refused before the freeze")
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert not _mounted(memory)
