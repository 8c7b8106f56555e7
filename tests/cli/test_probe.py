"""`spotcr probe`: the agent's probe run here on directories and S3, through the probe document, and read by plan.

Its S3 calls are evaluated as the principal making them in production: the `spotcr` user (infra/user_policy.py)
on the user's machine, a vended store session (tests/localaws/vended.py) on a job VM."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from spotcr_agent import cli as agent_cli
from spotcr_agent import config as agent_config
from spotcr_contracts.commands import AGENT_BIN, PROBE

from rehearsal.iam import enforce, principals
from tests.localaws.vended import ACCOUNT, REGION, Enforced, enforced

_CLI = str(Path(__file__).resolve().parents[2] / "cli")
if _CLI not in sys.path:  # harmless where pyproject's pythonpath already holds cli/
    sys.path.insert(0, _CLI)

from spotcr_cli import plan, probe  # noqa: E402

MIB = 1024 * 1024


def spotcr(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="spotcr")
    commands = parser.add_subparsers(dest="command", required=True)
    probe.register(commands)
    plan.register(commands)
    return parser.parse_args(argv)


SMALL = ["--streams", "1,3", "--block-kib", "64,256", "--size-mib", "1", "--pipeline-mib", "2"]


def check_result(result: dict[str, Any], storage: str, streams=(1, 3), blocks=(64, 256), size_mib=1) -> None:
    """Self-consistent: every configuration measured once, every byte written read back unchanged."""
    assert result["storage"] == storage
    measured = [(r["streams"], r["block_bytes"]) for r in result["runs"]]
    assert measured == [(s, b * 1024) for s in streams for b in blocks]
    for run in result["runs"]:
        assert run["bytes_written"] == run["streams"] * size_mib * MIB
        assert run["bytes_read"] == run["bytes_written"]
        assert run["verified"] is True
        assert run["write_s"] > 0 and run["read_s"] > 0
        assert run["write_mib_s"] == pytest.approx(run["bytes_written"] / MIB / run["write_s"])
    assert result["write_mib_s"] == max(r["write_mib_s"] for r in result["runs"])
    assert result["read_mib_s"] == max(r["read_mib_s"] for r in result["runs"])
    pipeline = result["pipeline"]
    assert pipeline["verified"] is True
    assert pipeline["bytes_total"] >= 2 * MIB  # the synthetic pages image, plus a small inventory
    # Half the pages are zero: compressed and deduplicated, the store holds less than it was given.
    assert 0 < pipeline["bytes_stored"] < pipeline["bytes_total"]
    assert result["pipeline_mib_s"] == pipeline["commit_mib_s"]


def test_probe_here_measures_each_directory_and_leaves_nothing_behind(tmp_path, capsys):
    ebs, scratch, out = tmp_path / "ebs", tmp_path / "scratch", tmp_path / "out"
    ebs.mkdir()
    scratch.mkdir()

    args = spotcr(["probe", "--dir", f"ebs={ebs}", "--dir", str(scratch), *SMALL, "--out", str(out), "--json"])
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out)

    ebs_result, local_result = printed["results"]
    check_result(ebs_result, "ebs")
    check_result(local_result, "local")  # a bare PATH is the scratch dir, where periodic dumps go
    assert ebs_result["location"] == str(ebs) and ebs_result["instance_type"] == "local"
    assert list(ebs.iterdir()) == [] and list(scratch.iterdir()) == []  # files and the pipeline's store removed
    assert sorted(p.name for p in out.iterdir()) == ["ebs.json", "local.json"]
    assert json.loads((out / "ebs.json").read_text()) == ebs_result


def test_probe_prints_a_table(tmp_path, capsys):
    args = spotcr(["probe", "--dir", f"efs={tmp_path}", *SMALL, "--pipeline-mib", "0"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert f"efs at {tmp_path} on local" in out
    assert out.count(" yes") == 4 and "pipeline" not in out


# The stack's outputs the user policy is written for: the bucket is the test's.
OUTPUTS = {
    "CheckpointBucket": "spotcr-checkpoints",
    "JobTable": "spotcr-jobs",
    "LaunchTemplateId": "lt-0123456789abcdef0",
    "RecoveryStateMachineArn": f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:spotcr-recovery",
}


@pytest.fixture
def iam(bucket: str) -> Iterator[Enforced]:
    """The stack's IAM enforced on the bucket, with the `spotcr` user holding the user policy."""
    with enforced(bucket) as world:
        world.enforcer.add_key(enforce.CLI_USER_KEY, principals.cli_user(ACCOUNT, "spotcr", REGION, OUTPUTS))
        yield world


def as_user(args: argparse.Namespace) -> int:
    with enforce.acting_as(enforce.CLI_USER_KEY):
        return int(args.func(args))


@pytest.fixture
def bucket(aws) -> Iterator[str]:
    boto3.client("s3").create_bucket(Bucket="spotcr-checkpoints")
    yield "spotcr-checkpoints"
    s3 = boto3.client("s3")
    for obj in s3.list_objects_v2(Bucket="spotcr-checkpoints").get("Contents", []):
        s3.delete_object(Bucket="spotcr-checkpoints", Key=obj["Key"])
    s3.delete_bucket(Bucket="spotcr-checkpoints")


def test_probe_of_s3_is_kept_in_the_bucket_and_used_by_plan(tmp_path, bucket, iam, capsys):
    # Given a probe of S3 and of a directory, kept in the stack's bucket for an instance type
    args = spotcr(
        ["probe", "--s3", bucket, "--dir", f"ebs={tmp_path}", *SMALL, "--instance-type", "m5.xlarge",
         "--bucket", bucket, "--json"]
    )  # fmt: skip
    assert as_user(args) == 0
    printed = json.loads(capsys.readouterr().out)
    by_storage = {r["storage"]: r for r in printed["results"]}
    check_result(by_storage["s3"], "s3")
    check_result(by_storage["ebs"], "ebs")
    keys = sorted(o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == ["probes/m5.xlarge/ebs.json", "probes/m5.xlarge/s3.json"]  # the probe's own objects are gone
    assert printed["saved"] == [f"s3://{bucket}/{k}" for k in ("probes/m5.xlarge/ebs.json", "probes/m5.xlarge/s3.json")]

    # When plan reads the bucket for that instance type
    args = spotcr(
        ["plan", "--memory-gib", "4", "--dirty-gib-per-min", "0.2", "--interruption-rate", "5-10%",
         "--work-hours", "10", "--vm-price-hour", "0.1", "--instance-type", "m5.xlarge", "--bucket", bucket, "--json"]
    )  # fmt: skip
    assert as_user(args) == 0
    plans = {p["storage"]: p for p in json.loads(capsys.readouterr().out)["storages"]}

    # Then S3 and EBS use the measured rates, and EFS, never probed, its default
    for storage in ("s3", "ebs"):
        rates = plans[storage]["rates_mib_s"]
        assert rates["write"]["value"] == pytest.approx(by_storage[storage]["write_mib_s"])
        assert rates["read"]["value"] == pytest.approx(by_storage[storage]["read_mib_s"])
        assert rates["pipeline"]["value"] == pytest.approx(by_storage[storage]["pipeline_mib_s"])
        assert rates["write"]["source"].startswith("spotcr probe of ")
    assert "Rodamilans" in plans["efs"]["rates_mib_s"]["write"]["source"]
    assert iam.enforcer.denials == [] and any(call == "s3:PutObject" for _, call in iam.enforcer.evaluated)


def test_a_user_without_the_probes_grant_cannot_keep_a_probe(tmp_path, bucket, iam, capsys):
    # Given the `spotcr` user without s3:PutObject
    user = principals.cli_user(ACCOUNT, "spotcr", REGION, OUTPUTS)
    iam.enforcer.add_key(enforce.CLI_USER_KEY, principals.without_grant(user, "s3:PutObject"))
    # Then the probe of S3 fails, and IAM names the refused write
    args = spotcr(["probe", "--s3", bucket, *SMALL, "--instance-type", "m5.xlarge", "--bucket", bucket])
    assert as_user(args) != 0
    assert "s3:PutObject" in iam.enforcer.denials[0].reason


class FakeSsm:
    """SSM Run Command as the VM answers it: the document's parameters become the agent's argv, which runs here."""

    def __init__(self, environ: dict[str, str], status: str = "Success") -> None:
        self.environ = environ
        self.status = status
        self.sent: list[dict[str, Any]] = []
        self.polls = 0

    def send_command(self, **kwargs: Any) -> dict[str, Any]:
        self.sent.append(kwargs)
        return {"Command": {"CommandId": "c-1"}}

    def get_command_invocation(self, CommandId: str, InstanceId: str) -> dict[str, Any]:
        self.polls += 1
        if self.polls == 1:
            return {"Status": "InProgress"}
        argv = PROBE.agent_argv({k: v[0] for k, v in self.sent[0]["Parameters"].items()})
        assert argv[:2] == [AGENT_BIN, "probe"]
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = agent_cli.main(argv[1:], self.environ)
        return {"Status": self.status if code == 0 else "Failed", "StandardOutputContent": stdout.getvalue(),
                "StandardErrorContent": ""}  # fmt: skip


def test_probe_on_a_vm_runs_the_document_and_probes_what_agent_json_names(tmp_path, capsys):
    # Given a job VM's agent.json: EBS mounted at mount_point, periodic dumps in scratch_dir, no bucket here
    mount, state = tmp_path / "mnt", tmp_path / "state"
    mount.mkdir()
    config = agent_config.AgentConfig(
        job_id="job-1", instance_id="i-0123456789abcdef0", storage="ebs", generation=1, mount_point=mount,
        state_dir=state, imds_endpoint="http://127.0.0.1:9",
    )  # fmt: skip
    config.write(tmp_path / "agent.json")
    ssm = FakeSsm({agent_config.CONFIG_ENV: str(tmp_path / "agent.json")})

    args = spotcr(["probe", "--instance", "i-0123456789abcdef0", *SMALL, "--json"])
    assert probe.run(args, ssm=ssm) == 0
    results = json.loads(capsys.readouterr().out)["results"]

    assert ssm.sent[0]["DocumentName"] == "spotcr-probe"
    assert ssm.sent[0]["Parameters"] == {
        "Streams": ["1,3"], "BlockKiB": ["64,256"], "SizeMiB": ["1"], "PipelineMiB": ["2"]
    }  # fmt: skip
    assert [r["storage"] for r in results] == ["ebs", "local"]
    check_result(results[0], "ebs")
    check_result(results[1], "local")
    assert results[1]["location"] == str(state / "scratch")


def test_a_failed_probe_on_a_vm_says_why(tmp_path, capsys):
    ssm = FakeSsm({agent_config.CONFIG_ENV: str(tmp_path / "missing.json")})

    args = spotcr(["probe", "--instance", "i-0123456789abcdef0", *SMALL])
    assert probe.run(args, ssm=ssm) == 2
    err = capsys.readouterr().err
    assert "ended Failed" in err and "missing.json does not exist" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "say what to probe"),
        (["--instance", "i-1", "--dir", "/tmp"], "not both"),
        (["--dir", "tape=/tmp"], "unknown storage 'tape'"),
        (["--dir", "ebs=/nonexistent/dir"], "is not a directory"),
        (["--dir", "/tmp", "--streams", "0"], "streams must be 1 to 256"),
        (["--dir", "/tmp", "--block-kib", "3"], "multiples of 4 KiB"),
        (["--dir", "/tmp", "--streams", "x"], "--streams must be comma-separated whole numbers"),
        (["--instance", "i-1", "--size-mib", "-1"], "SizeMiB"),
    ],
)
def test_bad_input_gets_a_clear_error(argv, message, capsys):
    args = spotcr(["probe", *argv])
    assert probe.run(args, ssm=FakeSsm({})) == 2
    assert message in capsys.readouterr().err


def test_probe_on_a_job_vm_writes_only_under_its_runs_probe_prefix(tmp_path, bucket, iam):
    # Given a job's committed objects, and every S3 write the probe makes recorded
    from spotcr_agent import probe as agent_probe
    from spotcr_agent.store.backends import S3Backend

    s3 = boto3.client("s3")
    s3.put_object(Bucket=bucket, Key="jobs/render-42/runs/r-00000000000000a1/checkpoints/x.json", Body=b"{}")
    touched: list[str] = []

    class Recorded(S3Backend):
        def put(self, key: str, data: bytes | memoryview) -> None:
            touched.append(key)
            super().put(key, data)

    settings = agent_probe.ProbeSettings(streams=(1,), block_kib=(64,), size_mib=1, pipeline_mib=2)

    # When the probe runs as on a job VM, with that job's store credentials as store-credentials vends them
    session = iam.store_session("render-42", "r-00000000000000a1")
    results = agent_probe.probe(
        [agent_probe.ProbeTarget("s3", bucket=bucket)],
        settings,
        instance_type="m5.xlarge",
        scratch=tmp_path,
        s3_backend=lambda name: Recorded(name, session=session, scope="jobs/render-42/"),
        s3_job="render-42",
        s3_run="r-00000000000000a1",
    )

    # Then it wrote only under one probe prefix of its run (which its restore never reads), as IAM allowed, and
    # removed it, leaving the job's objects alone
    assert results[0].pipeline is not None and results[0].pipeline.verified
    scratch = {key.split("/")[5] for key in touched}
    assert all(key.startswith("jobs/render-42/runs/r-00000000000000a1/probe/") for key in touched)
    assert len(scratch) == 1 and iam.enforcer.denials == []
    left = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert left == ["jobs/render-42/runs/r-00000000000000a1/checkpoints/x.json"]


def test_probe_on_a_job_vm_without_a_run_yet_is_refused_naming_it(tmp_path):
    from spotcr_agent import probe as agent_probe

    settings = agent_probe.ProbeSettings(streams=(1,), block_kib=(64,), size_mib=1, pipeline_mib=0)
    with pytest.raises(agent_probe.ProbeError, match="job render-42 has no run yet"):
        agent_probe.probe(
            [agent_probe.ProbeTarget("s3", bucket="b")],
            settings,
            instance_type="m5.xlarge",
            scratch=tmp_path,
            s3_job="render-42",
        )
