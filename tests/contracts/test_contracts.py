"""The shared contracts: tags (strict, hostile values refused), SSM documents and argv, agent events round trip."""

from __future__ import annotations

import json
import re

import pytest
from spotcr_contracts import commands, events, layout, tags


def _job(**extra: str) -> dict[str, str]:
    return {tags.JOB: "render-42", tags.COMMAND: "/opt/job/run --steps 1000", **extra}


def test_valid_tags_read_back_and_round_trip() -> None:
    spec = tags.parse_job_tags(
        _job(
            **{
                tags.STORAGE: "ebs",
                tags.INTERVAL: "120",
                tags.FALLBACK_TYPES: "m6i.large, c6i.large",
                tags.TCP: "close",
                tags.DEADLINE_MARGIN: "45",
                tags.RESULT: "model.bin, out/metrics.json",
                "Name": "x",
            }
        )
    )
    assert (spec.storage, spec.interval_s, spec.fallback_types) == ("ebs", 120, ("m6i.large", "c6i.large"))
    assert spec.tcp == "close" and tags.parse_job_tags(_job()).tcp == "established"
    assert spec.deadline_margin_s == 45 and tags.parse_job_tags(_job()).deadline_margin_s == 30
    assert spec.command == ("/opt/job/run", "--steps", "1000")
    assert spec.result_files == ("model.bin", "out/metrics.json")
    assert spec.extra == {"Name": "x"}
    assert tags.parse_job_tags(spec.to_tags()) == tags.JobSpec(**{**spec.__dict__, "extra": {}})


def test_a_command_tag_near_the_limit_is_carried_to_the_backup_as_written() -> None:
    # Given a valid command whose re-quoting (shlex.join) would be longer than a tag may be
    command = "python3 -c \"print('a') or print('b')\" " + "x" * 200
    spec = tags.parse_job_tags(_job(**{tags.COMMAND: command}))
    # Then the backup's tags carry it as the user wrote it, and read back the same
    assert spec.to_tags()[tags.COMMAND] == command
    assert tags.parse_job_tags(spec.to_tags()).command == spec.command


@pytest.mark.parametrize(
    ("bad", "tag"),
    [
        ({tags.COMMAND: "run; rm -rf /"}, tags.COMMAND),
        ({tags.COMMAND: "run && reboot"}, tags.COMMAND),
        ({tags.COMMAND: "run `id`"}, tags.COMMAND),
        ({tags.COMMAND: "run $(id)"}, tags.COMMAND),
        ({tags.COMMAND: "run > /etc/passwd"}, tags.COMMAND),
        ({tags.COMMAND: "run\nreboot"}, tags.COMMAND),
        ({tags.COMMAND: "'unterminated"}, tags.COMMAND),
        ({tags.COMMAND: "x" * 257}, tags.COMMAND),
        ({tags.JOB: "a" * 64}, tags.JOB),
        ({tags.JOB: "Render"}, tags.JOB),
        ({tags.JOB: "-job"}, tags.JOB),
        ({tags.STORAGE: "nfs"}, tags.STORAGE),
        ({tags.INTERVAL: "9"}, tags.INTERVAL),
        ({tags.INTERVAL: "86401"}, tags.INTERVAL),
        ({tags.INTERVAL: "-5"}, tags.INTERVAL),
        ({tags.INTERVAL: "1e3"}, tags.INTERVAL),
        ({tags.FALLBACK_TYPES: "m5.large;reboot"}, tags.FALLBACK_TYPES),
        ({tags.FALLBACK_TYPES: ",".join(["m5.large"] * 9)}, tags.FALLBACK_TYPES),
        ({tags.MODE: "debug"}, tags.MODE),
        ({tags.SPEC: "https://example.com/job.json"}, tags.SPEC),
        ({tags.WORKDIR: "relative/dir"}, tags.WORKDIR),
        ({tags.WORKDIR: "/opt/../etc"}, tags.WORKDIR),
        ({tags.TCP: "keep"}, tags.TCP),
        ({tags.DEADLINE_MARGIN: "111"}, tags.DEADLINE_MARGIN),
        ({tags.DEADLINE_MARGIN: "-1"}, tags.DEADLINE_MARGIN),
        ({tags.RESULT: "/etc/passwd"}, tags.RESULT),
        ({tags.RESULT: "../model.bin"}, tags.RESULT),
        ({tags.RESULT: "model.bin,,log"}, tags.RESULT),
    ],
)
def test_hostile_or_invalid_tag_values_name_the_tag(bad: dict[str, str], tag: str) -> None:
    with pytest.raises(tags.InvalidJobTags) as raised:
        tags.parse_job_tags(_job(**bad))
    assert raised.value.tag == tag
    assert str(raised.value).startswith(f"{tag}: ")


def test_a_job_needs_a_command_or_a_spec() -> None:
    with pytest.raises(tags.InvalidJobTags, match="spotcr:command"):
        tags.parse_job_tags({tags.JOB: "j"})
    assert tags.parse_job_tags({tags.JOB: "j", tags.SPEC: "s3://my-bucket/jobs/j.json"}).spec_uri


@pytest.mark.parametrize("command", commands.COMMANDS.values(), ids=commands.COMMANDS.keys())
def test_documents_pass_parameters_as_environment_never_in_the_script(command: commands.Command) -> None:
    document = command.document()
    assert document["schemaVersion"] == "2.2"
    parameters = document["parameters"]
    assert isinstance(parameters, dict)
    for spec in parameters.values():
        assert spec["interpolationType"] == "ENV_VAR"
        assert spec["allowedPattern"].startswith("^")
    steps = document["mainSteps"]
    assert isinstance(steps, list)
    [step] = steps
    script = " ".join(step["inputs"]["runCommand"])
    assert "{{" not in script  # no {{ Parameter }} splicing into the shell line
    assert script.startswith(f"exec {commands.AGENT_BIN} {command.name} ")


def test_agent_argv_is_typed_and_checked() -> None:
    argv = commands.CHECKPOINT.agent_argv({"JobId": "job-1", "Generation": "7", "Kind": "final"})
    assert argv == [commands.AGENT_BIN, "checkpoint", "--job", "job-1", "--generation", "7", "--kind", "final"]
    assert commands.RESTORE.agent_argv({"JobId": "job-1", "Generation": "7"})[-2:] == ["--generation", "7"]
    for hostile in ({"JobId": "job;reboot"}, {"Generation": "7 --kind final"}, {"Kind": "final\n"}):
        with pytest.raises(ValueError, match="fails"):
            commands.CHECKPOINT.agent_argv({"JobId": "job-1", "Generation": "7", "Kind": "final", **hostile})
    with pytest.raises(ValueError, match="required"):
        commands.RELEASE.agent_argv({"JobId": "job-1"})


def test_checkpoints_order_by_generation_then_the_control_planes_sequence_never_the_vms_clock() -> None:
    # The VMs' clocks run backwards across these; the control plane's generation and sequence decide
    newest_first = [
        commands.checkpoint_id(1795293000000, 3, "periodic", 9),
        # A backup (clock 120 s behind) whose restore order was sequence 7: its dumps rank after the primary's
        commands.checkpoint_id(1795293000001, 2, "periodic", 8),
        commands.checkpoint_id(1795293000000, 2, "final", 7),  # its final on its own notice, before any dump order
        # The primary's final on its own notice at the bumped generation: the highest sequence it was given
        commands.checkpoint_id(1795293999999, 2, "final", 6),
        commands.checkpoint_id(1795299000000, 1, "final", 6),  # a final ranks after a periodic of its sequence
        commands.checkpoint_id(1795299000001, 1, "periodic", 6),
        "1795299999999-g1-final",  # a dump on a VM never given a sequence ranks first in its generation
        commands.checkpoint_id(1795299000000, 0, "periodic", 1),
    ]
    assert all(re.fullmatch(commands.CHECKPOINT_ID_PATTERN, i) for i in newest_first)
    assert sorted(newest_first, key=commands.checkpoint_order, reverse=True) == newest_first
    assert newest_first[1] == "1795293000001-g2-s8-periodic"
    argv = commands.CHECKPOINT.agent_argv({"JobId": "job-1", "Generation": "2", "Kind": "periodic", "Sequence": "8"})
    assert argv[-2:] == ["--sequence", "8"]


@pytest.mark.parametrize("cls", events.EVENT_TYPES.values(), ids=events.EVENT_TYPES.keys())
def test_every_agent_event_round_trips(cls: type[events.AgentEvent]) -> None:
    event = cls(job_id="job-1", instance_id="i-0123456789abcdef0", generation=3, at="2026-11-21T20:30:00.123Z")
    entry = event.to_entry("spotcr-agent")
    assert (entry["Source"], entry["DetailType"], entry["EventBusName"]) == (
        events.SOURCE,
        cls.DETAIL_TYPE,
        "spotcr-agent",
    )
    assert events.parse_detail(entry["DetailType"], json.loads(entry["Detail"])) == event


@pytest.mark.parametrize(
    "detail",
    [
        {"version": 2, "job_id": "j", "instance_id": "i", "generation": 1, "at": "t"},
        {"version": 1, "instance_id": "i", "generation": 1, "at": "t"},
        {"version": 1, "job_id": "j", "instance_id": "i", "generation": "1", "at": "t"},
        {"version": 1, "job_id": "j", "instance_id": "i", "generation": True, "at": "t"},
    ],
)
def test_malformed_agent_events_are_refused(detail: dict[str, object]) -> None:
    with pytest.raises(events.InvalidEvent):
        events.parse_detail("JobStarted", detail)


def test_the_store_layout_keeps_each_runs_result_apart_from_its_checkpoints_and_logs() -> None:
    run = "r-0123456789abcdef"
    assert layout.run_prefix("job-1", run) == f"jobs/job-1/runs/{run}/"
    assert layout.run_prefix("job-1") == layout.job_prefix("job-1") == "jobs/job-1/"  # a store used without runs
    assert layout.result_prefix("job-1", run) == f"jobs/job-1/runs/{run}/result/"
    results = (f"jobs/job-1/runs/{run}/result/manifest.json", "jobs/job-1/result/manifest.json")
    others = (
        f"jobs/job-1/runs/{run}/checkpoints/x.json",
        f"jobs/job-1/{layout.CRIU_LOGS}/1-dump-x.log",
        "jobs/job-10/result/manifest.json",
        f"jobs/job-1/runs/{run}/chunks/result",
    )
    assert [layout.is_result_key("job-1", key) for key in (*results, *others)] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]
