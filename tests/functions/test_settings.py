"""The functions' settings model: one name per setting, parsed and rendered in one place, read nowhere else."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from spotcr_contracts import settings as settings_module
from spotcr_contracts.settings import AGENT_FLAGS, ENV, FunctionSettings, InvalidSettings, VmSettings

FUNCTIONS_DIR = Path(__file__).resolve().parents[2] / "functions"
REQUIRED = {f.name: f"{f.name}-value" for f in dataclasses.fields(FunctionSettings) if f.default is dataclasses.MISSING}


def _required_env() -> dict[str, str]:
    return {ENV[field]: value for field, value in REQUIRED.items()}


def test_the_required_settings_are_the_deployed_resources() -> None:
    assert [ENV[f] for f in REQUIRED] == [
        "SPOTCR_JOBS_TABLE",
        "SPOTCR_IDEMPOTENCY_TABLE",
        "SPOTCR_RECOVERY_STATE_MACHINE_ARN",
        "SPOTCR_EVENT_BUS_NAME",
        "SPOTCR_FAILURE_TOPIC_ARN",
        "SPOTCR_CHECKPOINT_BUCKET",
        "SPOTCR_LAUNCH_TEMPLATE_ID",
        "SPOTCR_LAUNCH_TEMPLATE_VERSION",
        "SPOTCR_CHECKPOINT_DOCUMENT",
        "SPOTCR_FINAL_DUMP_DOCUMENT",
        "SPOTCR_RESTORE_DOCUMENT",
        "SPOTCR_RELEASE_DOCUMENT",
        "SPOTCR_STATUS_DOCUMENT",
    ]
    assert ENV["final_dump_wait_s"] == "SPOTCR_FINAL_DUMP_WAIT_SECONDS"


def test_what_to_env_renders_from_env_reads_back() -> None:
    # Given settings with every optional field off its default
    settings = FunctionSettings(
        **REQUIRED,
        final_dump_wait_s=7,
        backup_ready_wait_s=8,
        restore_wait_s=9,
        poll_s=2,
        ebs_volume_gib=3,
        ebs_handover_s=4,
        subnet_ids=("subnet-a", "subnet-b"),
        keep_finished_volumes=True,
        store_role_arn="arn:aws:iam::123456789012:role/store",
        job_role_name="job",
        file_system_id="fs-1",
        pending_timeout_minutes=0,
        stack_name="spotcr-test",
    )
    # When they are rendered and parsed back, Then nothing is lost and every variable is named
    env = settings.to_env()
    assert set(env) == set(ENV.values())
    assert FunctionSettings.from_env(env) == settings


def test_absent_optional_settings_keep_their_defaults() -> None:
    settings = FunctionSettings.from_env(_required_env())
    assert settings.final_dump_wait_s == 110 and settings.subnet_ids == () and not settings.keep_finished_volumes
    assert settings.pending_timeout_minutes == settings_module.DEFAULT_PENDING_TIMEOUT_MINUTES


def test_a_comma_list_drops_blanks() -> None:
    settings = FunctionSettings.from_env({**_required_env(), ENV["subnet_ids"]: "subnet-a, subnet-b,"})
    assert settings.subnet_ids == ("subnet-a", "subnet-b")


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("keep_finished_volumes", "yes", "true or false"),
        ("poll_s", "0", "at least 1"),
        ("ebs_volume_gib", "ten", "at least 1"),
        ("pending_timeout_minutes", "-1", "at least 0"),
        ("restore_wait_s", "٣", "at least 1"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable_and_what_is_allowed(field: str, value: str, allowed: str) -> None:
    with pytest.raises(InvalidSettings, match=f"{ENV[field]} must be .*{allowed}"):
        FunctionSettings.from_env({**_required_env(), ENV[field]: value})


def test_missing_settings_are_named_together() -> None:
    env = _required_env()
    del env["SPOTCR_JOBS_TABLE"], env["SPOTCR_STATUS_DOCUMENT"]
    with pytest.raises(InvalidSettings, match="missing settings: SPOTCR_JOBS_TABLE, SPOTCR_STATUS_DOCUMENT"):
        FunctionSettings.from_env(env)


def _environment_reads(tree: ast.AST) -> list[str]:
    """Each `os.environ` / `os.getenv` / `environ` use and each "SPOTCR_..." literal in a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
            found.append(f"os.{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.Name) and node.id in ("environ", "getenv"):
            found.append(f"{node.id} (line {node.lineno})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "SPOTCR_" in node.value:
            found.append(f"{node.value!r} (line {node.lineno})")
    return found


def test_no_function_reads_a_setting_outside_the_model() -> None:
    # Every variable a function reads comes through FunctionSettings.from_env, so the model names them all.
    model = FUNCTIONS_DIR / "spotcr_contracts" / "settings.py"
    reads = {
        str(path.relative_to(FUNCTIONS_DIR)): found
        for path in sorted(FUNCTIONS_DIR.rglob("*.py"))
        if path != model and (found := _environment_reads(ast.parse(path.read_text())))
    }
    assert reads == {}


def test_the_scan_finds_an_environment_read() -> None:
    code = 'import os\nos.environ.get("X")\nfrom os import getenv\ngetenv("Y")\nNAME = "SPOTCR_Z"\n'
    assert len(_environment_reads(ast.parse(code))) == 3


def test_each_vm_setting_is_a_placeholder_and_all_but_the_asset_an_agent_option() -> None:
    placeholders = VmSettings(bucket="checkpoints", efs_isolation=True).placeholders()
    assert placeholders["__SPOTCR_BUCKET__"] == "checkpoints" and placeholders["__SPOTCR_EFS_ISOLATION__"] == "true"
    assert placeholders["__SPOTCR_FSX_DNS__"] == ""
    assert AGENT_FLAGS["store_credentials_url"] == "--store-credentials-url" and "agent_asset_url" not in AGENT_FLAGS
    assert len(AGENT_FLAGS) == len(placeholders) - 1
