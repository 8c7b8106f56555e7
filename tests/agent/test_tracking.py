"""Memory tracking's bookkeeping: the local chain of image directories, what each checkpoint holds of it, the store
taking the chain's files from the parent unread, and when the chain is started afresh.

These drive the Checkpointer with a stand-in for CRIU that writes image directories and `parent` links as CRIU
does, on kernels where the real one cannot pre-dump (this machine's). The real CRIU runs this path end to end in
the Debian-kernel VM (tests/tracked)."""

import os
import subprocess
from pathlib import Path
from typing import Any, cast

import pytest
from spotcr_agent import tracking
from spotcr_agent.checkpoint import Checkpointer, CheckpointError
from spotcr_agent.criu import CriuError, dump_stats
from spotcr_agent.host import HostInfo
from spotcr_agent.runner import process_start_time
from spotcr_agent.store import CheckpointMeta, CheckpointStore

from .conftest import make_agent, make_config

HOST = HostInfo(criu_version="4.1.1", kernel="6.1", arch="x86_64", cpu_flags=("sse2",))
PAGES = 256 * 1024


class ChainCriu:
    """Writes what CRIU writes for a (pre-)dump: page images, a `parent` link to --prev-images-dir, stats; runs the
    post-dump action script as CRIU does while the job is frozen. `fail` names a step that fails instead."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str | None]] = []
        self.fail: str | None = None

    def memory_tracking(self) -> tuple[bool, str]:
        return True, "the stand-in tracks memory"

    def _write(self, action: str, images: Path, prev: Path | None) -> None:
        self.calls.append((action, images.name, None if prev is None else str(prev)))
        if self.fail == action:
            self.fail = None
            raise CriuError(action, "the stand-in fails here")
        images.mkdir(parents=True, exist_ok=True)
        (images / "pages-1.img").write_bytes(os.urandom(PAGES))
        (images / "pagemap-1.img").write_bytes(os.urandom(64))
        if prev is not None:
            (images / "parent").symlink_to(prev)

    def _post_dump(self, script: Path | None) -> None:
        if script is not None:
            env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": "post-dump"}
            subprocess.run(["sh", str(script)], env=env, check=True)

    def pre_dump(self, pid, images, logs, *, prev_images_dir=None):
        self._write("pre-dump", images, prev_images_dir)
        return 0.01

    def dump(self, pid, images, logs, *, leave_running, prev_images_dir=None, action_script=None, libdir=None):
        self._write("dump", images, prev_images_dir)
        self._post_dump(action_script)
        return 0.01

    def dump_argv(self, pid, images, logs, *, leave_running, leave_stopped=False, **options):
        prev_images_dir, action_script = options.get("prev_images_dir"), options.get("action_script")
        return ["final", str(images), str(prev_images_dir) if prev_images_dir else "", str(action_script)]

    def start_dump(self, argv):
        _, images, prev, script = argv
        try:
            self._write("final", Path(images), Path(prev) if prev else None)
        except CriuError:
            return subprocess.Popen(["false"])
        self._post_dump(Path(script))
        return subprocess.Popen(["true"])

    def finish_dump(self, process, logs):
        if process.wait() != 0:
            raise CriuError("dump", "the stand-in fails here", "", "Error (stand-in): the stand-in fails here")


@pytest.fixture
def job():
    process = subprocess.Popen(["sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL)
    yield process
    process.kill()
    process.wait()


def checkpointer(tmp_path, job, criu=None, store=None):
    config = make_config(tmp_path)
    Path(config.workdir).mkdir(parents=True, exist_ok=True)
    (Path(config.workdir) / "input.txt").write_text("data")
    (tmp_path / "store").mkdir(exist_ok=True)
    store = store or CheckpointStore.for_directory(tmp_path / "store", "job-1")
    checkpointer = Checkpointer(
        job_id="job-1",
        workdir=config.workdir,
        scratch_dir=config.scratch_dir,
        state=make_agent(config, None, store).state,
        store=store,
        criu=cast(Any, criu or ChainCriu()),
        host=lambda: HOST,
        keep_checkpoints=10,
    )
    with checkpointer.state.locked() as state:
        state.generation, state.job_status = 1, "running"
        state.job_pid, state.job_start_time = job.pid, process_start_time(job.pid) or 0
    return checkpointer


def chain_dirs(checkpointer):
    root = checkpointer.scratch_dir / tracking.CHAIN_DIR
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def test_periodic_checkpoints_build_one_chain_and_the_final_dump_is_incremental_on_it(tmp_path, job):
    # Given a job checkpointed twice with memory tracking
    cp = checkpointer(tmp_path, job)
    criu = cast(ChainCriu, cp.criu)
    first = cp.checkpoint("periodic", 1)
    second = cp.checkpoint("periodic", 1)

    # Then each periodic checkpoint is a pre-dump then a dump on top of it; the second builds on the first's dump
    a, b = first.checkpoint_id, second.checkpoint_id
    assert criu.calls == [
        ("pre-dump", f"{a}.pre", None),
        ("dump", f"{a}.dump", f"../{a}.pre"),
        ("pre-dump", f"{b}.pre", f"../{a}.dump"),
        ("dump", f"{b}.dump", f"../{b}.pre"),
    ]
    assert (
        first.memory_tracking.startswith("incremental: pre-dump (frozen ") and "a fresh chain" in first.memory_tracking
    )
    assert f"on checkpoint {a}" in second.memory_tracking
    assert chain_dirs(cp) == sorted([f"{a}.pre", f"{a}.dump", f"{b}.pre", f"{b}.dump"])
    # And the second stored only its own two directories: the first's came from its manifest, unread
    assert second.bytes_uploaded < 3 * PAGES < second.bytes_total

    # When the final dump is taken
    pages = {d: (cp.scratch_dir / "chain" / d / "pages-1.img").read_bytes() for d in chain_dirs(cp)}
    final = cp.checkpoint("final", 1)

    # Then it is incremental on the second periodic checkpoint's dump, and ships only its own pages
    assert criu.calls[-1] == ("final", "images", f"../../chain/{b}.dump")
    assert final.memory_tracking.startswith("incremental: dump on 4 parent image dirs")
    assert final.bytes_uploaded < 2 * PAGES
    # And the chain is gone from the VM: the job is stopped
    assert chain_dirs(cp) == []

    # And the final checkpoint fetched alone is a complete image set: the chain as nested `parent` directories
    store = cast(CheckpointStore, cp.store)
    out = tmp_path / "fetched"
    store.fetch(final.checkpoint_id, out)
    images = out / "images"
    assert (images / "parent" / "pages-1.img").read_bytes() == pages[f"{b}.dump"]
    assert (images / "parent" / "parent" / "pages-1.img").read_bytes() == pages[f"{b}.pre"]
    assert (images / "parent" / "parent" / "parent" / "pages-1.img").read_bytes() == pages[f"{a}.dump"]
    assert (images / "parent" / "parent" / "parent" / "parent" / "pages-1.img").read_bytes() == pages[f"{a}.pre"]
    assert not (images / "parent" / "parent" / "parent" / "parent" / "parent").exists()


def test_every_periodic_checkpoint_restores_alone_after_older_ones_are_pruned(tmp_path, job):
    # Given three tracked periodic checkpoints, of which the store keeps only the newest
    cp = checkpointer(tmp_path, job)
    for _ in range(3):
        newest = cp.checkpoint("periodic", 1)
    store = cast(CheckpointStore, cp.store)
    store.prune(keep=1, grace_seconds=0)
    assert store.checkpoint_ids() == [newest.checkpoint_id]
    # Then it is whole: six image directories, each with its pages
    store.fetch(newest.checkpoint_id, tmp_path / "fetched")
    images = tmp_path / "fetched" / "images"
    for depth in range(6):
        assert (images / ("parent/" * depth) / "pages-1.img").stat().st_size == PAGES


def test_a_failed_dump_after_a_pre_dump_discards_the_chain(tmp_path, job):
    # Given a chain of one periodic checkpoint
    cp = checkpointer(tmp_path, job)
    criu = cast(ChainCriu, cp.criu)
    first = cp.checkpoint("periodic", 1)
    # When the next periodic dump fails after its pre-dump reset the kernel's dirty bits
    criu.fail = "dump"
    with pytest.raises(CheckpointError, match="the stand-in fails here"):
        cp.checkpoint("periodic", 1)
    # Then the chain is gone (it no longer covers every change since its top)
    assert chain_dirs(cp) == [] and tracking.Chain.load(cp.scratch_dir) is None
    # And the next periodic checkpoint starts a fresh one; a final dump without a chain is a full dump
    criu.fail = None
    again = cp.checkpoint("periodic", 1)
    assert criu.calls[-2] == ("pre-dump", f"{again.checkpoint_id}.pre", None)
    assert "a fresh chain: none on this VM yet" in again.memory_tracking
    assert again.checkpoint_id != first.checkpoint_id


def test_a_failed_pre_dump_falls_back_to_a_full_periodic_dump_and_says_why(tmp_path, job):
    cp = checkpointer(tmp_path, job)
    criu = cast(ChainCriu, cp.criu)
    criu.fail = "pre-dump"
    outcome = cp.checkpoint("periodic", 1)
    # Then the checkpoint is a full dump (no parent), committed, and the outcome names the cause
    assert criu.calls[-1] == ("dump", "images", None)
    assert outcome.memory_tracking == "full dump: the pre-dump failed (the stand-in fails here)"
    assert cast(CheckpointStore, cp.store).checkpoint_ids() == [outcome.checkpoint_id]
    assert chain_dirs(cp) == []


def test_a_failed_incremental_final_dump_is_taken_again_in_full(tmp_path, job):
    cp = checkpointer(tmp_path, job)
    criu = cast(ChainCriu, cp.criu)
    periodic = cp.checkpoint("periodic", 1)
    criu.fail = "final"
    final = cp.checkpoint("final", 1)
    # Then CRIU ran twice: on the chain (failed), then without a parent; the outcome says why
    assert criu.calls[-2:] == [
        ("final", "images", f"../../chain/{periodic.checkpoint_id}.dump"),
        ("final", "images", None),
    ]
    assert final.memory_tracking.startswith("full dump: the incremental dump failed (")
    store = cast(CheckpointStore, cp.store)
    assert store.checkpoint_ids() == [final.checkpoint_id, periodic.checkpoint_id]
    assert not any(f.path.startswith("images/parent/") for f in store.load(final.checkpoint_id).files)


def test_a_final_dump_without_a_usable_chain_is_a_full_dump_and_says_why(tmp_path, job):
    # Given a chain whose top is no longer the job's newest checkpoint (another was committed, e.g. restored)
    cp = checkpointer(tmp_path, job)
    cp.checkpoint("periodic", 1)
    with cp.state.locked() as state:
        state.last_checkpoint = "1700000000000-g1-periodic"
    # When the final dump is taken
    final = cp.checkpoint("final", 1)
    # Then CRIU gets no parent, and the outcome says why
    criu = cast(ChainCriu, cp.criu)
    assert criu.calls[-1] == ("final", "images", None)
    assert final.memory_tracking.startswith("full dump: the chain's top is checkpoint")


def test_a_chain_at_its_longest_starts_afresh_and_its_old_directories_go(tmp_path, job):
    cp = checkpointer(tmp_path, job)
    criu = cast(ChainCriu, cp.criu)
    ids = [cp.checkpoint("periodic", 1).checkpoint_id for _ in range(tracking.MAX_CHAIN_DIRS // 2)]
    assert len(chain_dirs(cp)) == tracking.MAX_CHAIN_DIRS
    # When one more periodic checkpoint is taken
    fresh = cp.checkpoint("periodic", 1)
    # Then it starts a fresh chain, and only its own directories stay on the VM
    assert criu.calls[-2] == ("pre-dump", f"{fresh.checkpoint_id}.pre", None)
    assert "the most is 8" in fresh.memory_tracking
    assert chain_dirs(cp) == sorted([f"{fresh.checkpoint_id}.pre", f"{fresh.checkpoint_id}.dump"])
    assert ids[-1] not in "".join(chain_dirs(cp))


def test_a_new_job_process_does_not_build_on_the_old_ones_chain(tmp_path, job):
    cp = checkpointer(tmp_path, job)
    first = cp.checkpoint("periodic", 1)
    chain = tracking.Chain.load(cp.scratch_dir)
    assert chain is not None and chain.problem(job.pid, chain.start_time, first.checkpoint_id) is None
    assert "not the one the chain was dumped from" in (chain.problem(job.pid + 1, 0, first.checkpoint_id) or "")
    (cp.scratch_dir / tracking.CHAIN_DIR / chain.dirs[0]).rename(tmp_path / "gone")
    assert "are missing" in (chain.problem(job.pid, chain.start_time, first.checkpoint_id) or "")


def test_chain_files_are_named_by_depth_below_the_new_top(tmp_path):
    root = tmp_path / tracking.CHAIN_DIR
    for name in ("a.pre", "a.dump"):
        (root / name).mkdir(parents=True)
        (root / name / "pages-1.img").write_bytes(b"p")
    (root / "a.dump" / "parent").symlink_to("../a.pre")
    chain = tracking.Chain(root, 1, 2, "a", ("a.pre", "a.dump"))
    files = chain.files(shift=2)
    assert files == {
        "images/parent/parent/pages-1.img": ("images/pages-1.img", root / "a.dump" / "pages-1.img"),
        "images/parent/parent/parent/pages-1.img": ("images/parent/pages-1.img", root / "a.pre" / "pages-1.img"),
    }
    chain.save()
    assert tracking.Chain.load(tmp_path) == chain
    assert tracking.link_target(root / "b.pre", root / "a.dump") == Path("../a.dump")


def _commit(store, tmp_path, checkpoint_id, parent, files, inherited=None):
    images = tmp_path / checkpoint_id
    images.mkdir()
    (images / "core.img").write_bytes(os.urandom(100))
    meta = CheckpointMeta(job_id="job-1", checkpoint_id=checkpoint_id, generation=1, kind="periodic", parent=parent)
    return store.commit(images, meta, extra_files=files, inherited=inherited)


def test_the_store_takes_inherited_files_from_the_parent_unread_unless_a_chunk_is_gone(tmp_path):
    (tmp_path / "store").mkdir()
    store = CheckpointStore.for_directory(tmp_path / "store", "job-1")
    local = tmp_path / "pages.img"
    local.write_bytes(os.urandom(PAGES * 4))
    parent = _commit(store, tmp_path, "1700000000000-g1-periodic", None, {"images/pages-1.img": local})
    # When a child inherits that file while its local copy has changed (same size): the parent's entry is used
    original = local.read_bytes()
    local.write_bytes(os.urandom(PAGES * 4))
    inherited = {"images/parent/pages-1.img": ("images/pages-1.img", local)}
    child = _commit(store, tmp_path, "1700000001000-g1-periodic", parent.checkpoint_id, {}, inherited)
    entry = {f.path: f for f in child.manifest.files}["images/parent/pages-1.img"]
    assert entry.digest == {f.path: f for f in parent.manifest.files}["images/pages-1.img"].digest
    assert child.chunks_uploaded == 0
    store.fetch(child.checkpoint_id, tmp_path / "out")
    assert (tmp_path / "out" / "images" / "parent" / "pages-1.img").read_bytes() == original

    # When a chunk of it has gone from the store (its pack), the local copy is read and stored instead
    (tmp_path / "store" / "jobs" / "job-1" / "chunks" / "packs" / str(entry.chunks[0].pack)).unlink()
    grandchild = _commit(
        store,
        tmp_path,
        "1700000002000-g1-periodic",
        child.checkpoint_id,
        {},
        {"images/parent/parent/pages-1.img": ("images/parent/pages-1.img", local)},
    )
    assert grandchild.chunks_uploaded > 0
    store.fetch(grandchild.checkpoint_id, tmp_path / "out2")
    assert (tmp_path / "out2" / "images" / "parent" / "parent" / "pages-1.img").read_bytes() == local.read_bytes()


def test_dump_stats_reads_crius_stats_image(tmp_path):
    # A stats-dump.img as CRIU 4.1 writes it: magics, length, StatsEntry{dump: DumpStatsEntry{...}}
    def varint(n):
        out = b""
        while True:
            byte, n = n & 0x7F, n >> 7
            out += bytes([byte | (0x80 if n else 0)])
            if not n:
                return out

    dump = b"".join(
        varint(k << 3) + varint(v)
        for k, v in ((1, 5000), (2, 350714), (3, 1), (4, 2), (5, 134802), (6, 125347), (7, 6641))
    )
    entry = varint(1 << 3 | 2) + varint(len(dump)) + dump
    (tmp_path / "stats-dump.img").write_bytes(b"\x00" * 8 + len(entry).to_bytes(4, "little") + entry)
    stats = dump_stats(tmp_path)
    assert stats is not None
    assert (stats.frozen_seconds, stats.pages_scanned, stats.pages_skipped_parent, stats.pages_written) == (
        0.350714,
        134802,
        125347,
        6641,
    )
    assert dump_stats(tmp_path / "none") is None
