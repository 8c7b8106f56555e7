"""The agent's half of the recovery protocol, with fakes forcing each interleaving (no CRIU needed here)."""

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from spotcr_agent import daemon
from spotcr_agent.checkpoint import Checkpointer, CheckpointError
from spotcr_agent.criu import CriuError
from spotcr_agent.host import HostInfo
from spotcr_agent.restore import MissingMount, RestoreError, Restorer, check_mounts, permanent
from spotcr_agent.runner import process_start_time
from spotcr_agent.state import FinalDump
from spotcr_agent.store import CheckpointNotFound, CommitResult, CorruptCheckpoint, StoreUnavailable
from spotcr_contracts.commands import checkpoint_id, checkpoint_order

from tests.support import wait_for

from .conftest import FakeMetadata, bootstrap_args, imds_with_tags, make_agent, make_config

HOST = HostInfo(criu_version="4.1.1", kernel="6.1", arch="x86_64", cpu_flags=("sse2",))


def _stopped():
    stop = threading.Event()
    stop.set()
    return stop


def test_the_daemon_starts_again_after_a_generation_bump(tmp_path, publisher):
    # Given a VM booted at generation 1 whose agent admitted generation 2 (the warning's final-dump command)
    agent = make_agent(make_config(tmp_path, command=(sys.executable, "-c", "pass")), publisher)
    agent.fence(2)

    # When its daemon restarts
    daemon.run(agent, FakeMetadata(), _stopped(), 0.05)

    # Then it comes up at the generation it serves and starts nothing it must not
    assert (publisher.events[0].DETAIL_TYPE, publisher.events[0].generation) == ("AgentReady", 2)


def test_a_dump_nobody_ordered_ranks_after_its_vms_dumps_and_before_its_backups(tmp_path, publisher):
    # Given a primary ordered dumps with sequences 5 and then (delivered late) 3, and the warning's final-dump order
    # (sequence 6) not yet delivered when its own IMDS notice arrives at the generation the warning bumped to
    primary = make_agent(make_config(tmp_path), publisher)
    assert (primary.fence(1, 5), primary.fence(1, 3)) == (5, 3)  # an order's dump takes the order's sequence
    primary.fence(2)
    # And its backup (a clock 120 s behind) whose restore order was sequence 7, at that same generation
    backup = make_agent(make_config(tmp_path, "backup", mode="restore"), publisher)
    backup.fence(2, 7)
    never_ordered = make_agent(make_config(tmp_path, "fresh"), publisher)

    # When each takes a dump nobody ordered (Agent.checkpoint's sequence: what fence returns)
    own_final = checkpoint_id(1795293999999, 2, "final", primary.fence(2))
    backup_dump = checkpoint_id(1795293880000, 2, "periodic", backup.fence(2))

    # Then the primary's ranks after every dump it was ordered, the backup's after the primary's, whatever the
    # clocks; a VM never given a sequence dumps without one
    ordered = [checkpoint_id(1795293000000, 1, "periodic", s) for s in (3, 5)]
    assert sorted([backup_dump, own_final, *ordered], key=checkpoint_order) == [*ordered, own_final, backup_dump]
    assert own_final.endswith("-g2-s5-final") and never_ordered.fence(1) is None


def test_a_missing_program_ends_the_job_with_the_reason_and_the_daemon_lives(tmp_path, publisher):
    # Given a job whose program does not exist
    agent = make_agent(make_config(tmp_path, command=("/opt/nowhere/run-sim",)), publisher)

    # When the daemon starts it
    daemon.run(agent, FakeMetadata(), _stopped(), 0.05)

    # Then the daemon does not crash; the control plane is told why (it marks the PENDING job FAILED)
    [failed] = publisher.of("BootstrapFailed")
    assert failed.step == "start-job" and "/opt/nowhere/run-sim" in failed.reason
    assert agent.status().job_status == "exited"
    # And a later dump order reports the end again instead of a failed dump
    with pytest.raises(CheckpointError):
        agent.checkpoint("periodic", 1)
    assert [e.exit_code for e in publisher.of("JobExited")] == [127]


def _ended_job(tmp_path, publisher, code):
    agent = make_agent(make_config(tmp_path, command=(sys.executable, "-c", f"raise SystemExit({code})")), publisher)
    agent.ready()
    pid = agent.start_job()
    start_time = agent.state.read().job_start_time
    wait_for(lambda: process_start_time(pid) != start_time, what="the job to end")
    return agent


def test_every_dump_order_after_the_end_reports_the_exit_again(tmp_path, publisher):
    # Given a job that ended and whose exit was reported once (that event may have been lost)
    agent = _ended_job(tmp_path, publisher, 3)
    assert agent.watch_job() == 3

    # When the scheduler orders a periodic dump, and later the warning orders a final one
    for kind, generation in (("periodic", 1), ("final", 2)):
        with pytest.raises(CheckpointError, match="exited with code 3"):
            agent.checkpoint(kind, generation)

    # Then each order reported the exit again (not a failed dump)
    assert [(e.generation, e.exit_code) for e in publisher.of("JobExited")] == [(1, 3), (1, 3), (2, 3)]
    assert publisher.of("CheckpointFailed") == []


def test_an_exit_seen_first_by_a_dump_order_is_reported_once(tmp_path, publisher):
    agent = _ended_job(tmp_path, publisher, 0)
    with pytest.raises(CheckpointError):
        agent.checkpoint("final", 2)
    assert [(e.generation, e.exit_code) for e in publisher.of("JobExited")] == [(2, 0)]


def test_a_final_dump_taken_on_the_imds_notice_is_reported_to_the_bumped_generation(tmp_path, publisher):
    # Given a final dump this VM took at generation 1 on its own notice
    agent = make_agent(make_config(tmp_path), publisher)
    taken = {
        "checkpoint_id": "1795000000000-g1-final",
        "kind": "final",
        "generation": 1,
        "seconds": 2.0,
        "frozen_seconds": 2.0,
        "bytes_total": 10,
        "bytes_uploaded": 5,
    }
    with agent.state.locked() as state:
        state.generation, state.job_status = 1, "checkpointed"
        state.final_dumps["1"] = FinalDump("done", os.getpid(), taken)

    # When the warning's command asks for the final dump at generation 2
    outcome = agent.checkpoint("final", 2)

    # Then the same dump is reported to generation 2, so recovery need not wait for it
    assert outcome.already_taken
    [completed] = publisher.of("CheckpointCompleted")
    assert (completed.generation, completed.checkpoint_id, completed.kind) == (2, taken["checkpoint_id"], "final")


class _WalkStore:
    """Committed checkpoints, each with a scripted fate; a brownout fails every call until the clock passes it."""

    def __init__(self, fates, clock, brownout_until=0.0):
        self.fates = fates
        self.clock = clock
        self.brownout_until = brownout_until
        self.fetched = []

    def _outage(self):
        if self.clock[0] < self.brownout_until:
            raise StoreUnavailable(f"s3://bucket is unreachable (brownout, t={self.clock[0]:.1f} s)")

    def checkpoint_ids(self):
        self._outage()
        return sorted(self.fates, key=checkpoint_order, reverse=True)  # as the store lists them

    def load(self, checkpoint_id):
        self._outage()
        return SimpleNamespace(criu_version="4.1.1", arch="x86_64", cpu_flags=("sse2",), open_files=(), gpu=None)

    def fetch(self, checkpoint_id, dest, later=()):
        self._outage()
        self.fetched.append(checkpoint_id)
        fate = self.fates[checkpoint_id]
        if fate == "corrupt":
            raise CorruptCheckpoint(checkpoint_id, "chunk ab of images/pages-1.img does not match its hash")
        if fate == "missing":
            raise CheckpointNotFound(checkpoint_id, "s3://bucket")
        (dest / "images").mkdir(parents=True, exist_ok=True)
        return self.load(checkpoint_id)


class _FakeCriu:
    def restore(self, images, logs, **options):
        return os.getpid()

    def supports(self, feature):
        return False  # no userfaultfd: whole images, as these tests count the checkpoints' downloads


def _restorer(tmp_path, store, clock):
    config = make_config(tmp_path, "backup", mode="restore")

    def sleep(seconds):
        clock[0] += seconds

    return Restorer(
        job_id="job-1",
        workdir=config.workdir,
        scratch_dir=config.scratch_dir,
        state=make_agent(config, None, store).state,
        store=store,
        criu=cast(Any, _FakeCriu()),
        host=lambda: HOST,
        sleep=sleep,
    )


@pytest.mark.claim("Restore walks back past damaged checkpoints")
def test_restore_walks_back_through_every_checkpoint_through_a_store_brownout(tmp_path):
    # Given four committed checkpoints, the three newest damaged or missing, and a 12 s store brownout
    clock = [0.0]
    fates = {"0004-g1-final": "corrupt", "0003-g1-periodic": "missing", "0002-g1-periodic": "corrupt"}
    store = _WalkStore({**fates, "0001-g1-periodic": "ok"}, clock, brownout_until=12.0)

    # When the control plane names the newest
    outcome = _restorer(tmp_path, store, clock).restore(1, "0004-g1-final")

    # Then the agent waited out the brownout, walked back newest first and restored the oldest intact one
    assert outcome.checkpoint_id == "0001-g1-periodic"
    assert store.fetched == ["0004-g1-final", "0003-g1-periodic", "0002-g1-periodic", "0001-g1-periodic"]
    assert clock[0] >= 12.0
    assert "0004-g1-final" in outcome.skipped and "does not match its hash" in outcome.skipped


def test_the_walk_back_follows_the_control_planes_order_when_the_vms_clock_jumped_back(tmp_path):
    # Given ordered checkpoints (sequences 4, 5, 6) from a VM whose clock jumped back after the first, the one the
    # control plane names (sequence 5) damaged
    older, named, newer = "1700000100000-g1-s4-periodic", "1700000040000-g1-s5-periodic", "1700000070000-g1-s6-periodic"
    clock = [0.0]
    store = _WalkStore({older: "ok", named: "corrupt", newer: "ok"}, clock)

    # When the backup restores the named one
    outcome = _restorer(tmp_path, store, clock).restore(1, named)

    # Then it walks back to the one ordered before it, never to a later one, whatever their ids' times
    assert (outcome.checkpoint_id, store.fetched) == (older, [named, older])


def test_with_no_checkpoint_the_backup_starts_the_job_from_the_beginning(tmp_path, publisher):
    # Given a backup whose store holds no checkpoint of the job
    # (a job that outlives the call, so its PID is seen: one that ends at once is recorded with PID 0)
    job = (sys.executable, "-c", "import time; time.sleep(3)")
    config = make_config(tmp_path, "backup", mode="restore", command=job)
    agent = make_agent(config, publisher)

    # When the restore is ordered
    outcome = agent.restore(1)

    # Then the job starts over and the control plane is told so
    assert outcome.checkpoint_id == "" and outcome.pid > 0
    [completed] = publisher.of("RestoreCompleted")
    assert completed.checkpoint_id == "" and "no committed checkpoint" in completed.skipped
    assert "started from the beginning" in completed.skipped


def test_restarting_from_scratch_can_be_turned_off(tmp_path, publisher):
    config = make_config(tmp_path, "backup", mode="restore", restart_from_scratch=False)
    agent = make_agent(config, publisher)
    with pytest.raises(RuntimeError, match="no committed checkpoint"):
        agent.restore(1)
    [failed] = publisher.of("RestoreFailed")
    assert "no committed checkpoint" in failed.reason
    assert agent.status().job_status == "none"


def test_a_store_outage_is_not_taken_for_no_checkpoint(tmp_path, publisher):
    # Given a store that stays unreachable longer than the retries
    clock = [0.0]
    store = _WalkStore({"0001-g1-periodic": "ok"}, clock, brownout_until=3600.0)
    restorer = _restorer(tmp_path, store, clock)
    # Then the restore fails naming the outage, and it is not a reason to start over
    with pytest.raises(Exception, match="unreachable") as raised:
        restorer.restore(1)
    assert not getattr(raised.value, "nothing_restorable", False)


class _LockProbeCriu:
    def memory_tracking(self):
        return False, "a fake CRIU: full dumps"

    def dump(self, pid, images, logs, *, leave_running, **options):
        images.mkdir(parents=True, exist_ok=True)
        (images / "pages-1.img").write_bytes(b"x" * 10)
        # As CRIU does while the job is frozen: the agent's post-dump script records what the job holds.
        script = options.get("action_script")
        if script is not None:
            subprocess.run(["sh", str(script)], env={**os.environ, "CRTOOLS_SCRIPT_ACTION": "post-dump"}, check=True)
        return 0.01


class _LockProbeStore:
    """Records, at each commit, whether another periodic dump could take the dump lock right then."""

    def __init__(self, lock_path):
        self.lock_path = lock_path
        self.lock_free_during_commit = []
        self.committed = []  # the checkpoints' ids

    def check(self):
        pass

    def commit(self, image_dir, meta, extra_files=None, still_writing=None, *, keep_going=None):
        self.committed.append(meta.checkpoint_id)
        with open(self.lock_path, "a") as probe:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.lock_free_during_commit.append(False)
            else:
                self.lock_free_during_commit.append(True)
                fcntl.flock(probe, fcntl.LOCK_UN)
        return CommitResult(meta.checkpoint_id, cast(Any, None), 10, 10, 1, 1, 0.0)

    def prune(self, keep):
        pass


def _lock_probe_checkpointer(tmp_path: Path, job_pid: int) -> tuple[Checkpointer, _LockProbeStore]:
    """A checkpointer of the running job `job_pid` at generation 1, with the fake CRIU and the lock-probing store."""
    config = make_config(tmp_path)
    Path(config.workdir).mkdir(parents=True)
    store = _LockProbeStore(Path(config.state_dir) / "dump.lock")
    checkpointer = Checkpointer(
        job_id="job-1",
        workdir=config.workdir,
        scratch_dir=config.scratch_dir,
        state=make_agent(config, None, store).state,
        store=cast(Any, store),
        criu=cast(Any, _LockProbeCriu()),
        host=lambda: HOST,
    )
    with checkpointer.state.locked() as state:
        state.generation, state.job_status = 1, "running"
        state.job_pid, state.job_start_time = job_pid, process_start_time(job_pid) or 0
    return checkpointer, store


def test_a_periodic_dump_commits_inside_the_dump_lock(tmp_path):
    # Given a running job (its own session, as spotcr starts jobs)
    job = subprocess.Popen(
        ["sleep", "30"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        checkpointer, store = _lock_probe_checkpointer(tmp_path, job.pid)

        # When a periodic dump commits
        checkpointer.checkpoint("periodic", 1)

        # Then no other dump could start meanwhile: two periodic dumps never overlap or commit out of order
        assert store.lock_free_during_commit == [False]
    finally:
        job.kill()
        job.wait()


def test_a_periodic_dump_that_waited_for_the_dump_lock_is_named_for_its_freeze(tmp_path):
    # Given a running job, and another dump holding the dump lock for 1 s more
    job = subprocess.Popen(["sleep", "30"], start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        checkpointer, store = _lock_probe_checkpointer(tmp_path, job.pid)
        held, released = threading.Event(), []

        def hold() -> None:
            with open(store.lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                held.set()
                time.sleep(1.0)
                released.append(time.time())

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(5)

        # When a periodic dump is asked for now
        checkpointer.checkpoint("periodic", 1)
        holder.join()

        # Then its id names when it took the lock, right before its freeze, not when it was asked for
        [taken] = store.committed
        assert int(taken.split("-")[0]) / 1000 >= released[0] - 0.01
    finally:
        job.kill()
        job.wait()


def test_bootstrap_waits_for_the_job_tag_added_to_a_running_instance(tmp_path):
    from spotcr_agent.bootstrap import build_config

    # Given an instance running from the launch template with no spotcr:job tag yet
    metadata = imds_with_tags({"Name": "x"})
    added = {"spotcr:job": "late-1", "spotcr:command": "python3 sim.py", "Name": "x"}
    polls = []

    def sleep(seconds):
        polls.append(seconds)
        if len(polls) == 2:  # the user tags the instance while bootstrap waits
            metadata.values.update(imds_with_tags(added).values)

    # When bootstrap runs
    config = build_config(metadata, bootstrap_args(), {"SPOTCR_STATE_DIR": str(tmp_path)}, sleep=sleep)

    # Then it waited for the tag and the job is the one tagged
    assert (config.job_id, config.command) == ("late-1", ("python3", "sim.py"))
    assert len(polls) == 2


def test_a_backup_warned_while_it_restores_takes_its_final_dump_once_the_job_runs(tmp_path, publisher, monkeypatch):
    # Given a backup whose agent sees the interruption notice before its restore has brought the job back
    agent = make_agent(make_config(tmp_path, "backup", mode="restore"), publisher)
    notice = FakeMetadata({"meta-data/spot/instance-action": '{"action":"terminate"}'})
    dumps = []
    monkeypatch.setattr(agent, "checkpoint", lambda kind, generation, **_: dumps.append((kind, generation)))

    # When the daemon polls before and after the restore
    before = daemon._check_interruption(agent, notice)
    job = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        with agent.state.locked() as state:
            state.generation, state.job_status = 1, "running"
            state.job_pid, state.job_start_time = job.pid, process_start_time(job.pid) or 0
        after = daemon._check_interruption(agent, notice)
    finally:
        job.kill()
        job.wait()

    # Then it kept watching, and took the final dump as soon as the restored job ran
    assert (before, after) == (False, True)
    assert dumps == [("final", 1)]


def test_a_warning_during_the_restore_keeps_the_restored_job_and_its_final_dump_order(tmp_path):
    # Given a backup restoring at generation 1, warned meanwhile: the final-dump command admitted generation 2
    # and marked its dump as being taken (it then waits for the dump lock the restore holds)
    clock = [0.0]
    store = _WalkStore({"0001-g1-periodic": "ok"}, clock)
    restorer = _restorer(tmp_path, store, clock)

    class _WarnedDuringRestore(_FakeCriu):
        def restore(self, images, logs, **options):
            with restorer.state.locked() as state:
                state.generation = 2
                state.final_dumps["2"] = FinalDump("running", os.getpid())
            return super().restore(images, logs)

    restorer.criu = cast(Any, _WarnedDuringRestore())

    # When the restore completes
    outcome = restorer.restore(1)

    # Then the job is recorded as running here (the final dump can take it), and the final dump order stands
    state = restorer.state.read()
    assert (outcome.checkpoint_id, state.job_status, state.generation) == ("0001-g1-periodic", "running", 2)
    assert state.final_dumps["2"].status == "running"


class _CriuWithoutTheMount:
    """CRIU on a backup that lacks a mount the job's VM had, as CRIU 4.1 says it (the path is not known there)."""

    def restore(self, images, logs, **options):
        log = "(00.004210) Error (criu/mount.c:3131): mnt: No mapping for 125:(null) mountpoint\n"
        raise CriuError("restore", "mnt: No mapping for 125:(null) mountpoint", log.strip(), log)

    def supports(self, feature):
        return False


@pytest.mark.claim("A mount the backup lacks ends in a start from scratch, not FAILED")
def test_a_mount_no_backup_has_ends_the_walk_in_a_start_from_scratch(tmp_path):
    # Given two intact checkpoints of a job whose VM had a mount the backups lack (the user's boot script made it)
    clock = [0.0]
    store = _WalkStore({"0002-g1-periodic": "ok", "0001-g1-periodic": "ok"}, clock)
    restorer = _restorer(tmp_path, store, clock)
    restorer.criu = cast(Any, _CriuWithoutTheMount())
    # When the backup restores
    with pytest.raises(RestoreError, match="No mapping for") as raised:
        restorer.restore(1)
    # Then it tried each checkpoint, and the failure says nothing is restorable: where allowed, the job starts over
    assert store.fetched == ["0002-g1-periodic", "0001-g1-periodic"]
    assert raised.value.nothing_restorable


def test_a_checkpoint_names_the_mount_a_restore_lacks_before_criu_runs():
    # Given the mounts a checkpoint recorded, and this VM's, which lack /data
    here = (
        "22 1 259:1 / / rw,relatime - ext4 /dev/root rw\n"
        "23 22 0:21 / /proc rw - proc proc rw\n"
        "24 22 0:30 / /var/lib/spotcr rw - ext4 /dev/nvme1n1 rw\n"
    )
    record = {"mounts": ["/data", "/var/lib/spotcr"]}
    # Then the check names the missing mount and is final for every backup
    with pytest.raises(MissingMount, match="had /data mounted") as raised:
        check_mounts(record, here)
    assert permanent(raised.value)
    check_mounts({"mounts": ["/var/lib/spotcr"]}, here)
    check_mounts({}, here)  # a checkpoint made before mounts were recorded: CRIU's own words decide
