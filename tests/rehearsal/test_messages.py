"""What the rehearsal tells its user: each fact once, and a remedy the user can act on."""

import shlex
import subprocess
import time
from types import SimpleNamespace

import pytest
from spotcr_agent.carry import REFUSED, ROLLBACK_JOURNAL
from spotcr_contracts import events
from spotcr_functions.config import ENV

from rehearsal import asset
from rehearsal.scenario import Options, Rehearsal, RehearsalFailed, Watcher, no_checkpoint_remedy
from rehearsal.timeline import Timeline
from rehearsal.vm import REPO

IO_URING = REFUSED + "pid 7 (node) holds anon_inode:[io_uring], which CRIU cannot dump (Node.js: set UV_USE_IO_URING=0)"
JOURNAL = REFUSED + f"pid 9 (python3) holds the SQLite database /var/lib/spotcr/work/j/db.sqlite {ROLLBACK_JOURNAL}"


def test_a_final_dump_reported_again_when_ordered_is_shown_and_listed_once():
    # Given the agent's final dump on its own notice, then the same dump reported again for the control plane's order
    lines: list[str] = []
    timeline = Timeline(echo=lines.append)
    watcher = Watcher(timeline)
    dump = events.CheckpointCompleted(
        "j", "i-1", 0, "2026-11-26T07:00:00Z", checkpoint_id="1795678029499-g0-s1-final", kind="final", seconds=1.5
    )

    # When both reach the bus
    watcher(dump.to_entry("bus"))
    watcher(dump.to_entry("bus"))

    # Then it is printed, drawn and listed once
    assert len([line for line in lines if "final checkpoint 1795678029499-g0-s1-final" in line]) == 1
    assert len(timeline.find("final-dump", "i-1")) == 1
    assert [d["checkpoint_id"] for d in watcher.final_dumps] == ["1795678029499-g0-s1-final"]


def test_refused_dumps_end_the_run_with_the_refusal_and_the_exact_command_to_rehearse_instead():
    options = Options(command="node server.js --port 8080", result_file="out.txt")

    message = no_checkpoint_remedy(options, ["CRIU failed", IO_URING])

    assert message.startswith(f"every periodic dump was refused: {IO_URING}")
    assert "--command 'env UV_USE_IO_URING=0 node server.js --port 8080'" in message
    assert "runs longer than --interval" not in message


def test_a_rollback_journal_refusal_ends_with_the_switch_to_wal():
    message = no_checkpoint_remedy(Options(command="python3 db.py", result_file="out.txt"), [JOURNAL])

    assert JOURNAL in message and "PRAGMA journal_mode=WAL" in message
    assert "runs longer than --interval" not in message


def test_without_a_refusal_a_job_shorter_than_the_interval_is_told_so():
    message = no_checkpoint_remedy(Options(interval_s=10), ["CRIU failed: something else"])

    assert "rehearse a job that runs longer than --interval (10 s)" in message


def test_make_demo_prints_the_rehearsals_own_exit_code():
    # Given a rehearsal that cannot complete (a --result the tag refuses): it exits 2, and make with 2 whatever it was
    run = subprocess.run(
        ["make", "--no-print-directory", "-o", "where", "-o", "setup", "demo", "ARGS=--command true --result ../x"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )

    # Then the rehearsal's own code is the last thing it says
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-2] == (
        "make demo: the rehearsal exited with 2 (1: the results differ, 2: it could not complete)"
    )


def _rehearsal_of_a_job_that_ended(tmp_path, **options):
    """A rehearsal whose job's record says it exited on its primary, on a cloud where no workflow runs."""
    sfn = SimpleNamespace(list_executions=lambda **kwargs: {"executions": []})
    cloud = SimpleNamespace(
        vms={}, settings_env={ENV["recovery_state_machine_arn"]: "arn:sm"}, client=lambda service: sfn
    )
    rehearsal = Rehearsal(Options(runs_dir=tmp_path, timeout_s=20, **options), cloud=cloud)  # type: ignore[arg-type]
    rehearsal.job_record = lambda: {"status": "COMPLETED", "exit_code": "0", "instance_id": "i-1"}  # type: ignore[method-assign]
    return rehearsal


def test_a_job_that_ends_before_its_interruption_moved_it_ends_the_rehearsal_at_once(tmp_path):
    # Given a job that ended on its primary after its periodic checkpoint, before the warning's recovery restored it
    rehearsal = _rehearsal_of_a_job_that_ended(tmp_path)
    rehearsal._await_periodic = lambda *args: None
    rehearsal._interrupt = lambda *args: 0.0

    # When the rehearsal waits for the restore
    started = time.monotonic()
    with pytest.raises(RehearsalFailed) as failed:
        rehearsal._interruption(1, "i-1", 0)

    # Then it says so at once, not after its whole timeout
    assert time.monotonic() - started < 10
    assert "the job exited with 0 on i-1 before interruption 1 moved it to a backup" in str(failed.value)
    assert "rehearse a job that runs longer (more --steps)" in str(failed.value)


def test_a_job_that_ends_before_the_upgrade_ends_the_rehearsal_at_once(tmp_path):
    rehearsal = _rehearsal_of_a_job_that_ended(tmp_path, upgrade_at_s=600)

    with pytest.raises(RehearsalFailed, match="exited with 0 on i-1 before the upgrade at 600 s"):
        rehearsal._upgrade(600)


def test_each_boot_step_that_bootstrap_sh_times_is_read_back_and_printed_with_its_seconds():
    # Given the console of a VM whose boot timed its steps with bootstrap.sh's own done_step
    script = f"""
    source {shlex.quote(str(REPO / "vm-bootstrap" / "bootstrap.sh"))}
    say() {{ echo "spotcr-bootstrap: $*"; }}
    step=ssm-agent; mark=$(now_ms); done_step
    step=asset; say "fetching the agent from s3://assets/abc.zip"; sleep 0.3
    say "agent asset of deployment 2"; done_step
    step=install; done_step
    """
    console = (
        "vm-init: address 10.0.0.2\n"
        + subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    )

    # When it is read back
    boot = asset.read_boot(console)

    # Then each step has its seconds, in order, with the asset it installed
    assert list(boot.phases_s) == ["ssm-agent", "asset", "install"]
    assert 0.3 <= boot.phases_s["asset"] < 2.0 and boot.phases_s["install"] < 0.5
    assert (boot.asset_url, boot.deployment) == ("s3://assets/abc.zip", "deployment 2")

    # And the ready line and the timeline show them, with what the steps leave out of launch to ready
    lines: list[str] = []
    timeline = Timeline(echo=lines.append)
    watcher = Watcher(timeline, console=lambda vm: console if vm == "i-1" else "")
    watcher(events.AgentReady("j", "i-1", 0, "2026-11-26T07:00:00Z", mode="run").to_entry("bus"))
    steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in boot.phases_s.items())
    assert boot.describe(5.0) == f"{steps}, other {5.0 - sum(boot.phases_s.values()):.1f} s"
    assert f"({steps}, other " in next(line for line in lines if "agent ready on i-1" in line)
    assert timeline.find("ready", "i-1")[0].data["boot_phases_s"] == boot.phases_s
