"""The agent service loop: ready, start the job once, report its exit, final dump on the IMDS notice.

The job runs with the service in a bare local VM (rehearsal.vm), never on the host."""

import sys

from .vm_agent import JobVM


def test_daemon_starts_the_job_once_and_reports_its_exit(bare_vm, storage):
    # Given a run-mode agent and no interruption notice
    job = JobVM(bare_vm(shared_storage=storage), command=(sys.executable, "-c", "raise SystemExit(7)"))
    # When the service runs until the job has ended
    job.agent("service", "until-exit")
    # Then it said it was ready, started the job, and reported its exit code
    events = job.all_events()
    assert [e["type"] for e in events] == ["AgentReady", "JobStarted", "JobExited"]
    assert events[0]["mode"] == "run"
    assert events[2]["exit_code"] == 7
    # And a restarted service does not run the job again
    job.agent("service", "once")
    assert [e["type"] for e in job.all_events()][3:] == ["AgentReady"]


def test_daemon_in_restore_mode_waits_and_ignores_a_notice_with_no_job(bare_vm, storage):
    job = JobVM(bare_vm(shared_storage=storage), mode="restore")
    job.agent("service", "once", "notice")
    assert [e["type"] for e in job.all_events()] == ["AgentReady"]
    assert job.agent("status")["job_status"] == "none"
