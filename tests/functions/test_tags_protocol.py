"""Tag values that used to slip through: non-ASCII digits, system work dirs; and the restart-from-scratch switch."""

from __future__ import annotations

import boto3
import pytest
from spotcr_contracts import tags

from rehearsal.controlplane import ControlPlane, ec2_event, route

BASE = {tags.JOB: "j-1", tags.COMMAND: "/opt/job/run"}


# Superscript two twice, full-width "10", Arabic-Indic "30": all pass str.isdigit().
@pytest.mark.parametrize("value", ["\u00b2\u00b2", "\uff11\uff10", "\u0663\u0660", "+30", " 30", "30 "])
def test_an_interval_of_anything_but_ascii_digits_is_refused(value: str) -> None:
    with pytest.raises(tags.InvalidJobTags, match="whole number"):
        tags.parse_job_tags({**BASE, tags.INTERVAL: value})


@pytest.mark.parametrize("workdir", ["/", "//", "/etc", "/usr", "/usr/lib/x", "/var", "/root", "/proc/1", "/home"])
def test_a_system_directory_as_work_dir_is_refused(workdir: str) -> None:
    with pytest.raises(tags.InvalidJobTags, match=r"system directory|absolute path"):
        tags.parse_job_tags({**BASE, tags.WORKDIR: workdir})


@pytest.mark.parametrize("workdir", ["/opt/job", "/home/ana/sim", "/var/lib/spotcr/work/j-1", "/data/run"])
def test_a_job_directory_is_accepted(workdir: str) -> None:
    assert tags.parse_job_tags({**BASE, tags.WORKDIR: workdir}).workdir == workdir


def test_restart_from_scratch_is_on_by_default_and_travels_to_the_backup_when_off() -> None:
    assert tags.parse_job_tags(BASE).restart_from_scratch
    spec = tags.parse_job_tags({**BASE, tags.RESTART_FROM_SCRATCH: "false"})
    assert not spec.restart_from_scratch
    assert spec.to_tags()[tags.RESTART_FROM_SCRATCH] == "false"
    with pytest.raises(tags.InvalidJobTags, match="true or false"):
        tags.parse_job_tags({**BASE, tags.RESTART_FROM_SCRATCH: "no"})


def test_a_superscript_interval_gets_spotcr_error_instead_of_crashing_the_function(plane: ControlPlane) -> None:
    instance_id = plane.launch_job_instance({**BASE, tags.INTERVAL: "²²"})
    route(ec2_event("state-change-running", instance_id))
    assert "whole number" in plane.instance_tags(instance_id)[tags.ERROR]
    assert boto3.resource("dynamodb").Table("spotcr-jobs").scan()["Items"] == []
