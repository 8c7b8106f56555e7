"""The agent prints each command's result line as the shared vectors in tests/events/results/, which the functions'
parser reads too (tests/contracts/test_results.py)."""

import json
from pathlib import Path

import pytest
from spotcr_agent import agent as agent_module
from spotcr_agent import cli
from spotcr_agent.agent import Agent
from spotcr_agent.checkpoint import CheckpointOutcome
from spotcr_agent.restore import RestoreOutcome
from spotcr_agent.state import FinalDump, StateFile

from .conftest import make_config

VECTORS = sorted((Path(__file__).parents[1] / "events" / "results").glob("*.json"))


def _argv(command: str, line: dict) -> list[str]:
    """The command SSM runs for the order the line answers (the job the vector's agent does not run, for a refusal)."""
    if "job_id" not in line:
        return [command, "--job", "job-2", "--generation", "1"]
    argv = [command, "--job", line["job_id"]]
    if command == "status":
        return argv
    argv += ["--generation", str(line["generation"]), "--run", line["run_id"]]
    return argv + (["--kind", line["kind"]] if command == "checkpoint" else ["--attempt", line["attempt"]])


def _given_the_vectors_outcome(monkeypatch, config, line: dict) -> None:
    """The agent's operation ends as the vector says: committed or restored with its figures, or failed."""

    def checkpoint(self, kind, generation, sequence=None, reclaim_at=None):
        if not line["ok"]:
            raise RuntimeError(line["error"])
        figures = {k: line[k] for k in ("checkpoint_id", "kind", "seconds", "frozen_seconds", "bytes_total")}
        more = ("bytes_uploaded", "already_taken", "gpu_memory_bytes", "memory_tracking", "scratch")
        plan = ("predicted_final_seconds", "next_interval_s", "deadline_risk")
        return CheckpointOutcome(
            **figures, **{k: line[k] for k in more + plan}, generation=line["dump_generation"], criu_seconds=1.0
        )

    def restore(self, generation, checkpoint_id=None, attempt="", sequence=None):
        if not line["ok"]:
            raise RuntimeError(line["error"])
        figures = {k: line[k] for k in ("checkpoint_id", "seconds", "pid", "skipped", "running_seconds", "lazy")}
        return RestoreOutcome(**figures, generation=generation)

    monkeypatch.setattr(Agent, "checkpoint", checkpoint)
    monkeypatch.setattr(Agent, "restore", restore)
    monkeypatch.setattr(Agent, "store", lambda self: None)  # the kept CRIU logs are the vector's
    monkeypatch.setattr(agent_module, "kept_criu_logs", lambda store: line.get("criu_logs", []))
    with StateFile(config.state_dir).locked() as state:
        state.run_id = config.run_id
        state.generation = line.get("generation", 1)
        ended = "exited" if line.get("exit_code") is not None else "running"
        state.job_status = line.get("job_status", "stopped" if line.get("job_stopped") else ended)
        state.job_pid = line.get("job_pid", 0)
        state.exit_code = line.get("exit_code")
        state.result = line.get("result", "")
        state.result_error = line.get("result_error", "")
        state.result_missing = line.get("result_missing", "")
        state.last_checkpoint = line.get("last_checkpoint")
        if line.get("final_dumps"):
            state.final_dumps = {k: FinalDump(v, 1) for k, v in line["final_dumps"].items()}


@pytest.mark.claim("Facts come from authenticated sources")
@pytest.mark.parametrize("vector", VECTORS, ids=lambda p: p.stem)
def test_the_agent_prints_each_result_as_its_vector(vector, tmp_path, monkeypatch, capsys):
    # Given the vector, and an agent on its instance whose operation ends as the vector says
    doc = json.loads(vector.read_text())
    line = doc["line"]
    config = make_config(tmp_path, instance_id=line.get("instance_id", "i-vm1"))
    config.write(tmp_path / "agent.json")
    _given_the_vectors_outcome(monkeypatch, config, line)

    # When SSM runs the command
    code = cli.main(_argv(doc["command"], line), {"SPOTCR_AGENT_CONFIG": str(tmp_path / "agent.json")})

    # Then its one line on stdout is the vector, key for key, and it exits 0 only when it did what was asked
    [printed] = capsys.readouterr().out.splitlines()
    assert json.loads(printed) == line
    assert list(json.loads(printed)) == list(line)
    assert code == (cli.OK if line["ok"] else cli.BAD_INPUT if "job_id" not in line else cli.FAILED)
