"""The local Step Functions parses a state machine's definition once, yet every execution runs on its own input."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import boto3
from moto import mock_aws

from rehearsal.controlplane import MOTO_CONFIG
from rehearsal.localaws import ACCOUNT, REGION, stepfunctions, wrap

# A Choice and a Parallel (the recovery workflow's shapes) over each execution's own input.
DEFINITION = {
    "StartAt": "Branch",
    "States": {
        "Branch": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.n", "NumericGreaterThan": 1, "Next": "Both"}],
            "Default": "One",
        },
        "One": {"Type": "Pass", "Result": "one", "ResultPath": "$.took", "End": True},
        "Both": {
            "Type": "Parallel",
            "Branches": [
                {"StartAt": "Left", "States": {"Left": {"Type": "Pass", "InputPath": "$.n", "End": True}}},
                {"StartAt": "Right", "States": {"Right": {"Type": "Pass", "Result": "right", "End": True}}},
            ],
            "ResultPath": "$.took",
            "End": True,
        },
    },
}


def test_executions_share_one_parse_of_their_definition_and_keep_their_own_input() -> None:
    from moto.stepfunctions.parser.asl.parse.asl_parser import AmazonStateLanguageParser

    parsed: list[str] = []

    def counted(original: Any) -> Any:
        def parse(definition: str) -> Any:
            parsed.append(definition)
            return original(definition)

        return staticmethod(parse)

    # Given the local Step Functions, its parser counted, and one state machine
    with mock_aws(config=MOTO_CONFIG), contextlib.ExitStack() as patches:
        wrap(patches, AmazonStateLanguageParser, "parse", counted)
        stepfunctions.parse_once(patches)
        sfn = boto3.client("stepfunctions", region_name=REGION)
        arn = sfn.create_state_machine(
            name="shapes", definition=json.dumps(DEFINITION), roleArn=f"arn:aws:iam::{ACCOUNT}:role/sfn"
        )["stateMachineArn"]
        created = len(parsed)  # moto checks a definition by parsing it

        # When four executions run on different inputs, side by side
        runs = [
            sfn.start_execution(stateMachineArn=arn, name=f"run-{i}", input=json.dumps({"n": n}))["executionArn"]
            for i, n in enumerate((1, 2, 3, 1))
        ]
        outputs = [json.loads(_finished(sfn, run)["output"]) for run in runs]

    # Then the four parsed the definition once between them, and each execution's output is its own input's
    assert len(parsed) == created + 1
    assert outputs == [
        {"n": 1, "took": "one"},
        {"n": 2, "took": [2, "right"]},
        {"n": 3, "took": [3, "right"]},
        {"n": 1, "took": "one"},
    ]


def _finished(sfn: Any, arn: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while (execution := sfn.describe_execution(executionArn=arn))["status"] == "RUNNING":
        assert time.monotonic() < deadline, f"{arn} still runs"
        time.sleep(0.05)
    assert execution["status"] == "SUCCEEDED", execution
    return dict(execution)
