"""The stack's resources as `cdk deploy` creates them, from the same definitions infra/ uses: the job registry's
tables, the SSM documents and the recovery state machine's definition."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from spotcr_contracts.commands import Command
from spotcr_functions import catalog, registry_schema

ASL_PATH = Path(__file__).resolve().parents[2] / "statemachines" / "recovery.asl.json"


def create_registry(dynamodb: Any, jobs_table: str, idempotency_table: str) -> None:
    dynamodb.create_table(**registry_schema.create_table_arguments(jobs_table))
    dynamodb.create_table(**registry_schema.create_idempotency_table_arguments(idempotency_table))


def create_documents(ssm: Any, prefix: str, commands: Iterable[Command]) -> dict[str, str]:
    """Each command's SSM document, named `<prefix><command>`; returns the names by command."""
    names = {}
    for command in commands:
        name = prefix + command.name
        ssm.create_document(
            Name=name, Content=json.dumps(command.document()), DocumentType="Command", DocumentFormat="JSON"
        )
        names[command.name] = name
    return names


def recovery_definition(function_arns: Mapping[str, str], documents: Mapping[str, str], topic_arn: str) -> str:
    """The recovery ASL with the catalog's substitutions made: `function:<name>`, `document:<command>`,
    `topic:failure`."""
    definition = ASL_PATH.read_text()
    for placeholder, value in catalog.WORKFLOW_SUBSTITUTIONS.items():
        kind, _, name = value.partition(":")
        if kind == "function":
            resolved = function_arns[name]
        elif kind == "document":
            resolved = documents[name]
        elif value == "topic:failure":
            resolved = topic_arn
        else:
            raise KeyError(f"workflow substitution {value!r}: unknown kind {kind!r}")
        definition = definition.replace("${" + placeholder + "}", resolved)
    return definition
