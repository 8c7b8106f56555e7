"""Lazy restore with the real CRIU on a real process: the job runs again before its memory has arrived, its pages
come from the store verified, and a fetch that fails mid-stream never lets the job finish with a wrong result.

The job (jobs/lazy_memory.py) holds 48 MiB of random memory and, told to go, writes their SHA-256: a page served
as zeros would change it. Faults strike a read of the job's memory that nothing needs before the job runs again,
and only once it runs (the backend waits for that): the interleaving is forced, not slept for."""

from __future__ import annotations

import contextlib
import hashlib
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from spotcr_agent.criu import Criu
from spotcr_agent.host import read_host
from spotcr_agent.lazy import PAGES_IMAGE
from spotcr_agent.restore import Restorer
from spotcr_agent.state import StateFile, exclusive
from spotcr_agent.store import CheckpointMeta, CheckpointStore, DirectoryBackend, StoreUnavailable
from spotcr_agent.store import store as store_module

from tests.support import wait_for

from .conftest import JOBS, kill_tree

pytestmark = [pytest.mark.criu, pytest.mark.usefixtures("criu_available")]

MEGABYTES = 48
OLDER, NEWEST = "1795293235815-g1-periodic", "1795293295815-g2-final"


class FaultyBackend(DirectoryBackend):
    """A directory store whose reads of the job's memory in the middle of the newest checkpoint fail once, as
    `fault` says, and only after the restored job runs (`running`)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.late: dict[str, dict[int, int]] = {}  # pack key -> where each late chunk starts -> where it ends
        self.running = threading.Event()
        self.fault = ""  # "corrupt" | "brownout": what the next late read does; empty once it struck
        self.struck = threading.Event()
        self._lock = threading.Lock()

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if not self._late(key, offset, offset + length):
            return super().get_range(key, offset, length)
        assert self.running.wait(60), "the job never ran again"
        with self._lock:
            fault, self.fault = self.fault, ""
        data = super().get_range(key, offset, length)
        if fault:
            self.struck.set()
        if fault == "brownout":
            raise StoreUnavailable(f"injected brownout reading {key}")
        if fault == "corrupt":
            return data[: length // 2] + bytes([data[length // 2] ^ 0xFF]) + data[length // 2 + 1 :]
        return data

    def _late(self, key: str, start: int, end: int) -> bool:
        """Whether every chunk the read covers is a late one."""
        spans = self.late.get(key, {})
        while start < end and start in spans:
            start = spans[start]
        return start == end


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """The job's images, dumped once: 48 MiB of memory in the middle of its pages image."""
    base = tmp_path_factory.mktemp("lazy-dump")
    work = base / "work"
    work.mkdir()
    launcher = subprocess.Popen(
        ["unshare", "-p", "-f", "setsid", sys.executable, str(JOBS / "lazy_memory.py"), str(MEGABYTES)],
        cwd=work,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for((work / "ready").exists, what="the job's memory")
    [pid] = [int(p) for p in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()]
    Criu().dump(pid, base / "images", base / "logs", leave_running=False)
    launcher.wait(timeout=30)
    return base / "images", work


@pytest.fixture
def world(tmp_path, images, monkeypatch):
    """Two checkpoints of the same images in a store whose newest one's middle reads can fail; a Restorer."""
    images_dir, work = images
    # One chunk per read: a read of the middle never takes in a chunk from either end, which CRIU needs first
    monkeypatch.setattr(store_module, "FETCH_RANGE", 1)
    criu = Criu()
    host = read_host(criu.version())
    (tmp_path / "store").mkdir()
    backend = FaultyBackend(tmp_path / "store")
    store = CheckpointStore(backend, "job-1")
    for generation, checkpoint_id in enumerate((OLDER, NEWEST), start=1):
        meta = CheckpointMeta(
            job_id="job-1",
            checkpoint_id=checkpoint_id,
            generation=generation,
            kind=checkpoint_id.rsplit("-", 1)[1],
            criu_version=host.criu_version,
            kernel=host.kernel,
            arch=host.arch,
            cpu_flags=host.cpu_flags,
        )
        store.commit(images_dir, meta)
    [pages] = [e for e in store.load(NEWEST).files if PAGES_IMAGE.fullmatch(e.path)]
    offset, quarter = 0, sum(c.size for c in pages.chunks) // 4
    for chunk in pages.chunks:
        if quarter <= offset < 3 * quarter and chunk.pack is not None:
            spans = backend.late.setdefault(f"jobs/job-1/chunks/packs/{chunk.pack}", {})
            spans[chunk.offset] = chunk.offset + chunk.stored
        offset += chunk.size
    assert backend.late, "no chunk of the job's memory lies in the middle of its pages image"
    restored: list[int] = []

    def on_running(pid: int) -> None:
        restored.append(pid)
        (work / "go").write_text("")  # the job reads all its memory now, pages not yet in
        backend.running.set()

    restorer = Restorer(
        job_id="job-1",
        workdir=work,
        scratch_dir=tmp_path / "scratch",
        state=StateFile(tmp_path / "state"),
        store=store,
        criu=criu,
        host=lambda: host,
        sleep=lambda seconds: None,
        on_running=on_running,
    )
    try:
        yield restorer, backend, work, restored
    finally:
        for pid in restored:
            kill_tree(pid)


def _expected() -> str:
    return hashlib.sha256(random.Random(7).randbytes(MEGABYTES << 20)).hexdigest()


def _gone(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    return True


def test_the_job_runs_before_its_memory_arrived_and_ends_with_the_same_result(world):
    restorer, _backend, work, _restored = world
    # When the newest checkpoint is restored lazily
    outcome = restorer.restore(2)
    # Then the job ran again before its last page came, and its result is the uninterrupted one
    assert outcome.checkpoint_id == NEWEST and outcome.lazy and outcome.skipped == ""
    assert 0 < outcome.running_seconds < outcome.seconds
    wait_for((work / "digest").exists, what="the job's digest")
    assert (work / "digest").read_text() == _expected()


def test_a_chunk_corrupt_mid_stream_kills_the_job_and_the_walk_restores_the_one_before(world):
    restorer, backend, work, restored = world
    # Given a chunk of the job's memory that reads corrupt once the restored job runs
    backend.fault = "corrupt"
    # When the newest checkpoint is restored lazily
    outcome = restorer.restore(2)
    # Then the job that ran on it was killed before it could finish, the checkpoint was skipped as corrupt, and
    # the one before restored: the result is the uninterrupted one
    assert backend.struck.is_set()
    first, _second = restored
    assert _gone(first)
    assert outcome.checkpoint_id == OLDER and NEWEST in outcome.skipped and "does not match" in outcome.skipped
    wait_for((work / "digest").exists, what="the job's digest")
    assert (work / "digest").read_text() == _expected()


def test_a_store_brownout_mid_stream_kills_the_job_and_the_same_checkpoint_is_restored_again(world):
    restorer, backend, work, restored = world
    # Given a read of the job's memory that fails (an outage) once the restored job runs
    backend.fault = "brownout"
    # When the newest checkpoint is restored lazily
    outcome = restorer.restore(2)
    # Then the job of the first attempt was killed, the retry restored the same checkpoint, and the result is right
    assert backend.struck.is_set()
    first, _second = restored
    assert _gone(first)
    assert outcome.checkpoint_id == NEWEST and outcome.lazy
    wait_for((work / "digest").exists, what="the job's digest")
    assert (work / "digest").read_text() == _expected()


def test_a_final_dump_asked_while_pages_stream_waits_for_the_last_page(world):
    restorer, _backend, _work, _restored = world
    # Given a final dump asked as soon as the restored job runs (every dump takes the dump lock first)
    taken: list[float] = []

    def final_dump() -> None:
        with exclusive(restorer.state.dir / "dump.lock"):
            taken.append(time.monotonic())

    dumper = threading.Thread(target=final_dump)
    hook = restorer.on_running

    def on_running(pid: int) -> None:
        hook(pid)
        dumper.start()

    restorer.on_running = on_running
    # When the job is restored lazily
    outcome = restorer.restore(2)
    dumper.join(timeout=60)
    # Then the dump began only once every page was in: it never dumps a job with pages missing
    assert outcome.lazy and taken
    assert taken[0] >= restorer._times[NEWEST].all_pages_at
