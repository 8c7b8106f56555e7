"""The one place the command reaches AWS: lazily made boto3 clients and the stack's outputs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

ENDPOINT_ENV = "SPOTCR_ENDPOINT_URL"
STACK_ENV = "SPOTCR_STACK"
DEFAULT_STACK = "spotcr"


class CommandError(Exception):
    """What the user must know, in one line; exit code 1 (2 for bad input)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class StackOutputs:
    """What the command reads from the deployed stack (infra/stack.py's CfnOutputs)."""

    name: str
    bucket: str
    job_table: str
    launch_template_id: str
    state_machine_arn: str
    launch_template_version: str  # the latest at deploy: $Default stays version 1 through stack updates
    subnets: tuple[str, ...] = ()
    security_group: str = ""
    experiment_templates: tuple[tuple[str, str], ...] = ()  # (kind, template id), spotcr_contracts/fis.py
    status_document: str = ""  # the SSM document that runs `spotcr-agent status` on a job VM

    @classmethod
    def from_outputs(cls, name: str, outputs: dict[str, str]) -> StackOutputs:
        from spotcr_contracts import fis as fis_experiments

        required = {
            "bucket": "CheckpointBucket",
            "job_table": "JobTable",
            "launch_template_id": "LaunchTemplateId",
            "state_machine_arn": "RecoveryStateMachineArn",
            "launch_template_version": "LaunchTemplateVersion",
        }
        missing = [output for output in required.values() if not outputs.get(output)]
        if missing:
            raise CommandError(f"stack {name} has no output {', '.join(missing)}: is it a spotcr stack, deployed?")
        templates = tuple(
            (kind, outputs[output]) for kind, output in fis_experiments.OUTPUTS.items() if outputs.get(output)
        )
        return cls(
            name=name,
            subnets=tuple(s for s in outputs.get("JobSubnets", "").split(",") if s),
            security_group=outputs.get("JobSecurityGroup", ""),
            status_document=outputs.get("StatusDocument", ""),
            experiment_templates=templates,
            **{field: outputs[output] for field, output in required.items()},
        )

    def experiment_template(self, kind: str) -> str:
        for name, template_id in self.experiment_templates:
            if name == kind:
                return template_id
        raise CommandError(f"stack {self.name} has no FIS experiment template for {kind!r}: deploy the current stack")


class Cloud:
    """boto3 clients for one endpoint (None: AWS itself) and region, made on first use so moto intercepts them."""

    def __init__(self, endpoint_url: str | None = None, region: str | None = None, stack: str | None = None) -> None:
        self.endpoint_url = endpoint_url or os.environ.get(ENDPOINT_ENV) or None
        self.region = region
        self.stack_name = stack or os.environ.get(STACK_ENV) or DEFAULT_STACK
        self._clients: dict[str, Any] = {}
        self.prices: dict[str, tuple[float | None, str]] = {}  # read once per command run

    def client(self, service: str) -> Any:
        if service not in self._clients:
            import boto3

            self._clients[service] = boto3.client(service, region_name=self.region, endpoint_url=self.endpoint_url)
        return self._clients[service]

    @cached_property
    def stack(self) -> StackOutputs:
        from botocore.exceptions import ClientError, NoCredentialsError, NoRegionError

        try:
            stacks = self.client("cloudformation").describe_stacks(StackName=self.stack_name)["Stacks"]
        except ClientError as error:
            raise CommandError(f"stack {self.stack_name}: {error.response['Error'].get('Message', error)}") from None
        except (NoCredentialsError, NoRegionError) as error:
            raise CommandError(f"cannot reach AWS: {error}") from None
        outputs = {o["OutputKey"]: o["OutputValue"] for o in stacks[0].get("Outputs", [])}
        return StackOutputs.from_outputs(self.stack_name, outputs)
