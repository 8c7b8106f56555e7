"""What a checkpoint carries, decided without CRIU: where each file lives, what a restore may touch, CRIU's words."""

import os
import socket
import stat

import pytest
from spotcr_agent.carry import (
    Entry,
    Layout,
    _endpoint,
    address_here,
    nvidia_majors,
    put_back,
    stored_name,
    take_back,
    too_big,
)
from spotcr_agent.config import AgentConfig, ConfigError
from spotcr_agent.criu import explain, log_tail

LAYOUT = Layout(workdir="/var/lib/spotcr/work/job-1", storage="/mnt/spotcr", excluded=("/var/lib/spotcr/scratch",))


@pytest.mark.parametrize(
    ("path", "use", "place"),
    [
        ("/var/lib/spotcr/work/job-1/out.csv", "write", "workdir"),
        ("/mnt/spotcr/data/input.parquet", "read", "storage"),
        ("/var/lib/spotcr/scratch/x/images/pages-1.img", "write", "excluded"),
        ("/tmp/hsperfdata_root/7", "write", "local"),
        ("/dev/shm/sem.loky-1", "write", "local"),
        ("/var/tmp/sortAb12", "read", "local"),
        ("/dev/null", "write", "kernel"),
        ("/proc/7/status", "read", "kernel"),
        ("/usr/lib/jvm/lib/server/libjvm.so", "read", "image"),
        ("/usr/lib/python3/dist-packages/x.so", "new", "image"),  # the image's dirs are the AMI's, however new
        ("/etc/ld.so.cache", "write", "image"),
        ("/root/.pyenv/versions/3.11.7/bin/python3.11", "read", "image"),  # only read, from the AMI: not carried
        ("/root/input.bin", "new", "other"),  # only read, but made after boot: the backup would lack it
        ("/root/job.log", "write", "other"),  # written outside every known place: carried as a single file
        ("/tmpfoo/x", "write", "other"),
    ],
)
def test_each_file_the_job_holds_has_one_place(path, use, place):
    assert LAYOUT.place(path, use) == place


def test_tcp_endpoints_are_read_as_the_kernel_prints_them():
    assert _endpoint("0100007F:1CF3", socket.AF_INET) == ("127.0.0.1", 7411)
    assert _endpoint("00000000000000000000000001000000:0050", socket.AF_INET6) == ("::1", 80)


def test_only_addresses_this_machine_has_count_as_here():
    assert address_here("127.0.0.1") and address_here("0.0.0.0")
    assert not address_here("192.0.2.77")  # TEST-NET-1: never assigned here


def test_a_restore_never_replaces_or_removes_what_was_there_before(tmp_path):
    # Given a carried dir with a file, a symlink and a FIFO, where one carried file already exists on this machine
    fetched = tmp_path / "fetched"
    place = tmp_path / "vm"
    place.mkdir()
    existing = place / "existing.bin"
    existing.write_bytes(b"this machine's own")
    entries = []
    for path, data in ((place / "d" / "new.log", b"carried"), (existing, b"carried over it")):
        source = fetched / stored_name(str(path))
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_bytes(data)
        entries.append(Entry(str(path), "file", 0o640, os.getuid(), os.getgid(), 1_000_000_000_000, len(data)))
    entries.append(Entry(str(place / "d"), "dir", 0o750, os.getuid(), os.getgid(), 2_000_000_000_000))
    entries.append(Entry(str(place / "d" / "link"), "symlink", 0o777, 0, 0, 0, target="new.log"))
    entries.append(Entry(str(place / "d" / "fifo"), "fifo", 0o600, os.getuid(), os.getgid(), 1_000_000_000_000))

    # When they are put back
    created = put_back(entries, fetched)

    # Then new things appear with their modes and times, and what was there stays untouched
    assert (place / "d" / "new.log").read_bytes() == b"carried"
    assert (place / "d" / "new.log").stat().st_mode & 0o777 == 0o640
    assert (place / "d").stat().st_mtime_ns == 2_000_000_000_000
    assert os.readlink(place / "d" / "link") == "new.log"
    assert stat.S_ISFIFO((place / "d" / "fifo").stat().st_mode)
    assert (place / "d" / "fifo").stat().st_mode & 0o777 == 0o600
    assert existing.read_bytes() == b"this machine's own"
    assert str(existing) not in created

    # And undoing a failed restore removes exactly what it created
    take_back(created)
    assert sorted(p.name for p in place.iterdir()) == ["existing.bin"]


def test_too_many_vm_local_bytes_name_the_biggest_files():
    entries = [Entry(f"/tmp/f{i}", "file", 0o600, 0, 0, 0, size=(i + 1) << 20) for i in range(4)]
    assert too_big(entries, 10 << 20) is None
    problem = too_big(entries, 9 << 20) or ""
    assert "local_files_limit_mb (9 MiB)" in problem and problem.index("/tmp/f3") < problem.index("/tmp/f2")


CRIU_LOG = (
    """\
(00.000511) Error (criu/rlimit.c:55): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.002000) Dumping path for 1 fd via self 12 [/dev/shm/sem.X]
(00.031337) Error (criu/files-reg.c:1031): Can't dump ghost file /tmp/#12 of 3149824 size, increase limit
(00.031339) Error (criu/cr-dump.c:1681): Dump files (pid: 9) failed with -1
"""
    + "".join(f"(00.04{i:04d}) Unseizing {i}\n" for i in range(30))
    + "(00.090000) Error (criu/cr-dump.c:2111): Dumping FAILED.\n"
)


def test_criu_failures_are_explained_by_the_first_real_error_not_the_rlimit_noise():
    reason = explain(CRIU_LOG)
    assert reason.startswith("an unlinked file the job holds is bigger than ghost_limit_mb")
    assert "Can't dump ghost file /tmp/#12" in reason and "RLIMIT" not in reason
    assert explain("(00.1) Error (criu/x.c:1): rlimit: Can't setup RLIMIT_NOFILE\n") == "no error in CRIU's log"


def test_the_log_tail_keeps_the_first_real_error_and_the_end():
    tail = log_tail(CRIU_LOG).splitlines()
    assert "Can't dump ghost file" in tail[1] and tail[2] == "..." and tail[-1].endswith("Dumping FAILED.")
    assert not any("RLIMIT" in line for line in tail)


def test_the_tcp_policy_and_carry_limits_are_checked():
    base = {"job_id": "job-1", "instance_id": "i-1", "storage": "efs", "generation": 1}
    assert AgentConfig.from_json({**base, "tcp": "close", "ghost_limit_mb": 64}).tcp == "close"
    with pytest.raises(ConfigError, match="tcp: unknown policy 'keep'; one of established, close"):
        AgentConfig.from_json({**base, "tcp": "keep"})
    with pytest.raises(ConfigError, match="ghost_limit_mb: must be at least 1"):
        AgentConfig.from_json({**base, "ghost_limit_mb": 0})
    with pytest.raises(ConfigError, match="local_dirs: must be absolute"):
        AgentConfig.from_json({**base, "local_dirs": ["tmp"]})


def test_the_nvidia_drivers_dynamic_majors_are_read_from_proc_devices(tmp_path):
    # /proc/devices on the lent H100 (driver 580): nvidia-uvm and nvidia-caps get majors of their own, which a CUDA
    # job holds beside /dev/nvidia0 and which CRIU's CUDA plugin handles
    (tmp_path / "devices").write_text(
        "Character devices:\n  1 mem\n195 nvidia-frontend\n238 nvidia-uvm\n241 nvidia-caps\n245 hidraw\n\n"
        "Block devices:\n  7 loop\n240 nvidia-pretend-block\n"
    )
    assert nvidia_majors(tmp_path) == {195, 238, 241}
    assert nvidia_majors(tmp_path / "missing") == frozenset()
