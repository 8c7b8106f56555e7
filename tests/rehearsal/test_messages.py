"""What the rehearsal tells its user: each fact once, and a remedy the user can act on."""

import subprocess

from spotcr_agent.carry import REFUSED, ROLLBACK_JOURNAL
from spotcr_contracts import events

from rehearsal.scenario import Options, Watcher, no_checkpoint_remedy
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
