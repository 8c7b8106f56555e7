"""One identity per run: the agent's half (no CRIU needed; the jobs started here are never dumped)."""

import sys
import threading

import pytest
from spotcr_agent import daemon
from spotcr_agent.agent import Agent, WrongJob, base_job_env
from spotcr_agent.store import CheckpointMeta, CheckpointStore
from spotcr_contracts import tags

from .conftest import FakeMetadata, kill_tree, make_config

pytestmark = pytest.mark.claim("One identity per run")

OLD_RUN = "r-00000000000000b0"
NEW_RUN = "r-00000000000000b1"
SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)")


def _stopped():
    stop = threading.Event()
    stop.set()
    return stop


def _tags(values):
    """IMDS with these instance tags (instance metadata tags on)."""
    paths = {"meta-data/tags/instance": "\n".join(values)}
    paths.update({f"meta-data/tags/instance/{k}": v for k, v in values.items()})
    return FakeMetadata(paths)


def _agent(tmp_path, publisher, **overrides):
    config = make_config(tmp_path, **{"run_id": "", "command": SLEEPER, **overrides})
    config.mount_point.mkdir(parents=True, exist_ok=True)

    def run_store(cfg):
        return CheckpointStore.for_directory(cfg.mount_point, cfg.job_id, run_id=cfg.run_id)

    return Agent(config=config, publisher=publisher, job_env=base_job_env({}), store_factory=run_store)


def test_a_refused_instance_never_starts_the_job(tmp_path, publisher):
    # Given a VM booted with the job's tags but not (yet) its run: the name may run elsewhere
    agent = _agent(tmp_path, publisher)

    # When the daemon polls while the control plane has not decided, then after it refused this instance
    daemon.run(agent, _tags({tags.JOB: "job-1"}), _stopped(), 0.05)
    refused = {tags.JOB: "job-1", tags.ERROR: "spotcr:job: job job-1 already runs on i-other"}
    daemon.run(agent, _tags(refused), _stopped(), 0.05)

    # Then the job never started here, and the agent said only that it is up (with no run)
    assert agent.status().job_status == "none"
    assert [e.DETAIL_TYPE for e in publisher.events] == ["AgentReady", "AgentReady"]
    assert {e.run_id for e in publisher.events} == {""}


def test_the_registered_instance_starts_the_job_with_its_run_and_refuses_another_runs_commands(tmp_path, publisher):
    # Given the control plane registered this instance: spotcr:run is on it
    agent = _agent(tmp_path, publisher)
    daemon.run(agent, _tags({tags.JOB: "job-1", tags.RUN: NEW_RUN}), _stopped(), 0.05)
    try:
        # Then the job started, and every event carries the run
        [started] = publisher.of("JobStarted")
        assert started.run_id == NEW_RUN
        assert (agent.status().job_status, agent.status().run_id) == ("running", NEW_RUN)
        # And a command for another run of the same name is refused before it touches the job
        with pytest.raises(WrongJob, match=f"not run {OLD_RUN}"):
            agent.check_job("job-1", OLD_RUN)
        agent.check_job("job-1", NEW_RUN)
    finally:
        kill_tree(agent.state.read().job_pid)


def test_a_backup_of_a_reused_name_never_restores_the_earlier_runs_checkpoint(tmp_path, publisher):
    # Given an earlier run of the job's name that committed a checkpoint (and completed)
    images = tmp_path / "images"
    images.mkdir()
    (tmp_path / "store").mkdir()
    (images / "pages-1.img").write_bytes(b"the earlier run's memory" * 100)
    old_store = CheckpointStore.for_directory(tmp_path / "store", "job-1", run_id=OLD_RUN)
    old = "1700000000001-g0-periodic"
    meta = CheckpointMeta(job_id="job-1", checkpoint_id=old, generation=0, kind="periodic", criu_version="4.1.1")
    old_store.commit(images, meta)
    assert old_store.checkpoint_ids() == [old]

    # When the new run is interrupted before its first checkpoint and its backup restores "the newest"
    backup = _agent(tmp_path, publisher, name="backup", mode="restore", run_id=NEW_RUN, generation=1)
    outcome = backup.restore(1)
    try:
        # Then it starts the job from the beginning instead of restoring the other run's process
        assert outcome.checkpoint_id == "" and "started from the beginning" in outcome.skipped
        [restored] = publisher.of("RestoreCompleted")
        assert (restored.run_id, restored.checkpoint_id) == (NEW_RUN, "")
        assert backup.store().checkpoint_ids() == []
    finally:
        kill_tree(outcome.pid)


def test_a_node_other_than_node_0_never_starts_the_jobs_command(tmp_path, publisher):
    # Given node 1 of a job over two VMs, registered for its run
    nodes = {"nodes": ("10.0.0.10", "10.0.0.11"), "node_index": 1, "launch_key": "ab" * 32, "storage": "efs"}
    agent = _agent(tmp_path, publisher, **nodes)

    # When its daemon watches, with the run's tag on its instance
    daemon._watch(agent, _tags({tags.JOB: "job-1", tags.RUN: NEW_RUN}), _stopped(), 0.05)

    # Then it never started the command: node 0 runs it
    assert agent.status().job_status == "none" and publisher.of("JobStarted") == []
