"""Every transition in every statemachines/*.asl.json names a state that exists (cfn-lint and moto miss this)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.workflow import dangling_transitions

ASL_FILES = sorted((Path(__file__).resolve().parents[2] / "statemachines").glob("*.asl.json"))


def test_the_recovery_workflow_exists() -> None:
    assert any(path.name == "recovery.asl.json" for path in ASL_FILES)


@pytest.mark.parametrize("path", ASL_FILES, ids=lambda p: p.name)
def test_every_transition_names_an_existing_state(path: Path) -> None:
    assert dangling_transitions(json.loads(path.read_text())) == []


def _machine(**states: dict) -> dict:
    return {"StartAt": "First", "States": {"First": {"Type": "Pass", "End": True}, **states}}


@pytest.mark.parametrize(
    ("definition", "problem"),
    [
        ({"StartAt": "Nowhere", "States": {"First": {"Type": "Pass", "End": True}}}, "/: StartAt 'Nowhere'"),
        (_machine(Second={"Type": "Pass", "Next": "Missing"}), "/Second: Next 'Missing'"),
        (
            _machine(Pick={"Type": "Choice", "Choices": [{"Variable": "$.x", "IsPresent": True, "Next": "Gone"}]}),
            "/Pick: Choices[0].Next 'Gone'",
        ),
        (_machine(Pick={"Type": "Choice", "Choices": [], "Default": "Gone"}), "/Pick: Default 'Gone'"),
        (
            _machine(
                Work={
                    "Type": "Task",
                    "Resource": "x",
                    "End": True,
                    "Catch": [{"ErrorEquals": ["States.ALL"], "Next": "Gone"}],
                }
            ),
            "/Work: Catch[0].Next 'Gone'",
        ),
        (
            _machine(
                Both={
                    "Type": "Parallel",
                    "End": True,
                    "Branches": [{"StartAt": "In", "States": {"In": {"Type": "Pass", "Next": "First"}}}],
                }
            ),
            "/Both/Branches[0]/In: Next 'First'",
        ),
        (
            _machine(
                Each={
                    "Type": "Map",
                    "End": True,
                    "ItemProcessor": {"StartAt": "Absent", "States": {"In": {"Type": "Pass", "End": True}}},
                }
            ),
            "/Each/ItemProcessor: StartAt 'Absent'",
        ),
        (
            _machine(
                Each={
                    "Type": "Map",
                    "End": True,
                    "Iterator": {"StartAt": "In", "States": {"In": {"Type": "Pass", "Default": "Out"}}},
                }
            ),
            "/Each/Iterator/In: Default 'Out'",
        ),
    ],
)
def test_a_dangling_target_is_reported_with_its_path(definition: dict, problem: str) -> None:
    problems = dangling_transitions(definition)
    assert len(problems) == 1 and problems[0].startswith(problem), problems
