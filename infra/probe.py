"""The probe document: `spotcr probe --instance` runs the agent's storage and pipeline probe on a job VM.

A construct of its own, outside the documents the functions send: only the user's credentials send it.
"""

from __future__ import annotations

from aws_cdk import aws_ssm as ssm
from constructs import Construct
from spotcr_contracts import commands

from infra.settings import Settings


class ProbeDocument(Construct):
    def __init__(self, scope: Construct, construct_id: str, *, settings: Settings) -> None:
        super().__init__(scope, construct_id)
        self.document = ssm.CfnDocument(
            self,
            "Document",
            name=f"{settings.stack_name}-{commands.PROBE.name}",
            document_type="Command",
            document_format="JSON",
            content=commands.PROBE.document(),
            update_method="NewVersion",
        )
