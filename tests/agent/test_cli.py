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
    "final-dump": [
        {"Orders": "i-0123456789abcdef0:job-1:r-0123456789abcdef:7:3"},
        {"Orders": "i-0abc1234:a::0:1,i-0123456789abcdef0:job-1:r-0123456789abcdef:7:3"},
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
        if name == "final-dump":
            assert args.orders == values["Orders"]
            continue
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


MINE, OTHER = "i-0123456789abcdef0", "i-0fedcba987654321f"


@pytest.fixture
def in_a_wave(tmp_path):
    """A VM whose instance id can stand in a final-dump command's orders."""
    config = make_config(tmp_path, instance_id=MINE)
    path = tmp_path / "agent.json"
    config.write(path)
    return config, {"SPOTCR_AGENT_CONFIG": str(path), "PATH": "/usr/bin:/bin"}


def test_a_final_dump_command_is_answered_for_this_instances_own_order(in_a_wave, capsys):
    # Given a VM that already serves generation 5
    config, environ = in_a_wave
    with StateFile(config.state_dir).locked() as state:
        state.generation = 5
    # When a wave's final-dump command names another VM's order and this VM's, at generation 4
    orders = f"{OTHER}:other-job::9:9,{MINE}:job-1::4:2"
    code, result = run(["final-dump", "--orders", orders], environ, capsys)
    # Then it answers its own order (fenced off: stale), naming it as the checkpoint command would
    assert code == 3
    assert (result["job_id"], result["generation"], result["kind"], result["stale"]) == ("job-1", 4, "final", True)


@pytest.mark.parametrize(
    ("orders", "message"),
    [
        (f"{OTHER}:other-job::9:9", f"holds 0 orders for {MINE}, not one"),
        (f"{MINE}:job-1::4:2,{MINE}:job-1::5:3", f"holds 2 orders for {MINE}, not one"),
        (f"{MINE}:job-1::4", "does not match"),
        (f"{MINE}:other-job::4:2", "this VM runs job 'job-1', not 'other-job'"),
    ],
)
def test_a_final_dump_command_without_one_order_for_this_instance_is_refused(in_a_wave, capsys, orders, message):
    _, environ = in_a_wave
    code, result = run(["final-dump", "--orders", orders], environ, capsys)
    assert code == 2
    assert message in result["error"]


NODES = ("10.0.0.10", "10.0.0.11")
LAUNCH_KEY = "ab" * 32


@pytest.mark.parametrize(
    ("nodes", "overrides", "message"),
    [
        (NODES[:1], {}, "nodes: a multi-node job has two or more distinct addresses"),
        ((NODES[0], NODES[0]), {}, "two or more distinct addresses"),
        (NODES, {"node_index": 2}, "node_index: must be from 0 to 1, got 2"),
        (NODES, {"launch_key": "ab" * 8}, "launch_key: a multi-node job needs the run's launch key"),
    ],
)
def test_a_multi_node_config_that_cannot_work_is_refused(tmp_path, nodes, overrides, message):
    values = {"launch_key": LAUNCH_KEY, **overrides}
    with pytest.raises(ConfigError, match=message):
        make_config(tmp_path, nodes=nodes, **values)


def test_a_dump_order_to_another_node_than_node_0_is_refused(tmp_path, capsys):
    # Given node 1 of a two-node job
    config = make_config(tmp_path, nodes=NODES, node_index=1, launch_key=LAUNCH_KEY)
    config.write(tmp_path / "agent.json")
    environ = {"SPOTCR_AGENT_CONFIG": str(tmp_path / "agent.json"), "PATH": "/usr/bin:/bin"}

    # When a checkpoint command reaches it, then it refuses, naming the node that coordinates
    code, result = run(["checkpoint", "--job", "job-1", "--generation", "1", "--kind", "periodic"], environ, capsys)
    assert code == 2
    assert "node 1 of a multi-node job: dumps are ordered to node 0" in result["error"]
