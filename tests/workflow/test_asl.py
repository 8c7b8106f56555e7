"""The ASL file and the catalog agree: what infra/ substitutes is exactly what the state machine uses."""

from __future__ import annotations

import json
import re

from spotcr_functions import catalog

from tests.workflow.harness import ASL

KINDS = ("function:", "table:", "topic:", "document:", "launch-template", "bus", "bucket")


def test_every_substitution_is_declared_and_resolvable() -> None:
    text = ASL.read_text()
    assert set(re.findall(r"\$\{(\w+)\}", text)) == set(catalog.WORKFLOW_SUBSTITUTIONS)
    steps = {f.name for f in catalog.FUNCTIONS if f.workflow_step}
    for kind in catalog.WORKFLOW_SUBSTITUTIONS.values():
        assert kind.startswith(KINDS), kind
        if kind.startswith("function:"):
            assert kind.removeprefix("function:") in steps
    assert {f"function:{name}" for name in steps} <= set(catalog.WORKFLOW_SUBSTITUTIONS.values())


def test_standard_workflow_with_a_timeout_and_known_capabilities() -> None:
    definition = json.loads(ASL.read_text())
    assert 0 < definition["TimeoutSeconds"] <= 24 * 3600
    vocabulary = {value for name, value in vars(catalog).items() if name.isupper() and isinstance(value, str)}
    assert set(catalog.WORKFLOW_CAPABILITIES) <= vocabulary
    for function in catalog.FUNCTIONS:
        assert set(function.capabilities) <= vocabulary, function.name
