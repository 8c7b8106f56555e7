"""The `spotcr` command without a cloud: parsing, tag validation, output, optional commands, the stack's outputs."""

import io
import json
import sys
import types
from typing import Any

import pytest
from spotcr_cli import actions, render
from spotcr_cli.aws import CommandError, StackOutputs
from spotcr_cli.main import build_parser, main
from spotcr_contracts import fis

OUTPUTS = {
    "CheckpointBucket": "bucket",
    "JobTable": "jobs",
    "LaunchTemplateId": "lt-0123",
    "LaunchTemplateVersion": "3",
    "RecoveryStateMachineArn": "arn:aws:states:us-east-1:123456789012:stateMachine:spotcr-recovery",
    "JobSubnets": "subnet-a,subnet-b",
    "InterruptExperimentTemplate": "EXT1",
}


def submit(*argv):
    return main(["--endpoint-url", "http://127.0.0.1:9", "submit", *argv], out=io.StringIO())


@pytest.mark.parametrize(
    ("argv", "tag", "words"),
    [
        (["job-1", "--command", "python3 a.py", "--interval", "5"], "spotcr:interval", "between 10 and 86400"),
        (["job-1", "--command", "python3 a.py; rm -rf /"], "spotcr:command", "shell syntax ';'"),
        (["Job_1", "--command", "python3 a.py"], "spotcr:job", "1-63 of a-z"),
        (["job-1", "--command", "python3 a.py", "--workdir", "/etc"], "spotcr:workdir", "system directory"),
        (["job-1", "--command", "a", "--fallback-types", "m5.large,not a type"], "spotcr:fallback-types", "m5.large"),
        (["job-1", "--spec", "http://x/y"], "spotcr:spec", "s3://bucket/key"),
        (["job-1", "--command", "a", "--result", "model.bin,../etc/x"], "spotcr:result", "relative to the job's work"),
    ],
)
def test_submit_refuses_a_bad_tag_naming_the_tag_before_reaching_the_cloud(argv, tag, words, capsys):
    assert submit(*argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"spotcr submit: {tag}: ") and words in error


def test_submit_declares_the_jobs_result_files_in_its_tags():
    chosen = actions.job_tags(
        "job-1",
        command="a",
        spec=None,
        storage=None,
        interval_s=None,
        fallback_types=None,
        workdir=None,
        tcp=None,
        restart_from_scratch=None,
        result="model.bin,out/log.txt",
    )
    assert chosen["spotcr:result"] == "model.bin,out/log.txt"


def test_submit_wants_a_command_or_a_spec_not_both(capsys):
    with pytest.raises(SystemExit) as exit_:
        submit("job-1", "--command", "a", "--spec", "s3://bucket/spec.json")
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        submit("job-1")


def test_every_read_command_takes_json():
    parser = build_parser()
    for command in ("jobs", "status", "checkpoints", "logs", "submit", "restore", "interrupt", "cancel"):
        extra = {"jobs": [], "submit": ["j", "--command", "a"], "restore": ["j", "--checkpoint", "x"]}
        args = parser.parse_args([command, *extra.get(command, ["j"]), "--json"])
        assert args.json is True and callable(args.func)


def test_the_plan_engineers_commands_are_registered_when_present_and_skipped_when_absent(monkeypatch):
    # Given no spotcr_cli.plan module, the parser still builds
    monkeypatch.setitem(sys.modules, "spotcr_cli.plan", None)
    monkeypatch.setitem(sys.modules, "spotcr_cli.probe", None)
    assert "plan" not in build_parser().format_help()
    # When a module exposes register(subparsers), its command is there with its func
    plan = types.ModuleType("spotcr_cli.plan")

    def register(subparsers):
        subparsers.add_parser("plan").set_defaults(func=lambda args: 7)

    plan.register = register  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "spotcr_cli.plan", plan)
    assert main(["plan"], out=io.StringIO()) == 7


def test_stack_outputs_name_what_is_missing():
    stack = StackOutputs.from_outputs("spotcr", OUTPUTS)
    assert stack.subnets == ("subnet-a", "subnet-b")
    assert stack.experiment_template(fis.INTERRUPT) == "EXT1"
    with pytest.raises(CommandError, match="no FIS experiment template for 'rebalance-first'"):
        stack.experiment_template(fis.REBALANCE_FIRST)
    with pytest.raises(CommandError, match="has no output JobTable"):
        StackOutputs.from_outputs("spotcr", {k: v for k, v in OUTPUTS.items() if k != "JobTable"})


def test_the_fis_templates_target_only_the_marked_running_spot_instance():
    template = fis.template(fis.REBALANCE_FIRST, "arn:aws:iam::123456789012:role/fis")
    target = template["targets"][fis.TARGET]
    assert target["resourceType"] == "aws:ec2:spot-instance" and target["selectionMode"] == "ALL"
    assert target["resourceTags"] == {"spotcr:interrupt": "requested"}
    action = template["actions"]["interrupt"]
    assert action["actionId"] == "aws:ec2:send-spot-instance-interruptions"
    assert fis.duration_s(action["parameters"]["durationBeforeInterruption"]) == 240
    assert fis.duration_s(fis.DURATIONS[fis.INTERRUPT]) == 120
    with pytest.raises(ValueError, match="PT2H"):
        fis.duration_s("PT2H")


def test_tables_align_and_say_dash_for_nothing():
    out = io.StringIO()
    render.table(("job", "state"), [("a-long-job", "RUNNING"), ("b", None)], out)
    assert out.getvalue().splitlines() == ["JOB         STATE", "a-long-job  RUNNING", "b           -"]
    assert (render.size(3 << 20), render.size(512), render.size(None)) == ("3.0 MiB", "512 B", "-")
    assert (render.age(42), render.age(600), render.age(7200 * 3)) == ("42s", "10m", "6.0h")
    assert render.money(None) == "unknown" and render.money(0.5) == "$0.5000"
    buffer = io.StringIO()
    render.as_json({"b": 1, "a": [1]}, buffer)
    assert json.loads(buffer.getvalue()) == {"a": [1], "b": 1}


def test_status_names_the_nodes_of_a_job_over_several_vms():
    from datetime import UTC, datetime

    from spotcr_cli import jobs
    from spotcr_cli.main import _print_status
    from spotcr_contracts.nodes import NodeRecord
    from spotcr_functions.models import JobRecord, Status

    nodes = (NodeRecord(0, "i-0a", "10.0.0.10"), NodeRecord(2, "i-0c", "10.0.0.12"))
    record = JobRecord(
        job_id="mpi-7",
        status=Status.PENDING,
        generation=0,
        instance_id="i-0a",
        az="us-east-1a",
        subnet_id="subnet-1",
        vpc_id="vpc-1",
        instance_type="c7i.large",
        storage="efs",
        interval_s=300,
        tags={},
        node_count=3,
        nodes=nodes,
    )
    unused: Any = types.SimpleNamespace()  # no cost asked: the view reads nothing from the cloud
    view = jobs.status_view(unused, record, datetime.now(UTC), with_cost=False)
    assert (view["node_count"], [n["instance_id"] for n in view["nodes"]]) == (3, ["i-0a", "i-0c"])
    out = io.StringIO()
    _print_status(
        {**view, "cost": {"cost_usd": 0.0, "hours": 0.0, "on_demand_usd": 0.0, "source": "-", "notes": []}}, out
    )
    assert "nodes                   2 of 3: 0 i-0a (10.0.0.10), 2 i-0c (10.0.0.12)" in out.getvalue()
