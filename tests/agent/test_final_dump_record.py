"""The record of a run's one final dump, read by every later trigger (no CRIU needed)."""

import subprocess

from spotcr_agent.state import FinalDump

from .conftest import make_agent, make_config


def test_a_duplicated_final_dump_command_reports_the_dump_taken_by_a_process_that_has_exited(tmp_path, publisher):
    # Given a final dump taken and recorded by an SSM command process that has since exited
    agent = make_agent(make_config(tmp_path), publisher)
    done = subprocess.Popen(["true"])
    done.wait()
    taken = {
        "checkpoint_id": "1795293235815-g1-final",
        "kind": "final",
        "generation": 1,
        "seconds": 1.5,
        "frozen_seconds": 0.5,
        "bytes_total": 100,
        "bytes_uploaded": 50,
    }
    with agent.state.locked() as state:
        state.generation, state.job_status = 1, "checkpointed"
        state.final_dumps["1"] = FinalDump("done", done.pid, taken)

    # When the same command arrives again (EventBridge and SSM deliver at least once)
    outcome = agent.checkpoint("final", 1)

    # Then it reports the dump already taken, and the record of it stays intact
    assert outcome.already_taken
    assert outcome.checkpoint_id == taken["checkpoint_id"]
    assert publisher.of("CheckpointFailed") == []
    final = agent.state.read().final_dump()
    assert final is not None
    assert (final.status, final.result) == ("done", taken)
