"""Deployment settings: read once from CDK context (`-c key=value` or cdk.json), typed and checked here.

Every option has a default that deploys a working, zero-idle-cost spotcr; each field says what it means, and
docs/settings.md lists them all (infra/settings_doc.py writes it from these fields).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from aws_cdk import aws_logs as logs
from constructs import Node
from spotcr_contracts.settings import DEFAULT_PENDING_TIMEOUT_MINUTES

# The public Powertools layer (pydantic and the X-Ray SDK included). By default its ARN is resolved at
# deploy time from the public SSM parameter Powertools publishes for the pinned release;
# `-c powertools_layer_version=N` names a layer version instead.
POWERTOOLS_LAYER_ACCOUNT = "017000801446"
POWERTOOLS_LAYER_NAME = "AWSLambdaPowertoolsPythonV3-python312-arm64"

# The GPU image: AWS's public parameter for the latest x86-64 Deep Learning Base OSS Nvidia Driver GPU AMI on
# Ubuntu 24.04 (glibc 2.39: runs the agent artifact built on Debian 12's 2.36; python3.12, which it carries too).
GPU_IMAGE_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
GPU_IMAGE_MIN_ROOT_GIB = 100  # the image's own snapshot, the driver and CUDA, plus scratch for a first dump

_ID = {
    "vpc": re.compile(r"^vpc-[0-9a-f]{8,17}$"),
    "subnet": re.compile(r"^subnet-[0-9a-f]{8,17}$"),
    "route_table": re.compile(r"^rtb-[0-9a-f]{8,17}$"),
    "ami": re.compile(r"^ami-[0-9a-f]{8,17}$"),
}
_AZ = re.compile(r"^[a-z]{2}(-[a-z]+)+-[0-9][a-z]$")
_STACK_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,63}$")
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
_KMS_KEY = re.compile(r"^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/(mrk-)?[0-9a-f-]{32,36}$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


_RETENTION = {
    1: logs.RetentionDays.ONE_DAY,
    3: logs.RetentionDays.THREE_DAYS,
    5: logs.RetentionDays.FIVE_DAYS,
    7: logs.RetentionDays.ONE_WEEK,
    14: logs.RetentionDays.TWO_WEEKS,
    30: logs.RetentionDays.ONE_MONTH,
    60: logs.RetentionDays.TWO_MONTHS,
    90: logs.RetentionDays.THREE_MONTHS,
    180: logs.RetentionDays.SIX_MONTHS,
    365: logs.RetentionDays.ONE_YEAR,
    731: logs.RetentionDays.TWO_YEARS,
    1827: logs.RetentionDays.FIVE_YEARS,
    3653: logs.RetentionDays.TEN_YEARS,
}


class InvalidSetting(ValueError):
    """A context value spotcr cannot deploy with; the message names the option."""


def _text(pattern: re.Pattern[str] | None = None) -> Callable[[str, Any], str]:
    def parse(name: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise InvalidSetting(f"{name}: expected a non-empty string, got {value!r}")
        if pattern is not None and not pattern.match(value):
            raise InvalidSetting(f"{name}: {value!r} does not match {pattern.pattern}")
        return value

    return parse


def _number(low: int, high: int) -> Callable[[str, Any], int]:
    def parse(name: str, value: Any) -> int:
        # `-c key=7` arrives as the string "7"
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidSetting(f"{name}: expected a whole number from {low} to {high}, got {value!r}")
        return value

    return parse


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return bool(value == "true")
    raise InvalidSetting(f"{name}: expected true or false, got {value!r}")


def _list(pattern: re.Pattern[str]) -> Callable[[str, Any], tuple[str, ...]]:
    def parse(name: str, value: Any) -> tuple[str, ...]:
        # `-c subnet_ids=a,b` or a JSON list, or a list in cdk.json
        if isinstance(value, str):
            value = json.loads(value) if value.startswith("[") else [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) and pattern.match(v) for v in value):
            raise InvalidSetting(f"{name}: expected a list of values matching {pattern.pattern}, got {value!r}")
        return tuple(value)

    return parse


def _optional_fsx(name: str, value: Any) -> str | None:
    if value in (False, "false", "off", ""):
        return None
    return _text()(name, value)


CREATE_KEY = "create"


def _checkpoint_key(name: str, value: Any) -> str | None:
    if value in (False, "false", "off", ""):
        return None
    if value == CREATE_KEY:
        return CREATE_KEY
    if not isinstance(value, str) or not _KMS_KEY.match(value):
        raise InvalidSetting(f"{name}: expected {CREATE_KEY!r} or a KMS key ARN ({_KMS_KEY.pattern}), got {value!r}")
    return value


def option(parse: Callable[[str, Any], Any], description: str, default: Any = None) -> Any:
    """A context option: how its value is parsed and checked, what it means, its default."""
    return field(default=default, metadata={"parse": parse, "description": description})


@dataclass(frozen=True)
class Settings:
    stack_name: str = option(_text(), "Stack name; prefix of documents, bus, launch template, state machine.", "spotcr")
    vpc_id: str | None = option(
        _text(_ID["vpc"]), "Use this VPC (no lookup); needs `subnet_ids` and `availability_zones`."
    )
    subnet_ids: tuple[str, ...] = option(
        _list(_ID["subnet"]),
        "With `vpc_id`: subnets for job VMs and EFS mount targets (comma list); VMs need a route to AWS APIs.",
        (),
    )
    availability_zones: tuple[str, ...] = option(_list(_AZ), "With `vpc_id`: each subnet's AZ, in the same order.", ())
    max_azs: int = option(
        _number(1, 6), "AZs of the VPC spotcr creates (public subnets, no NAT gateway, so no idle cost).", 2
    )
    private_subnets: bool = option(
        _flag,
        "Job VMs' subnets have no route to the internet: the stack adds an S3 gateway endpoint and interface "
        "endpoints (ssm, ssmmessages, ec2messages, events, execute-api; billed by the hour, 5 per AZ) and serves "
        "store credentials from a private API (a function URL is reachable over the internet only).",
        False,
    )
    route_table_ids: tuple[str, ...] = option(
        _list(_ID["route_table"]),
        "With `vpc_id` and `private_subnets`: each subnet's route table, in the same order (the S3 endpoint is "
        "added to them).",
        (),
    )
    efs: bool = option(_flag, "Create an encrypted EFS (elastic throughput), NFS open to job VMs only.", False)
    efs_isolation: bool = option(
        _flag,
        "With `efs`: each job mounts only its own access point, with IAM, through mount.efs (the agent asset's "
        "amazon-efs-utils); false: every job VM mounts the whole file system.",
        True,
    )
    fsx: str | None = option(
        _optional_fsx,
        "`SCRATCH_2` or `PERSISTENT_2`: FSx for Lustre; needs `ami_id` of an image with the Lustre client.",
    )
    fsx_storage_gib: int = option(_number(1200, 1_000_000), "FSx size: 1200 or a multiple of 2400.", 1200)
    vm_architecture: str = option(
        _text(), "`amd64` or `arm64`: the job VMs' Debian 12 AMI, from its public SSM parameter at deploy.", "amd64"
    )
    ami_id: str | None = option(_text(_ID["ami"]), "Job VMs boot this AMI instead.")
    gpu_image: bool = option(
        _flag,
        "Job VMs boot AWS's Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04, x86-64; NVIDIA driver "
        f"r580+), root volume at least {GPU_IMAGE_MIN_ROOT_GIB} GiB.",
        False,
    )
    root_volume_gib: int = option(_number(8, 16_384), "Encrypted gp3 root volume of job VMs.", 20)
    metadata_hop_limit: int = option(_number(1, 2), "IMDSv2 hop limit (1 or 2).", 1)
    noncurrent_version_days: int = option(_number(1, 3650), "Keep replaced or deleted checkpoint objects this long.", 1)
    checkpoint_expiry_days: int = option(
        _number(0, 3650),
        "Expire objects under `jobs/` (only safe for jobs shorter than this: checkpoints share chunks); 0: never.",
        0,
    )
    access_log_days: int = option(_number(1, 3650), "Keep S3 access logs this long.", 90)
    log_retention_days: int = option(
        _number(1, 3653), "Function, workflow and flow log retention (a CloudWatch retention value).", 30
    )
    job_spec_buckets: tuple[str, ...] = option(
        _list(_BUCKET), "Extra buckets job VMs may read `spotcr:spec` files from (besides `specs/`).", ()
    )
    alarm_email: str | None = option(_text(), "Subscribe this address to the failure topic.")
    powertools_layer_version: int | None = option(
        _number(1, 10_000),
        "The Powertools layer version to use; none: the pinned release's, from its public SSM parameter at deploy.",
    )
    keep_finished_volumes: bool = option(
        _flag, "Keep a completed EBS job's volume when its instance terminates (by default it is deleted).", False
    )
    interruption_concurrency: int = option(
        _number(0, 1000),
        "Concurrency reserved for the interruption function; 0: none. Lambda keeps 100 unreserved, so reserving N "
        "fails the deploy unless the account's quota is at least 100 + N.",
        0,
    )
    pending_timeout_minutes: int = option(
        _number(0, 10_080),
        "A job not started this long after registering (its VM's boot failed before the agent) fails; 0: never.",
        DEFAULT_PENDING_TIMEOUT_MINUTES,
    )
    checkpoint_key: str | None = option(
        _checkpoint_key,
        "Encrypt the checkpoint bucket with a customer managed KMS key (SSE-KMS, S3 Bucket Keys): `create` (the "
        "stack makes one, rotated yearly and kept when the stack is deleted) or a key's ARN (its key policy must let "
        "the account's IAM policies grant it: docs/deploying.md); none: SSE-S3.",
    )
    ebs_kms_key_arn: str | None = option(
        _text(_KMS_KEY),
        "The customer managed key EBS encrypts job volumes with; none: spotcr's roles may use any key of the "
        "account, only through EC2.",
    )

    @classmethod
    def from_context(cls, node: Node) -> Settings:
        """Read every option from the CDK context; absent options keep their defaults."""
        raw = {f.name: node.try_get_context(f.name) for f in fields(cls)}
        return cls.from_mapping({k: v for k, v in raw.items() if v is not None})

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> Settings:
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidSetting(f"unknown context option(s): {', '.join(sorted(unknown))}")
        options = {f.name: f for f in fields(cls)}
        parsed = {name: options[name].metadata["parse"](name, value) for name, value in values.items()}
        settings = cls(**parsed)
        settings._check()
        return settings

    @property
    def job_root_volume_gib(self) -> int:
        """The job VMs' root volume: the GPU image needs more room than its snapshot, whatever root_volume_gib says."""
        return max(self.root_volume_gib, GPU_IMAGE_MIN_ROOT_GIB) if self.gpu_image else self.root_volume_gib

    @property
    def log_retention(self) -> logs.RetentionDays:
        return _RETENTION[self.log_retention_days]

    def _check(self) -> None:
        if not _STACK_NAME.match(self.stack_name):
            raise InvalidSetting("stack_name: 1-64 letters, digits and '-', starting with a letter")
        self._check_network()
        if self.vm_architecture not in ("amd64", "arm64"):
            raise InvalidSetting(f"vm_architecture: amd64 or arm64, got {self.vm_architecture!r}")
        if self.fsx not in (None, "SCRATCH_2", "PERSISTENT_2"):
            raise InvalidSetting(f"fsx: SCRATCH_2 or PERSISTENT_2, got {self.fsx!r}")
        if self.fsx_storage_gib != 1200 and self.fsx_storage_gib % 2400:
            raise InvalidSetting("fsx_storage_gib: 1200 or a multiple of 2400")
        if self.metadata_hop_limit not in (1, 2):
            raise InvalidSetting("metadata_hop_limit: 1 or 2")
        if not 1 <= self.max_azs <= 6:
            raise InvalidSetting("max_azs: 1 to 6")
        if self.log_retention_days not in _RETENTION:
            raise InvalidSetting(f"log_retention_days: one of {', '.join(map(str, _RETENTION))}")
        self._check_images_and_storage()
        if self.alarm_email is not None and not _EMAIL.match(self.alarm_email):
            raise InvalidSetting("alarm_email: not an e-mail address")

    def _check_network(self) -> None:
        if self.vpc_id is None and (self.subnet_ids or self.availability_zones):
            raise InvalidSetting("subnet_ids/availability_zones: only with vpc_id")
        if self.route_table_ids and not (self.vpc_id is not None and self.private_subnets):
            raise InvalidSetting("route_table_ids: only with vpc_id and private_subnets=true")
        if self.vpc_id is None:
            return
        if not self.subnet_ids:
            raise InvalidSetting("subnet_ids: required with vpc_id (spotcr never looks a VPC up)")
        if len(self.subnet_ids) != len(self.availability_zones):
            raise InvalidSetting("availability_zones: one per subnet id, in the same order")
        if self.private_subnets and len(self.route_table_ids) != len(self.subnet_ids):
            raise InvalidSetting(
                "route_table_ids: with vpc_id and private_subnets, one per subnet id, in the same order "
                "(the S3 gateway endpoint is added to them)"
            )

    def _check_images_and_storage(self) -> None:
        if self.gpu_image and self.ami_id is not None:
            raise InvalidSetting("gpu_image: not with ami_id (each names the job VMs' image)")
        if self.gpu_image and self.vm_architecture != "amd64":
            raise InvalidSetting("gpu_image: CRIU's CUDA plugin is x86-64 only; set vm_architecture=amd64")
        if self.fsx is not None and self.ami_id is None:
            raise InvalidSetting(
                "fsx: the default Debian 12 image has no Lustre client, so job VMs could not mount FSx; "
                "set ami_id to an image with the Lustre client installed"
            )


def reference() -> list[tuple[str, str, str]]:
    """(option, default, description) of each context option, in field order: docs/settings.md's table."""
    return [(f.name, _shown(f.default), f.metadata["description"]) for f in fields(Settings)]


def _shown(default: object) -> str:
    if default is None or default == ():
        return "none"
    if isinstance(default, bool):
        return "true" if default else "false"
    return str(default)
