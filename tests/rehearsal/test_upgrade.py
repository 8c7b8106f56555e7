"""`make demo ARGS="--upgrade-at S"`: the stack upgraded mid-job; the backup boots the new version, same result."""

import json

import pytest
from spotcr_contracts import tags

from rehearsal.__main__ import parse


def test_the_option_sets_when_the_stack_is_upgraded():
    assert parse(["--upgrade-at", "20"]).upgrade_at_s == 20.0
    assert parse([]).upgrade_at_s is None


def test_an_upgrade_before_the_submission_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["--upgrade-at", "-1"])
    assert "--upgrade-at -1: seconds after the submission" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.criu
@pytest.mark.timeout(300)
def test_a_backup_launched_after_an_upgrade_boots_the_new_version_and_the_result_stays_the_same(rehearse):
    # Given a job, and the stack upgraded (new agent asset, new launch template version) while it runs
    rehearsal, lines = rehearse(size_mb=32, steps=2500, timeline_png=False, upgrade_at_s=6.0)

    # When its primary is interrupted after the upgrade
    outcome = rehearsal.run()

    # Then the job ends with the uninterrupted run's result
    assert outcome.result == outcome.expected, "\n".join(lines)
    # And the primary booted the first deployment's asset, the backup the upgrade's: each the asset its own user
    # data names (only launch template version 2 names the upgrade's), fetched and installed
    assert rehearsal.upgrade is not None and rehearsal.upgrade["version"] == "2", "\n".join(lines)
    summary = json.loads((rehearsal.run_dir / "timeline.json").read_text())["summary"]
    booted = {}
    for instance_id, vm in rehearsal.cloud.vms.items():
        role = "backup" if vm.imds.tags().get(tags.MODE) == "restore" else "primary"
        fetched = summary["agent_assets"][instance_id]
        assert f'AGENT_ASSET_URL="{fetched}"' in vm.imds.user_data.decode()
        booted[role] = (fetched == rehearsal.upgrade["asset"], rehearsal.watcher.boots[instance_id].deployment)
    assert booted == {"primary": (False, "deployment 1"), "backup": (True, "the upgrade at 6 s")}, "\n".join(lines)
