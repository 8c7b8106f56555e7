"""At most one live copy, the agent's half: a VM going away whose final dump failed stops the job for good.

Each failure kind is forced with a hook (a store that is unreachable, a scratch disk with no room, a CRIU that
fails); no CRIU runs here, so the job is a small process tree on the host, in its own PID namespace as spotcr
starts jobs. The control plane's half is tests/workflow/test_one_live_copy.py.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from spotcr_agent import daemon
from spotcr_agent import scratch as scratch_room
from spotcr_agent.checkpoint import CheckpointError
from spotcr_agent.criu import Criu, CriuError
from spotcr_agent.restore import RestoreError
from spotcr_agent.runner import process_start_time, process_tree
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
    tmp_path: Path, publisher: Any, kind: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, list[tuple[int, int]]]:
    config = make_config(tmp_path, command=TREE_JOB)
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
    wait_for(lambda: len(process_tree(pid)) >= 3, what="the job's child process")
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
