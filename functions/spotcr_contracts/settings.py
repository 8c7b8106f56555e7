"""Deployment settings that cross into running code, each named once with its type, default and description.

FunctionSettings: what infra/ puts in each Lambda function's environment and the functions read. A field's variable
is SPOTCR_ and its name in capitals, a trailing `_s` spelled `_SECONDS` (final_dump_wait_s:
SPOTCR_FINAL_DUMP_WAIT_SECONDS). infra/ and the local AWS stand-ins (rehearsal, workflow tests) render one with
`to_env`; a handler parses it back with `from_env` at its edge.

VmSettings: what a job VM's user data is given and passes on to the agent (see the class).

docs/settings.md lists both, with infra's deploy options (`python -m infra.settings_doc`).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = "SPOTCR_"
DEFAULT_PENDING_TIMEOUT_MINUTES = 20


class InvalidSettings(RuntimeError):
    """The environment lacks a setting or holds a value spotcr cannot use; the message names the variable."""


def env_name(field: str) -> str:
    """The environment variable of a FunctionSettings field (see the module's docstring for the rule)."""
    if field.endswith("_s"):
        field = field[:-2] + "_seconds"
    return PREFIX + field.upper()


def setting(description: str, default: Any = dataclasses.MISSING, minimum: int = 1) -> Any:
    """A field with its one-line description; no default: the variable is required. `minimum`: of a number."""
    return dataclasses.field(default=default, metadata={"description": description, "minimum": minimum})


@dataclass(frozen=True)
class FunctionSettings:
    jobs_table: str = setting("The job registry's DynamoDB table.")
    idempotency_table: str = setting("The DynamoDB table Powertools idempotency keeps handled events in.")
    recovery_state_machine_arn: str = setting("The recovery workflow's state machine.")
    event_bus_name: str = setting("The EventBridge bus the agents publish their events on.")
    failure_topic_arn: str = setting("The SNS topic told of every job that fails.")
    checkpoint_bucket: str = setting("The S3 bucket of checkpoints (s3 storage) and job results.")
    launch_template_id: str = setting("The job VMs' launch template, which backups launch from.")
    launch_template_version: str = setting(
        "The template's latest version at deploy: CloudFormation never moves $Default off version 1 on update."
    )
    checkpoint_document: str = setting("The SSM document that orders a checkpoint.")
    final_dump_document: str = setting("The SSM document that orders a wave's final dumps, each VM its own.")
    restore_document: str = setting("The SSM document that orders a restore on a backup.")
    release_document: str = setting("The SSM document that orders the job's storage released (EBS hand-over).")
    status_document: str = setting("The SSM document that asks an agent for its status.")
    final_dump_wait_s: int = setting(
        "How long recovery waits for the final dump before it uses the newest committed checkpoint.", 110
    )
    backup_ready_wait_s: int = setting("How long recovery waits for a backup VM's agent to be ready.", 900)
    restore_wait_s: int = setting("How long recovery waits for a restore to finish.", 900)
    poll_s: int = setting("How often the recovery workflow polls while it waits.", 5)
    ebs_volume_gib: int = setting("The size of the encrypted volume created for each ebs job.", 100)
    ebs_handover_s: int = setting(
        "From the warning, how long an EBS volume may take to reach the backup (snapshot included) before failing.",
        3600,
    )
    subnet_ids: tuple[str, ...] = setting(
        "Comma list of the stack's job subnets, where a backup may launch; empty: only in its job's own subnet.", ()
    )
    keep_finished_volumes: bool = setting("true: a completed EBS job's volume is kept.", False)
    store_role_arn: str = setting("The role store-credentials assumes for one job's prefix.", "")
    job_role_name: str = setting("The job VMs' role: the only caller store-credentials answers.", "")
    file_system_id: str = setting("The stack's EFS: an access point per efs job; empty without EFS.", "")
    pending_timeout_minutes: int = setting(
        "A job not started this long after registering fails; 0: never.", DEFAULT_PENDING_TIMEOUT_MINUTES, minimum=0
    )
    stack_name: str = setting("The spotcr:stack tag value of the volumes and snapshots spotcr creates.", "")
    checkpoint_key_arn: str = setting(
        "The KMS key the checkpoint bucket encrypts with (SSE-KMS): store sessions may use it through S3; empty: "
        "SSE-S3.",
        "",
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FunctionSettings:
        """Parse every field from `environ` (the process's by default); an absent optional one keeps its default."""
        environ = os.environ if environ is None else environ
        missing = [env_name(f.name) for f in _required() if env_name(f.name) not in environ]
        if missing:
            raise InvalidSettings(f"missing settings: {', '.join(missing)}")
        values = {
            f.name: _parse(f, _KINDS[f.name], environ[env_name(f.name)])
            for f in dataclasses.fields(cls)
            if env_name(f.name) in environ
        }
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """Every field as its environment variable, as from_env reads it back."""
        return {env_name(f.name): _render(getattr(self, f.name)) for f in dataclasses.fields(self)}


ENV = {f.name: env_name(f.name) for f in dataclasses.fields(FunctionSettings)}
_KINDS = typing.get_type_hints(FunctionSettings)


def _required() -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(FunctionSettings) if f.default is dataclasses.MISSING]


def _parse(field: dataclasses.Field[Any], kind: Any, raw: str) -> Any:
    name = env_name(field.name)
    if kind is str:
        return raw
    if kind is bool:
        value = raw.strip().lower()
        if value not in ("true", "false"):
            raise InvalidSettings(f"{name} must be true or false, got {raw[:32]!r}")
        return value == "true"
    if kind is int:
        minimum = field.metadata["minimum"]
        if not raw.isascii() or not raw.isdigit() or int(raw) < minimum:
            raise InvalidSettings(f"{name} must be a whole number of at least {minimum}, got {raw[:32]!r}")
        return int(raw)
    if kind == tuple[str, ...]:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    raise TypeError(f"{name}: no parser for {kind}")


def _render(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def reference() -> list[tuple[str, str, str, str]]:
    """(variable, type, default, description) of each setting, in field order: docs/settings.md's table."""
    rows = []
    for f in dataclasses.fields(FunctionSettings):
        kind = {str: "text", int: "whole number", bool: "true or false"}.get(_KINDS[f.name], "comma list")
        default = "required" if f.default is dataclasses.MISSING else (_render(f.default) or "empty")
        rows.append((env_name(f.name), kind, default, f.metadata["description"]))
    return rows


@dataclass(frozen=True)
class VmSettings:
    """What each job VM's boot is given: infra/ renders every field into vm-bootstrap/bootstrap.sh's placeholder
    `__SPOTCR_<FIELD>__` (see `placeholder`), and the boot passes each but the asset to `spotcr-agent bootstrap` as
    `--<field>` (see `AGENT_FLAGS`). An empty value means "not used"."""

    agent_asset_url: str = setting("s3://bucket/key.zip of the agent asset the boot installs the agent from.", "")
    bucket: str = setting("The bucket of the job's checkpoints (s3 storage).", "")
    event_bus: str = setting("The EventBridge bus the agent publishes its events on.", "")
    efs_id: str = setting("The stack's EFS file system id (efs storage).", "")
    efs_isolation: bool = setting(
        "true: mount only the job's own EFS access point, with IAM (mount.efs from the agent asset).", False
    )
    fsx_dns: str = setting("The FSx for Lustre file system's DNS name (fsx storage).", "")
    fsx_mount_name: str = setting("The FSx for Lustre mount name (fsx storage).", "")
    store_credentials_url: str = setting(
        "The function URL (with private subnets, private API) vending the job's own store credentials.", ""
    )

    @classmethod
    def from_agent_options(cls, options: Mapping[str, Any]) -> VmSettings:
        """The settings `spotcr-agent bootstrap` was passed, by field name (its parsed options, as strings)."""
        kinds = typing.get_type_hints(cls)
        return cls(**{name: options[name] == "true" if kinds[name] is bool else options[name] for name in AGENT_FLAGS})

    def placeholders(self) -> dict[str, str]:
        """Every field as bootstrap.sh's placeholder and the value put in its place."""
        return {placeholder(f.name): _render(getattr(self, f.name)) for f in dataclasses.fields(self)}


def placeholder(field: str) -> str:
    return f"__SPOTCR_{field.upper()}__"


# The agent's `bootstrap` options the boot passes; the asset is the boot's own.
AGENT_FLAGS = {
    f.name: "--" + f.name.replace("_", "-") for f in dataclasses.fields(VmSettings) if f.name != "agent_asset_url"
}


def agent_options() -> list[tuple[str, bool, str]]:
    """(option, whether it takes true or false, description) of each setting `spotcr-agent bootstrap` is passed."""
    kinds = typing.get_type_hints(VmSettings)
    fields = {f.name: f for f in dataclasses.fields(VmSettings)}
    return [(flag, kinds[name] is bool, fields[name].metadata["description"]) for name, flag in AGENT_FLAGS.items()]


def vm_reference() -> list[tuple[str, str, str]]:
    """(placeholder, agent option, description) of each VM setting: docs/settings.md's table."""
    return [
        (placeholder(f.name), AGENT_FLAGS.get(f.name, ""), f.metadata["description"])
        for f in dataclasses.fields(VmSettings)
    ]
