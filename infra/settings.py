"""Deployment settings: read once from CDK context (`-c key=value` or cdk.json), typed and checked here.

Every option has a default that deploys a working, zero-idle-cost spotcr; the README lists them all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from aws_cdk import aws_logs as logs
from constructs import Node
from spotcr_functions.config import DEFAULT_PENDING_TIMEOUT_MINUTES

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


@dataclass(frozen=True)
class Settings:
    stack_name: str = "spotcr"
    vpc_id: str | None = None
    subnet_ids: tuple[str, ...] = ()
    availability_zones: tuple[str, ...] = ()
    max_azs: int = 2
    # Job VMs' subnets have no route to the internet: the stack adds the VPC endpoints a job VM calls and serves
    # store credentials from a private API (a function URL is reachable over the internet only).
    private_subnets: bool = False
    route_table_ids: tuple[str, ...] = ()  # with vpc_id and private_subnets: the subnets' route tables (S3 endpoint)
    efs: bool = False
    # With efs: each job mounts only its own EFS access point, with IAM (the file system refuses anything else),
    # through mount.efs (the agent asset's amazon-efs-utils). false: every job VM mounts the whole file system.
    efs_isolation: bool = True
    fsx: str | None = None  # None (off), "SCRATCH_2" or "PERSISTENT_2"
    fsx_storage_gib: int = 1200
    vm_architecture: str = "amd64"
    ami_id: str | None = None
    gpu_image: bool = False  # AWS's Deep Learning Base GPU AMI (Ubuntu 24.04, NVIDIA driver r580+) for GPU jobs
    root_volume_gib: int = 20
    metadata_hop_limit: int = 1
    noncurrent_version_days: int = 7
    checkpoint_expiry_days: int = 0  # 0: never expire current checkpoint objects
    access_log_days: int = 90
    log_retention_days: int = 30
    job_spec_buckets: tuple[str, ...] = ()
    alarm_email: str | None = None
    powertools_layer_version: int | None = None
    keep_finished_volumes: bool = False  # a completed EBS job's volume is deleted with its instance unless true
    # Reserved for the interruption function; 0 (default) reserves none. Lambda keeps 100 of the account's
    # concurrency unreserved, so reserving N fails the deploy unless the account's quota is at least 100 + N.
    interruption_concurrency: int = 0
    # A job not started this long after registering fails (its VM's boot failed before the agent); 0: never.
    pending_timeout_minutes: int = DEFAULT_PENDING_TIMEOUT_MINUTES
    # The customer managed key EBS encrypts job volumes with (the account's default EBS key, if one is set);
    # None: spotcr's roles may use any key of the account, only through EC2.
    ebs_kms_key_arn: str | None = None

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
        parsed: dict[str, Any] = {}
        for name, value in values.items():
            parsed[name] = _PARSERS[name](name, value)
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


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "stack_name": _text(),
    "vpc_id": _text(_ID["vpc"]),
    "subnet_ids": _list(_ID["subnet"]),
    "availability_zones": _list(_AZ),
    "max_azs": _number(1, 6),
    "private_subnets": _flag,
    "route_table_ids": _list(_ID["route_table"]),
    "efs": _flag,
    "efs_isolation": _flag,
    "fsx": _optional_fsx,
    "fsx_storage_gib": _number(1200, 1_000_000),
    "vm_architecture": _text(),
    "ami_id": _text(_ID["ami"]),
    "gpu_image": _flag,
    "root_volume_gib": _number(8, 16_384),
    "metadata_hop_limit": _number(1, 2),
    "noncurrent_version_days": _number(1, 3650),
    "checkpoint_expiry_days": _number(0, 3650),
    "access_log_days": _number(1, 3650),
    "log_retention_days": _number(1, 3653),
    "job_spec_buckets": _list(_BUCKET),
    "alarm_email": _text(),
    "powertools_layer_version": _number(1, 10_000),
    "keep_finished_volumes": _flag,
    "interruption_concurrency": _number(0, 1000),
    "pending_timeout_minutes": _number(0, 10_080),
    "ebs_kms_key_arn": _text(_KMS_KEY),
}
