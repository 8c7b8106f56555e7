"""The `spotcr` command against the rehearsal's local cloud: submit, watch, checkpoints, interrupt, restore, cancel."""

import io
import json
import os
import subprocess
import sys
import time

import pytest
from spotcr_cli.main import main

from rehearsal.cloud import PREFIX, REGION
from rehearsal.iam import enforce
from rehearsal.scenario import command_tag, restored_after
from tests.rehearsal.support import e2e_rehearsal


def poll(read, until, what, timeout_s=60.0):
    """Read until the condition holds (the control plane writes the record asynchronously), or fail naming it."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if until(value):
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}: last read {value}"
        time.sleep(0.5)


@pytest.mark.e2e
@pytest.mark.criu
@pytest.mark.timeout(480)
def test_submit_watch_interrupt_restore_and_cancel_a_job_with_the_command(tmp_path, capsys):
    rehearsal, lines = e2e_rehearsal(tmp_path, storage="s3", size_mb=16, steps=8000, notice_s=6.0)
    options = rehearsal.options
    cloud, watcher, job = rehearsal.cloud, rehearsal.watcher, rehearsal.job_id
    cloud.start()
    try:
        cloud.boot_commands = rehearsal._boot_commands()
        where = ["--endpoint-url", cloud.endpoint, "--stack", PREFIX, "--region", REGION]

        def spotcr(*argv):
            out = io.StringIO()
            with cloud.as_cli_user():  # the user's own key, holding only the user policy (infra/user_policy.py)
                code = main([*where, *argv], out=out)
            assert code == 0, f"spotcr {' '.join(argv)} exited {code}: {capsys.readouterr().err}\n" + "\n".join(lines)
            text = out.getvalue()
            return json.loads(text) if "--json" in argv else text

        # Given a job submitted with `spotcr submit` from the stack's launch template
        submitted = spotcr(
            "submit",
            job,
            "--command",
            command_tag(options),
            "--interval",
            "10",
            "--instance-type",
            "c5.large",
            "--fallback-types",
            "m5.large",
            "--json",
        )
        primary = submitted["instance_id"]
        assert submitted["market"] == "spot"
        watcher.wait(lambda t, e: t == "JobStarted" and e.instance_id == primary, 120, "the job to start")

        # When a periodic checkpoint is committed, `status` and `checkpoints` show it
        def periodic(t, e):
            return t == "CheckpointCompleted" and e.kind == "periodic" and e.instance_id == primary

        watcher.wait(periodic, 90, "a periodic checkpoint")
        status = poll(lambda: spotcr("status", job, "--json"), lambda v: v["checkpoint"], "the record's checkpoint")
        assert status["state"] in ("RUNNING", "CHECKPOINTING")
        assert (status["generation"], status["instance_id"], status["interruptions_survived"]) == (0, primary, 0)
        assert status["cost"]["hours"] > 0 and status["cost"]["instances"][0]["market"] == "spot"
        assert "spot price history" in status["cost"]["source"]
        listed = spotcr("checkpoints", job, "--json")
        assert listed and listed[0]["kind"] == "periodic" and listed[0]["source"] == "manifest"
        assert listed[0]["size_bytes"] > 16 << 20 and listed[0]["stored_bytes"] > 0
        first = listed[0]["checkpoint_id"]
        assert job in spotcr("jobs") and primary in spotcr("status", job)

        # When it is interrupted through FIS, a rebalance recommendation first
        interrupted = spotcr("interrupt", job, "--rebalance-first", "--json")
        assert interrupted["instance_id"] == primary and interrupted["kind"] == "rebalance-first"
        restored = watcher.wait(restored_after(0), 120, "the restore after the FIS interruption")
        # Then the job runs again on a backup at generation 1
        status = poll(lambda: spotcr("status", job, "--json"), lambda v: v["state"] == "RUNNING", "RUNNING again")
        assert (status["generation"], status["instance_id"]) == (1, restored.instance_id)
        assert status["interruptions_survived"] == 1 and restored.instance_id != primary
        assert any("rebalance recommendation" in line for line in lines), "\n".join(lines)
        assert status["work_redone_s"] is not None

        # When the user restores the first checkpoint, the recovery workflow brings it back from that one
        ordered = spotcr("restore", job, "--checkpoint", first, "--json")
        assert ordered["generation"] == 2
        again = watcher.wait(restored_after(1), 120, "the restore the user ordered")
        assert again.checkpoint_id == first

        # And its logs say nothing failed; its agent, asked on its VM, shows the job alive at the new generation
        logs = poll(
            lambda: spotcr("logs", job, "--json"),
            lambda v: v["agent"] is not None and v["agent"].get("generation") == 2,
            "the agent's view at generation 2",
        )
        assert logs["failures"] == [] and logs["criu_logs"] == []
        assert logs["agent"]["job_alive"] is True and logs["agent"]["instance_id"] == again.instance_id

        # When it is cancelled, with its checkpoints deleted
        cancelled = spotcr("cancel", job, "--delete-checkpoints", "--json")
        assert cancelled["state"] == "CANCELLED" and again.instance_id in cancelled["instances_terminated"]
        assert cancelled["checkpoints_deleted"]["objects"] > 0
        # Then the control plane orders no more dumps, and nothing of the job is left but its record
        assert job not in cloud.call_handler(f"{PREFIX}-scheduler", {"detail-type": "Scheduled Event"})["ordered"]
        assert spotcr("checkpoints", job, "--json") == []
        assert "CANCELLED" in spotcr("jobs")
        # And the installed entry point reads the same world (python -m spotcr_cli, as the console script runs)
        # with the user's own access key in its environment, as a user's shell holds it
        user_env = {**os.environ, "AWS_ACCESS_KEY_ID": enforce.CLI_USER_KEY, "AWS_SECRET_ACCESS_KEY": "user-secret"}
        listing = subprocess.run(
            [sys.executable, "-m", "spotcr_cli", *where, "jobs", "--json"],
            capture_output=True,
            text=True,
            check=True,
            env={k: v for k, v in user_env.items() if k != "AWS_SESSION_TOKEN"},
        )
        assert [j["state"] for j in json.loads(listing.stdout) if j["job_id"] == job] == ["CANCELLED"]
        # And along the way every principal, the user included, was evaluated and refused nothing
        assert cloud.enforcer is not None and cloud.enforcer.denials == []
        user = {name for arn, name in cloud.enforcer.evaluated if arn.endswith(":user/spotcr-user")}
        assert {"ec2:RunInstances", "fis:StartExperiment", "states:StartExecution", "s3:DeleteObject"} <= user
    finally:
        cloud.stop()
