"""`spotcr preflight` and `spotcr selftest` against the rehearsal's local AWS: passing, then broken on purpose.

Both run as the `spotcr` user, holding only infra/user_policy.py's policy: IAM evaluates every call they make.
"""

import io
import json

import pytest
from spotcr_cli import preflight
from spotcr_cli.main import main
from spotcr_contracts import fis

from rehearsal.cloud import PREFIX, REGION
from rehearsal.iam import enforce, principals
from rehearsal.scenario import Options, Rehearsal


def local_aws(tmp_path):
    options = Options(storage="s3", notice_s=6.0, schedule_every_s=2.0, timeout_s=90.0, runs_dir=tmp_path)
    return Rehearsal(options, echo=lambda line: None)


def spotcr(cloud, *argv):
    """The command as the user runs it: the user's own key, against the local AWS's stack."""
    out = io.StringIO()
    where = ["--endpoint-url", cloud.endpoint, "--stack", PREFIX, "--region", REGION]
    with cloud.as_cli_user():
        code = main([*where, *argv], out=out)
    return code, out.getvalue()


@pytest.mark.e2e
@pytest.mark.criu
@pytest.mark.timeout(480)
def test_preflight_and_selftest_pass_against_the_local_aws_and_leave_nothing_behind(tmp_path, capsys):
    rehearsal = local_aws(tmp_path)
    cloud = rehearsal.cloud
    cloud.start()
    try:
        cloud.boot_commands = rehearsal._boot_commands()
        # Given the local AWS as deployed: preflight passes
        code, text = spotcr(cloud, "preflight")
        assert code == 0, text

        # When the selftest runs a job through a FIS interruption
        argv = ["selftest", "--job", "selftest-e2e", "--work-seconds", "40", "--interval", "10", "--timeout", "150"]
        code, text = spotcr(cloud, *argv, "--json")
        assert code == 0, capsys.readouterr().err
        outcome = json.loads(text)

        # Then every phase passed and was timed, and the result is the known one
        assert set(outcome["timings"]) == {
            "stack", "submit", "start", "periodic checkpoint", "interrupt", "restore on a backup", "job end",
            "same result", "clean up",
        }  # fmt: skip
        assert outcome["result"] == outcome["expected"]
        # And nothing of the job is left: no running instance, no object, no record
        assert outcome["cleaned"]["checkpoints"]["objects"] > 0
        ec2 = cloud.client("ec2")
        found = ec2.describe_instances(Filters=[{"Name": "tag:spotcr:job", "Values": ["selftest-e2e"]}])
        states = {i["State"]["Name"] for r in found["Reservations"] for i in r["Instances"]}
        assert states <= {"shutting-down", "terminated"}, states
        listed = cloud.client("s3").list_objects_v2(
            Bucket=cloud.names["checkpoint_bucket"], Prefix="jobs/selftest-e2e/"
        )
        assert listed.get("KeyCount", 0) == 0
        item = cloud.client("dynamodb").get_item(
            TableName=cloud.names["jobs_table"], Key={"job_id": {"S": "selftest-e2e"}}
        )
        assert "Item" not in item
    finally:
        cloud.stop()


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_preflight_and_selftest_fail_naming_a_quota_of_10_a_removed_grant_and_a_missing_fis_template(
    tmp_path, monkeypatch, capsys
):
    rehearsal = local_aws(tmp_path)
    cloud = rehearsal.cloud
    cloud.start()
    try:
        # Given an account whose Lambda concurrency quota is 10
        monkeypatch.setenv("MOTO_LAMBDA_CONCURRENCY_QUOTA", "10")
        code, text = spotcr(cloud, "preflight")
        assert code == 1
        assert "FAIL  lambda-concurrency: 10 of 10 concurrent executions unreserved" in text
        assert f"{len(preflight.CHECKS) - 1} passed, 1 failed" in text

        # Given a user whose policy lacks the grant selftest needs first, it fails naming the refused action
        assert cloud.enforcer is not None
        user = cloud.enforcer.keys[enforce.CLI_USER_KEY]
        cloud.enforcer.add_key(enforce.CLI_USER_KEY, principals.without_grant(user, "fis:GetExperimentTemplate"))
        code, text = spotcr(cloud, "selftest", "--job", "selftest-denied")
        assert code == 1
        error = capsys.readouterr().err
        assert error.startswith("spotcr selftest: stack: An error occurred (AccessDeniedException)"), error
        assert "not authorized to perform: fis:GetExperimentTemplate" in error, error
        assert "FAIL  stack" in text
        assert cloud.client("ec2").describe_instances()["Reservations"] == []
        cloud.enforcer.add_key(enforce.CLI_USER_KEY, user)

        # Given a stack whose FIS template was deleted, the selftest fails before it launches anything
        outputs = cloud.client("cloudformation").describe_stacks(StackName=PREFIX)["Stacks"][0]["Outputs"]
        template = next(o["OutputValue"] for o in outputs if o["OutputKey"] == fis.OUTPUTS[fis.INTERRUPT])
        cloud.client("fis").delete_experiment_template(id=template)
        code, text = spotcr(cloud, "selftest", "--job", "selftest-broken")
        assert code == 1
        error = capsys.readouterr().err
        assert error.startswith("spotcr selftest: stack: ") and template in error, error
        assert "FAIL  stack" in text
        assert cloud.client("ec2").describe_instances()["Reservations"] == []
    finally:
        cloud.stop()
