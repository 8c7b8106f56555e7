"""The CLI SSM runs: argv exactly as the contracts build it, one JSON line, exit codes 0/1/2/3."""

import json

import pytest
from spotcr_agent import cli
from spotcr_agent.config import AgentConfig, ConfigError
from spotcr_agent.state import StateFile
from spotcr_contracts.commands import AGENT_BIN, COMMANDS

from .conftest import make_config

SAMPLES = {
    "checkpoint": [
        {"JobId": "job-1", "Generation": "7", "Kind": "final"},
        {"JobId": "a", "Generation": "0", "Kind": "periodic"},
    ],
    "restore": [
        {"JobId": "job-1", "Generation": "7"},
        {"JobId": "job-1", "Generation": "7", "CheckpointId": "1795293235815-g7-final"},
    ],
    "release": [{"JobId": "job-1", "Generation": "12"}],
    "status": [{"JobId": "job-1"}],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_contract_command_parses_with_the_agent_cli(name):
    command = COMMANDS[name]
    for values in SAMPLES[name]:
        argv = command.agent_argv(values)
        assert argv[0] == AGENT_BIN
        args = cli.parser().parse_args(argv[1:])
        assert args.command == name
        assert args.job == values["JobId"]
        if "Generation" in values:
            assert args.generation == int(values["Generation"])
        if "Kind" in values:
            assert args.kind == values["Kind"]
        if name == "restore":
            assert args.checkpoint == (values.get("CheckpointId") or None)


@pytest.fixture
def configured(tmp_path):
    config = make_config(tmp_path)
    path = tmp_path / "agent.json"
    config.write(path)
    return config, {"SPOTCR_AGENT_CONFIG": str(path), "PATH": "/usr/bin:/bin"}


def run(argv, environ, capsys):
    code = cli.main(argv, environ)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    return code, json.loads(lines[0])


def test_status_prints_the_agents_view(configured, capsys):
    _, environ = configured
    code, result = run(["status", "--job", "job-1"], environ, capsys)
    assert code == 0
    assert result["ok"] and result["job_id"] == "job-1" and result["job_status"] == "none"
    # What the control plane ends a job from (exits.reported_exit): its exit code and where its result is, or why not
    assert (result["exit_code"], result["result"], result["result_error"]) == (None, "", "")


def test_a_stale_generation_is_refused_with_exit_code_3(configured, capsys):
    # Given a VM that already serves generation 5
    config, environ = configured
    with StateFile(config.state_dir).locked() as state:
        state.generation = 5
    # When a command for generation 4 arrives
    code, result = run(["checkpoint", "--job", "job-1", "--generation", "4", "--kind", "final"], environ, capsys)
    # Then it is fenced off, and says why
    assert code == 3
    assert "generation 4 is stale: this VM serves generation 5" in result["error"]
    # naming the order it answers, as the control plane reads it from SSM (checkpoints.on_checkpoint_command)
    assert (result["job_id"], result["generation"], result["kind"], result["stale"]) == ("job-1", 4, "final", True)
    code, result = run(["release", "--job", "job-1", "--generation", "4"], environ, capsys)
    assert code == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["checkpoint", "--job", "job-1", "--generation", "x1", "--kind", "final"],
            "generation must be a whole number",
        ),
        (["checkpoint", "--job", "job-1", "--generation", "1", "--kind", "hourly"], "invalid choice: 'hourly'"),
        (["restore", "--job", "job-1", "--generation", "1", "--checkpoint", "../etc"], "does not match"),
        (["status", "--job", "other-job"], "this VM runs job 'job-1', not 'other-job'"),
        (["explode"], "invalid choice"),
    ],
)
def test_bad_input_exits_2_with_a_clear_error(configured, capsys, argv, message):
    _, environ = configured
    code, result = run(argv, environ, capsys)
    assert code == 2
    assert message in result["error"]


def test_a_missing_config_says_to_bootstrap(tmp_path, capsys):
    code, result = run(["status", "--job", "job-1"], {"SPOTCR_AGENT_CONFIG": str(tmp_path / "none.json")}, capsys)
    assert code == 2
    assert "run `spotcr-agent bootstrap` first" in result["error"]


def test_a_missing_mount_is_a_clear_failure(configured, capsys):
    # Given efs storage whose mount point is a plain directory, not a mount
    config, environ = configured
    config.mount_point.mkdir(parents=True)
    code, result = run(["checkpoint", "--job", "job-1", "--generation", "1", "--kind", "periodic"], environ, capsys)
    assert code == 1
    assert f"storage efs: {config.mount_point} is not mounted" in result["error"]
    assert (result["ok"], result["kind"], result["generation"], result["job_stopped"]) == (False, "periodic", 1, False)


def test_unknown_storage_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="storage: unknown storage 'gcs'"):
        make_config(tmp_path, storage="gcs")


def test_config_round_trips_and_refuses_unknown_fields(tmp_path):
    config = make_config(tmp_path, env={"OMP_NUM_THREADS": "2"})
    assert AgentConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    with pytest.raises(ConfigError, match="unknown fields colour"):
        AgentConfig.from_json({**config.to_json(), "colour": "red"})
    with pytest.raises(ConfigError, match="generation: must be int"):
        AgentConfig.from_json({**config.to_json(), "generation": "1"})


@pytest.mark.claim("Facts come from authenticated sources")
@pytest.mark.parametrize("fails", [False, True])
def test_restore_prints_the_result_the_control_plane_reads_from_ssm(configured, capsys, monkeypatch, fails):
    # Given a restore that succeeds or fails on this VM
    from spotcr_agent.agent import Agent
    from spotcr_agent.restore import RestoreOutcome
    from spotcr_contracts.commands import command_result

    def restore(self, generation, checkpoint_id=None, attempt="", sequence=None):
        if fails:
            raise RuntimeError("checkpoint 1795293235815-g7-final is corrupt")
        return RestoreOutcome(checkpoint_id=checkpoint_id, generation=generation, seconds=1.5, pid=4242)

    monkeypatch.setattr(Agent, "restore", restore)
    config, environ = configured
    run_id = config.run_id
    argv = ["restore", "--job", "job-1", "--generation", "7", "--checkpoint", "1795293235815-g7-final"]

    # When SSM runs the restore command
    code, line = run([*argv, "--run", run_id, "--attempt", "previous"], environ, capsys)

    # Then it exits 0 only when restored, and its one line names the job, run, generation and attempt it answers
    # (SSM's GetCommandInvocation reports this line; spotcr_contracts.commands.command_result reads it)
    assert code == (1 if fails else 0)
    assert command_result(json.dumps(line) + "\n") == line
    named = (line["job_id"], line["run_id"], line["generation"], line["attempt"])
    assert named == ("job-1", run_id, 7, "previous")
    if fails:
        assert line["ok"] is False and "is corrupt" in line["error"]
    else:
        assert line["ok"] is True and (line["checkpoint_id"], line["pid"]) == ("1795293235815-g7-final", 4242)
