"""How much of a job's memory changed since a checkpoint, read from a sample of its pages (memsample.py): real
processes on the host, read through /proc as the agent reads the job's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from spotcr_agent import memsample

from tests.support import wait_for

MiB = 1 << 20
# Holds 48 MiB of private memory, 16 MiB of shared memory and, untouched, a 1 GiB reservation. Once the file
# `rewrite` appears it rewrites 32 MiB of the 48 in place, `replace`: frees the 48 and fills 48 MiB afresh, `free`:
# frees the 48.
JOB = """
import mmap, os, pathlib, time
memory = bytearray(os.urandom(48 << 20))
shared = mmap.mmap(-1, 16 << 20)
shared.write(os.urandom(16 << 20))
reserved = mmap.mmap(-1, 1 << 30, flags=mmap.MAP_PRIVATE)
pathlib.Path('filled').touch()
while not pathlib.Path('rewrite').exists(): time.sleep(0.01)
how = pathlib.Path('rewrite').read_text()
if how == 'in place':
    for at in range(0, 32 << 20, 4096): memory[at:at + 8] = os.urandom(8)
else:
    del memory
    if how == 'replace':
        memory = bytearray(os.urandom(48 << 20))
pathlib.Path('rewritten').touch()
time.sleep(60)
"""


@pytest.fixture
def job(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", JOB], cwd=tmp_path)
    wait_for((tmp_path / "filled").exists, what="the job's memory")
    yield process
    process.kill()
    process.wait()


def _rewrite(work: Path, how: str) -> None:
    (work / "rewrite.new").write_text(how)
    (work / "rewrite.new").rename(work / "rewrite")
    wait_for((work / "rewritten").exists, what="the job's memory rewritten")


def test_what_the_job_rewrote_in_place_since_the_sample_is_what_changed(tmp_path, job):
    # Given a job's memory sampled right after a checkpoint
    memsample.record(tmp_path, "c1", job.pid)
    # Then read again at once, next to none of it changed (the interpreter's own loop writes a few pages)
    unchanged = memsample.changed_since(tmp_path, "c1")
    assert unchanged is not None
    assert (unchanged.sampled, unchanged.held) == (memsample.SAMPLE_PAGES, memsample.SAMPLE_PAGES)
    assert unchanged.changed <= 5
    assert unchanged.least_changed() < 0.01 * unchanged.memory_now
    # When the job rewrites 32 MiB of its 64 in place (a few MiB more are the interpreter's)
    _rewrite(tmp_path, "in place")
    share = memsample.changed_since(tmp_path, "c1")
    # Then about that share of its memory changed, and the bytes the deadline counts lie under it
    assert share is not None
    seen = share.changed / share.held
    assert 0.35 < seen < 0.55, share
    assert (seen - 0.06) * share.memory_now < share.least_changed() < seen * share.memory_now


@pytest.mark.parametrize("how", ["replace", "free"])
def test_memory_the_job_took_since_the_sample_counts_as_changed_and_memory_it_freed_does_not(tmp_path, job, how):
    # Given a job's memory sampled right after a checkpoint, 48 MiB of it in one mapping
    memsample.record(tmp_path, "c1", job.pid)
    # When the job frees those 48 MiB, and fills 48 MiB afresh elsewhere (or, for comparison, does not)
    _rewrite(tmp_path, how)
    share = memsample.changed_since(tmp_path, "c1")
    # Then what it filled anew is memory the checkpoint does not hold (wherever the kernel placed it), and what it
    # freed is nothing to send. The count is the low end of a 95% interval, so in about one run in 40 it passes the
    # 48 MiB by a little (48.1 MiB once, with 134 of the 512 pages held against about 154 expected)
    assert share is not None
    if how == "replace":
        assert 40 * MiB < share.least_changed() < 52 * MiB, share
    else:
        assert share.held < share.sampled * 0.5, share
        assert share.least_changed() < 4 * MiB, share


def test_the_pages_sampled_are_those_the_job_holds_private_or_shared(tmp_path, job):
    # Given a job that reserved 1 GiB it never touched beside the 48 MiB it holds, and 16 MiB of shared memory
    mappings = [line.split()[0].split("-") for line in Path(f"/proc/{job.pid}/maps").read_text().splitlines()]
    sized = {int(end, 16) - int(start, 16): (int(start, 16), int(end, 16)) for start, end in mappings}
    reserved, shared = sized[1 << 30], sized[16 * MiB]
    # When its memory is sampled
    sample = memsample.take(job.pid)
    # Then every page is one it holds: none from the reservation, which reading would have faulted in; its shared
    # memory (which CRIU dumps too) among them
    addresses = [address for _, address, _ in sample["pages"]]
    assert len(addresses) == memsample.SAMPLE_PAGES
    assert not [address for address in addresses if reserved[0] <= address < reserved[1]]
    assert 0.1 < len([address for address in addresses if shared[0] <= address < shared[1]]) / len(addresses) < 0.4


def test_a_sample_tells_nothing_of_a_job_that_is_gone_or_of_another_checkpoint(tmp_path, job):
    memsample.record(tmp_path, "c1", job.pid)
    assert memsample.changed_since(tmp_path, "c0") is None
    # When the job is gone (a process with its PID would be another: its start time differs)
    job.kill()
    job.wait()
    # Then its sample says nothing, rather than that all of it changed
    assert memsample.changed_since(tmp_path, "c1") is None


def test_each_dump_keeps_its_own_sample_and_the_newest_few(tmp_path, job):
    for number in range(memsample.KEEP + 1):
        memsample.record(tmp_path, f"c{number}", job.pid)
    assert memsample.changed_since(tmp_path, "c0") is None
    assert all(memsample.changed_since(tmp_path, f"c{n}") is not None for n in range(1, memsample.KEEP + 1))


@pytest.mark.parametrize(
    ("held", "changed", "now", "at_least", "at_most"),
    [
        (512, 0, 1.0, 0.0, 0.0),  # nothing changed
        (512, 512, 1.0, 0.98, 1.0),  # all of it rewritten in place
        (512, 256, 1.0, 0.45, 0.5),
        (0, 0, 1.0, 0.98, 1.0),  # all of it freed, as much taken afresh
        (0, 0, 0.0, 0.0, 0.0),  # all of it freed, nothing taken
        (256, 0, 1.0, 0.45, 0.5),  # half of it freed, as much taken afresh
    ],
)
def test_the_bytes_changed_count_at_the_low_end_of_what_the_pages_read_allow(held, changed, now, at_least, at_most):
    share = memsample.Share(512, held, changed, 1 << 30, int(now * (1 << 30)))
    assert at_least <= share.least_changed() / (1 << 30) <= at_most


def test_a_sample_that_cannot_be_kept_or_read_fails_nothing(tmp_path, job):
    # A state dir that cannot be written: the periodic dump goes on without a sample
    memsample.record(tmp_path / "missing", "c1", job.pid)
    assert memsample.changed_since(tmp_path / "missing", "c1") is None
    # A damaged samples file: the final dump decides without it
    memsample.record(tmp_path, "c1", job.pid)
    (tmp_path / memsample.SAMPLES).write_text('[{"checkpoint_id": "c1", "pid": "x"}, 3]')
    assert memsample.changed_since(tmp_path, "c1") is None
