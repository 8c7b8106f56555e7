"""At most one live copy, the agent's half: a VM going away whose final dump failed stops the job for good.

Each failure kind is forced with a hook (a store that is unreachable, a scratch disk with no room, a CRIU that
fails); no CRIU runs here, so the job is a small process tree on the host, in its own PID namespace as spotcr
starts jobs. The control plane's half is tests/workflow/test_one_live_copy.py.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from spotcr_agent import daemon, inflight, memsample
from spotcr_agent import scratch as scratch_room
from spotcr_agent.checkpoint import CheckpointError
from spotcr_agent.criu import Criu, CriuError
from spotcr_agent.deadline import GiB, Sample
from spotcr_agent.restore import RestoreError
from spotcr_agent.runner import process_start_time, process_tree
from spotcr_agent.state import exclusive
from spotcr_agent.store import CheckpointStore, StoreUnavailable

from tests.support import wait_for

from .conftest import FakeMetadata, make_agent, make_config

pytestmark = pytest.mark.claim("At most one live copy")

# PID 1 (the wrapper), the job, and a child of the job: the whole tree must go.
TREE_JOB = (sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)")
DUMP_FAILURES = (CheckpointError, StoreUnavailable, scratch_room.ScratchTooSmall)
NOTICE = FakeMetadata({"meta-data/spot/instance-action": '{"action":"terminate","time":"2026-01-01T00:00:00Z"}'})


class _UnreachableStore(CheckpointStore):
    def check(self) -> None:
        raise StoreUnavailable("s3://bucket is unreachable (injected outage)")


class _FailingCriu(Criu):
    """CRIU that starts and then fails, as on an error in the middle of the dump (the job is thawed and runs on)."""

    def version(self) -> str:
        return "4.1.1"

    def start_dump(self, argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["true"])

    def finish_dump(self, process: subprocess.Popen[bytes], log_dir: Path) -> None:
        process.wait()
        raise CriuError("dump", "Error (criu/cr-dump.c:1234): injected failure")


def _store(config: Any, cls: type[CheckpointStore] = CheckpointStore) -> CheckpointStore:
    config.mount_point.mkdir(parents=True, exist_ok=True)
    return cls.for_directory(config.mount_point, config.job_id)


def _running(
    tmp_path: Path, publisher: Any, kind: str, monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...] = TREE_JOB
) -> tuple[Any, list[tuple[int, int]]]:
    config = make_config(tmp_path, command=command)
    agent = make_agent(config, publisher, _store(config, _UnreachableStore if kind == "store" else CheckpointStore))
    if kind == "scratch":  # no room on the scratch disk, and no memory to spare for a memory scratch
        monkeypatch.setattr(
            scratch_room, "require_room", functools.partial(scratch_room.require_room, free=lambda _: 0)
        )
        monkeypatch.setattr(
            scratch_room, "dump_scratch", functools.partial(scratch_room.dump_scratch, room=lambda *_: None)
        )
    if kind == "criu":
        agent.criu = _FailingCriu()
        monkeypatch.setattr("spotcr_agent.checkpoint.Checkpointer._carried", lambda *args, **kwargs: {})
    agent.ready()
    pid = agent.start_job()
    assert pid
    wait_for(lambda: len(process_tree(pid)) >= (3 if command == TREE_JOB else 2), what="the job's processes")
    tree = [(member, process_start_time(member) or 0) for member in process_tree(pid)]
    return agent, tree


def _alive(tree: list[tuple[int, int]]) -> list[int]:
    return [pid for pid, started in tree if process_start_time(pid) == started]


@pytest.mark.parametrize("kind", ["store", "scratch", "criu"])
def test_a_failed_final_dump_stops_the_whole_job_and_says_so(tmp_path, publisher, monkeypatch, kind):
    # Given a running job with a child, on a VM whose final dump fails (store unreachable before the freeze,
    # scratch full, or a CRIU error)
    agent, tree = _running(tmp_path, publisher, kind, monkeypatch)
    try:
        # When the warning's command orders the final dump
        with pytest.raises(DUMP_FAILURES):
            agent.checkpoint("final", 2)

        # Then every process of the job is gone, and the failure event says the agent stopped it
        assert _alive(tree) == []
        [failed] = publisher.of("CheckpointFailed")
        assert (failed.kind, failed.generation, failed.job_stopped) == ("final", 2, True)
        assert agent.status().job_status == "stopped"
    finally:
        for pid in _alive(tree):
            subprocess.run(["kill", "-9", str(pid)], check=False)


def test_a_job_stopped_after_a_failed_final_dump_never_runs_again_on_that_vm(tmp_path, publisher, monkeypatch):
    # Given a job stopped on the IMDS notice because its final dump failed (the daemon's own trigger)
    agent, tree = _running(tmp_path, publisher, "store", monkeypatch)
    daemon._check_interruption(agent, NOTICE)
    assert _alive(tree) == []

    # When anything later tries to bring it back here: a duplicated final-dump order, the daemon restarting, a
    # restore command, a periodic dump order
    with pytest.raises(CheckpointError, match="stopped here"):
        agent.checkpoint("final", 2)
    daemon.run(agent, FakeMetadata(), _stopped(), 0.01)
    with pytest.raises(RestoreError, match="never resumed here"):
        agent.restore(2)
    with pytest.raises(CheckpointError, match="stopped here"):
        agent.checkpoint("periodic", 2)

    # Then it never ran again, its end is not reported as an exit (it continues on the backup), and each failed
    # final dump says the job is stopped
    assert agent.status().job_status == "stopped" and not agent.status().job_alive
    assert publisher.of("JobStarted")[1:] == [] and publisher.of("JobExited") == []
    assert [e.job_stopped for e in publisher.of("CheckpointFailed") if e.kind == "final"] == [True, True]


def test_a_job_that_exited_just_before_its_failed_final_dump_keeps_its_exit(tmp_path, publisher):
    # Given a job that ended on its own (exit code 3) just before the warning, not yet seen by the daemon
    config = make_config(tmp_path, command=(sys.executable, "-c", "raise SystemExit(3)"))
    agent = make_agent(config, publisher, _store(config, _UnreachableStore))
    agent.ready()
    agent.start_job()
    start_time = agent.state.read().job_start_time
    wait_for(lambda: process_start_time(agent.state.read().job_pid) != start_time, what="the job to end")

    # When the final dump is ordered
    with pytest.raises(DUMP_FAILURES):
        agent.checkpoint("final", 2)

    # Then its end is reported as it is, not as a stop
    assert [e.exit_code for e in publisher.of("JobExited")] == [3]
    assert agent.status().job_status == "exited"


def _stopped() -> threading.Event:
    stop = threading.Event()
    stop.set()
    return stop


class _CriuNotToRun(_FailingCriu):
    """Says so in the dump's failure if the final dump was begun."""

    def start_dump(self, argv: list[str]) -> subprocess.Popen[bytes]:
        raise CriuError("dump", "CRIU was started")


def _one_dump_a_minute_ago(
    tmp_path: Path,
    publisher: Any,
    monkeypatch: pytest.MonkeyPatch,
    *,
    criu_s: float,
    upload_s: float,
    command: tuple[str, ...] = TREE_JOB,
    size: Callable[[int], int] = lambda _: 4 * GiB,
) -> tuple[Any, list[tuple[int, int]], float, str]:
    """A running job at generation 2, with a CRIU that fails saying so if a final dump begins, whose one periodic
    dump, a minute ago, its first (a full dump, without a dirty rate), took criu_s of CRIU and 60 s of the store for
    4 GiB (or `size` of the job's PID 1; upload_s of the store's 3 + upload_s busy seconds sending). The agent, the
    job's tree, now, and that checkpoint."""
    agent, tree = _running(tmp_path, publisher, "none", monkeypatch, command)
    agent.criu = _CriuNotToRun()
    monkeypatch.setattr("spotcr_agent.checkpoint.Checkpointer._carried", lambda *args, **kwargs: {})
    now = time.time()
    parent = f"{int((now - 60) * 1000)}-g2-s1-periodic"
    total = size(tree[0][0])
    sample = Sample(parent, total, total, total, 0.0, criu_s, 60.0, 1.0, 1.0, 1.0, upload_s)
    with agent.state.locked() as state:
        state.generation, state.dump_samples, state.last_checkpoint = 2, [sample.to_json()], parent
    return agent, tree, now, parent


def _notice(now: float, seconds_left: float) -> FakeMetadata:
    """IMDS with a spot interruption notice: EC2 reclaims the VM `seconds_left` after `now`."""
    reclaim = datetime.fromtimestamp(now + seconds_left, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return FakeMetadata({"meta-data/spot/instance-action": f'{{"action":"terminate","time":"{reclaim}"}}'})


def _noticed(agent: Any, notice: FakeMetadata) -> float:
    """The agent's IMDS poll meets `notice`: the seconds until its final dump was taken or given up."""
    began = time.monotonic()
    daemon._check_interruption(agent, notice)
    return time.monotonic() - began


@pytest.mark.parametrize("seconds_left", [15, 600])
def test_a_final_dump_that_cannot_fit_the_notice_is_not_begun_and_the_job_stops(
    tmp_path, publisher, monkeypatch, seconds_left
):
    # Given a running job whose one periodic dump, a minute ago, took 40 s of CRIU and 60 s of the store for 4 GiB
    agent, tree, now, _ = _one_dump_a_minute_ago(tmp_path, publisher, monkeypatch, criu_s=40.0, upload_s=1.0)
    notice = _notice(now, seconds_left=seconds_left)
    try:
        # When the notice comes with 15 s left (and, for comparison, with 10 minutes left)
        daemon._check_interruption(agent, notice)

        # Then the job is stopped either way (the comparison's dump fails in its fake CRIU)
        assert _alive(tree) == []
        [failed] = publisher.of("CheckpointFailed")
        assert (failed.kind, failed.generation, failed.job_stopped) == ("final", 2, True)
        if seconds_left == 15:
            # but with 15 s left CRIU never started: the dump was not begun, and the event says why with the figures
            assert failed.reason.startswith("the final dump cannot fit the 1")
            assert "at least 40.0 s for its 4.00 GiB" in failed.reason
            # And the warning's command, arriving after, answers with that reason
            with pytest.raises(CheckpointError, match="job is stopped here: the final dump cannot fit"):
                agent.checkpoint("final", 2)
        else:
            assert "CRIU was started" in failed.reason
    finally:
        for pid in _alive(tree):
            subprocess.run(["kill", "-9", str(pid)], check=False)


def _periodic_dump_holding_the_lock(
    agent: Any,
    checkpoint_id: str,
    for_s: float,
    *,
    took_lock_at: float | None = None,
    commit: inflight.Commit | None = None,
) -> threading.Thread:
    """A periodic dump holding the dump lock for `for_s` or until it is told to stop, named as its holder (as of
    `took_lock_at`, or now); with `commit`, committing: telling its progress with `commit`'s figures."""
    holding = threading.Event()

    def run() -> None:
        with exclusive(agent.state.dir / "dump.lock"), inflight.holding(agent.state.dir, checkpoint_id):
            if took_lock_at is not None:  # it names itself as it does on taking the lock, at that earlier time
                holder = inflight.Holder(checkpoint_id, took_lock_at)
                (agent.state.dir / inflight.HOLDING).write_text(json.dumps(asdict(holder)))
            holding.set()
            until = time.time() + for_s
            while time.time() < until and not inflight.abandoned(agent.state.dir, checkpoint_id):
                if commit is not None:  # the same rate, measured now
                    now = time.time()
                    moved = replace(commit, first_at=commit.first_at + now - commit.at, at=now)
                    inflight.record(agent.state.dir, moved)
                time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    holding.wait(5)
    return thread


@pytest.mark.parametrize("ends_in_s", [75, 1])
def test_a_final_dump_stops_a_periodic_commit_that_cannot_end_before_the_reclaim(
    tmp_path, publisher, monkeypatch, ends_in_s
):
    # Given a running job whose one periodic dump, a minute ago, took 4 s of CRIU and 60 s of the store for 4 GiB,
    # nearly all of it sending: alone, a final dump's least time (4 s) fits a 15 s notice
    agent, tree, now, parent = _one_dump_a_minute_ago(tmp_path, publisher, monkeypatch, criu_s=4.0, upload_s=57.0)
    # And the next periodic dump, frozen 30 s after it, committing: at its rate so far it ends in 75 s (or, for
    # comparison, in 1 s), and 60% of what it hashed had changed since its parent
    done = 4 * GiB * 25 // (25 + ends_in_s)
    frozen = f"{int((now - 30) * 1000)}-g2-s2-periodic"
    commit = inflight.Commit(frozen, parent, now - 25, 0, now, done, 4 * GiB, changed=done * 3 // 5)
    holder = _periodic_dump_holding_the_lock(agent, frozen, ends_in_s, commit=commit)
    notice = _notice(now, seconds_left=15)
    try:
        # When the notice comes with 15 s left
        waited = _noticed(agent, notice)
        holder.join(5)

        [failed] = publisher.of("CheckpointFailed")
        if ends_in_s == 75:
            # Then the commit that would end a minute after the reclaim is told to stop, and the final dump goes on
            # at once, without it
            assert inflight.abandoned(agent.state.dir, commit.checkpoint_id)
            assert waited < 5
        else:
            # Then one that ends before the reclaim is waited for
            assert not inflight.abandoned(agent.state.dir, commit.checkpoint_id)
            assert waited >= 1
        # And either way the final dump counts the 2% a second the commit saw changing: over the minute since the
        # last checkpoint, all 4 GiB to send at the 71 MiB/s the job's store sent, so it is not begun, and the job
        # stops for the backup to restore that checkpoint now
        assert failed.reason.startswith("the final dump cannot fit the 1")
        assert "sending the 100% changed since the last checkpoint" in failed.reason
        assert _alive(tree) == []
    finally:
        for pid in _alive(tree):
            subprocess.run(["kill", "-9", str(pid)], check=False)


@pytest.mark.parametrize("took_lock_s_ago", [1, 30])
def test_a_final_dump_that_cannot_fit_does_not_wait_for_a_periodic_dump_that_cannot_either(
    tmp_path, publisher, monkeypatch, took_lock_s_ago
):
    # Given a running job whose one periodic dump, a minute ago, took 40 s of CRIU for 4 GiB: a final dump begun
    # at a notice with 15 s left cannot fit
    agent, tree, now, _ = _one_dump_a_minute_ago(tmp_path, publisher, monkeypatch, criu_s=40.0, upload_s=1.0)
    # And the next periodic dump holds the dump lock in its freeze, for 2 s more: it took the lock 1 s ago (so it
    # needs at least 40 s from then, past the reclaim), or, for comparison, 30 s ago (it may end 5 s before it)
    frozen = f"{int((now - took_lock_s_ago) * 1000)}-g2-s2-periodic"
    holder = _periodic_dump_holding_the_lock(agent, frozen, 2.0, took_lock_at=now - took_lock_s_ago)
    notice = _notice(now, seconds_left=15)
    try:
        # When the notice comes
        waited = _noticed(agent, notice)
        holder.join(5)

        # Then the job stops for the backup to restore the newest committed checkpoint, with the final dump's reason
        [failed] = publisher.of("CheckpointFailed")
        assert failed.reason.startswith("the final dump cannot fit the 1")
        assert (failed.kind, failed.job_stopped) == ("final", True)
        assert _alive(tree) == []
        if took_lock_s_ago == 1:
            # at once: the periodic dump, which cannot be durable before the reclaim either, is told to stop
            assert waited < 1.5
            assert inflight.abandoned(agent.state.dir, frozen)
        else:
            # but a periodic dump that may still commit before the reclaim is waited for
            assert waited >= 1.5
            assert not inflight.abandoned(agent.state.dir, frozen)
    finally:
        for pid in _alive(tree):
            subprocess.run(["kill", "-9", str(pid)], check=False)


# PID 1 (the wrapper) and a job holding 32 MiB of memory, which it rewrites once the file `rewrite` appears.
REWRITING_JOB = (
    sys.executable,
    "-c",
    "import os, pathlib, time\n"
    "memory = bytearray(os.urandom(32 << 20))\n"
    "pathlib.Path('filled').touch()\n"
    "while not pathlib.Path('rewrite').exists(): time.sleep(0.02)\n"
    "memory[:] = os.urandom(32 << 20)\n"
    "pathlib.Path('rewritten').touch()\n"
    "time.sleep(300)\n",
)


@pytest.mark.parametrize("sampled", [True, False])
def test_a_final_dump_that_a_memory_sample_tells_cannot_fit_does_not_wait_for_the_next_dumps_freeze(
    tmp_path, publisher, monkeypatch, sampled
):
    # Given a running job whose one periodic dump, a minute ago, was its first: no dirty rate measured. It took 4 s
    # of CRIU and 60 s of the store for the job's memory, nearly all of it sending: alone, a final dump's least
    # time (4 s, if nothing changed) fits a 15 s notice
    agent, tree, now, parent = _one_dump_a_minute_ago(
        tmp_path,
        publisher,
        monkeypatch,
        criu_s=4.0,
        upload_s=57.0,
        command=REWRITING_JOB,
        size=lambda pid: scratch_room.tree_memory(scratch_room.job_tree(pid)),
    )
    work = agent.config.workdir
    wait_for((work / "filled").exists, what="the job's memory")
    # And its memory sampled as that dump left it (or, for comparison, not sampled); then the job rewrote it
    if sampled:
        memsample.record(agent.state.dir, parent, tree[0][0])
    (work / "rewrite").touch()
    wait_for((work / "rewritten").exists, what="the job's memory rewritten")
    # And the next periodic dump holds the dump lock in its freeze, since 1 s ago and for 3 s more
    frozen = f"{int((now - 1) * 1000)}-g2-s2-periodic"
    holder = _periodic_dump_holding_the_lock(agent, frozen, 3.0, took_lock_at=now - 1)
    notice = _notice(now, seconds_left=15)
    try:
        # When the notice comes with 15 s left
        waited = _noticed(agent, notice)
        holder.join(5)

        # Then the job stops for the backup to restore that checkpoint
        [failed] = publisher.of("CheckpointFailed")
        assert (failed.kind, failed.job_stopped) == ("final", True)
        assert _alive(tree) == []
        if sampled:
            # at once: the sample read again says most of the memory changed, too much to send in time, for a final
            # dump and for the periodic dump in its freeze, which is told to stop
            assert waited < 1.5
            assert inflight.abandoned(agent.state.dir, frozen)
            assert failed.reason.startswith("the final dump cannot fit the 1")
        else:
            # but without it, the final dump waits for the periodic dump to let go of the lock, then begins
            assert waited >= 2.5
            assert not inflight.abandoned(agent.state.dir, frozen)
            assert "CRIU was started" in failed.reason
    finally:
        for pid in _alive(tree):
            subprocess.run(["kill", "-9", str(pid)], check=False)


def _notice_in_the_freeze(agent: Any, notice: FakeMetadata) -> Criu:
    """CRIU whose dump meets the notice while the job is frozen: the final dump runs (the agent's IMDS poll), then
    CRIU fails, as it does when the job it dumps is killed."""

    class NoticeInTheFreeze(_FailingCriu):
        def finish_dump(self, process: subprocess.Popen[bytes], log_dir: Path) -> None:
            process.wait()
            daemon._check_interruption(agent, notice)
            raise CriuError("dump", "Error (criu/cr-dump.c:1234): the task exited during the dump")

    return NoticeInTheFreeze()


def test_a_periodic_dump_whose_job_the_final_dump_stopped_says_so(tmp_path, publisher, monkeypatch):
    # Given a running job whose one periodic dump, a minute ago, took 40 s of CRIU for 4 GiB
    agent, tree, now, _ = _one_dump_a_minute_ago(tmp_path, publisher, monkeypatch, criu_s=40.0, upload_s=1.0)
    notice = _notice(now, seconds_left=15)
    agent.criu = _notice_in_the_freeze(agent, notice)
    try:
        # When the notice, with 15 s left, comes while the next periodic dump's CRIU holds the job frozen
        with pytest.raises(CheckpointError) as failed_periodic:
            agent.checkpoint("periodic", 2)

        # Then the final dump did not wait for it: it stopped the job, with its reason
        failed, periodic = publisher.of("CheckpointFailed")
        assert (failed.kind, failed.job_stopped) == ("final", True)
        assert failed.reason.startswith("the final dump cannot fit the 1")
        assert _alive(tree) == []
        # And the periodic dump's error says why its CRIU failed
        assert str(failed_periodic.value).startswith("the job was stopped for good during this dump")
        assert (periodic.kind, periodic.reason) == ("periodic", str(failed_periodic.value))
        assert inflight.holder(agent.state.dir) is None
    finally:
        for pid in _alive(tree):
            subprocess.run(["kill", "-9", str(pid)], check=False)
