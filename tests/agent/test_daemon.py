"""The agent service loop: ready, start the job once, report its exit, final dump on the IMDS notice."""

import sys
import threading

from spotcr_agent import daemon

from .conftest import FakeMetadata, make_agent, make_config, wait_for


def test_daemon_starts_the_job_once_and_reports_its_exit(tmp_path, publisher):
    # Given a run-mode agent and no interruption notice
    agent = make_agent(make_config(tmp_path, command=(sys.executable, "-c", "raise SystemExit(7)")), publisher)
    stop = threading.Event()
    loop = threading.Thread(target=daemon.run, args=(agent, FakeMetadata(), stop, 0.05))
    # When the service runs until the job has ended
    loop.start()
    try:
        wait_for(lambda: publisher.of("JobExited"), what="JobExited")
    finally:
        stop.set()
        loop.join()
    # Then it said it was ready, started the job, and reported its exit code
    assert [e.DETAIL_TYPE for e in publisher.events] == ["AgentReady", "JobStarted", "JobExited"]
    assert publisher.events[0].mode == "run"
    assert publisher.events[2].exit_code == 7
    # And a restarted service does not run the job again
    daemon.run(agent, FakeMetadata(), _stopped(), 0.05)
    assert [e.DETAIL_TYPE for e in publisher.events][3:] == ["AgentReady"]


def test_daemon_in_restore_mode_waits_and_ignores_a_notice_with_no_job(tmp_path, publisher):
    agent = make_agent(make_config(tmp_path, mode="restore"), publisher)
    notice = FakeMetadata({"meta-data/spot/instance-action": '{"action":"terminate"}'})
    daemon.run(agent, notice, _stopped(), 0.05)
    assert [e.DETAIL_TYPE for e in publisher.events] == ["AgentReady"]
    assert agent.status()["job_status"] == "none"


def _stopped():
    stop = threading.Event()
    stop.set()
    return stop
