"""The agent's result lines: each shared vector (tests/events/results/) reads back as its type and is written back
the same; a bad or partial line is refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from spotcr_contracts import results

VECTORS = sorted((Path(__file__).parents[1] / "events" / "results").glob("*.json"))
PARSERS = {"checkpoint": results.parse_checkpoint, "restore": results.parse_restore, "status": results.parse_status}


def _vector(name: str) -> dict[str, Any]:
    line: dict[str, Any] = json.loads((VECTORS[0].parent / f"{name}.json").read_text())["line"]
    return line


def test_the_vectors_cover_every_result_both_ways() -> None:
    read = [PARSERS[doc["command"]](json.dumps(doc["line"])) for doc in (json.loads(p.read_text()) for p in VECTORS)]
    kinds = {(type(result).__name__, getattr(result, "ok", False)) for result in read}
    assert kinds == {
        ("CheckpointResult", True),
        ("CheckpointResult", False),
        ("RestoreResult", True),
        ("RestoreResult", False),
        ("StatusResult", False),  # getattr's default: a status is ok by its type
        ("CommandFailed", False),
    }


@pytest.mark.parametrize("vector", VECTORS, ids=lambda p: p.stem)
def test_each_vector_reads_back_as_its_type_and_writes_back_the_same(vector: Path) -> None:
    doc = json.loads(vector.read_text())
    # Given the line among the agent's log lines on stdout, as SSM reports it
    stdout = f"starting\n{json.dumps(doc['line'])}\n"
    result = PARSERS[doc["command"]](stdout)
    assert json.loads(result.to_line()) == doc["line"]
    assert list(json.loads(result.to_line())) == list(doc["line"])


def test_fields_an_agent_adds_are_ignored() -> None:
    line = {**_vector("status-exited"), "disk_free_mb": 120}
    result = results.parse_status(json.dumps(line))
    assert isinstance(result, results.StatusResult) and result.exit_code == 0


@pytest.mark.parametrize(
    ("vector", "change", "message"),
    [
        ("checkpoint-committed", {"generation": None}, "CheckpointResult: missing field 'generation'"),
        ("checkpoint-committed", {"generation": "2"}, "field 'generation' has type str"),
        ("checkpoint-committed", {"generation": True}, "field 'generation' has type bool"),
        ("checkpoint-committed", {"seconds": "3.5"}, "field 'seconds' has type str"),
        ("checkpoint-committed", {"kind": "hourly"}, "field 'kind' is 'hourly'"),
        ("checkpoint-committed", {"checkpoint_id": "../x"}, "field 'checkpoint_id' '../x' does not match"),
        ("checkpoint-committed", {"ok": "yes"}, "field 'ok' is 'yes'"),
        ("checkpoint-failed", {"job_id": None}, "CheckpointResult: missing field 'job_id'"),
        ("restore-restored", {"attempt": "third"}, "field 'attempt' is 'third'"),
        ("restore-restored", {"pid": 1.5}, "field 'pid' has type float"),
        ("status-exited", {"job_status": "lost"}, "field 'job_status' is 'lost'"),
        ("status-exited", {"exit_code": "0"}, "field 'exit_code' has type str"),
        ("status-exited", {"final_dumps": {"2": 1}}, "field 'final_dumps' has type dict"),
        ("status-exited", {"ok": False}, "field 'ok' is false"),
    ],
)
def test_a_bad_or_partial_line_is_refused_naming_the_field(vector: str, change: dict[str, Any], message: str) -> None:
    doc = json.loads((VECTORS[0].parent / f"{vector}.json").read_text())
    line = {k: v for k, v in {**doc["line"], **change}.items() if v is not None or k not in change}
    with pytest.raises(results.InvalidResult, match=message.replace("(", r"\(").replace(".", r"\.")):
        PARSERS[doc["command"]](json.dumps(line))


@pytest.mark.parametrize(
    ("stdout", "message"),
    [
        ("", "printed no result line"),
        ("Traceback (most recent call last):\n", "printed no result line"),
        ('{"ok": true, "job_id": \n', "not JSON"),
        ("{}", "field 'ok' is None"),
    ],
)
def test_output_without_a_result_line_is_refused(stdout: str, message: str) -> None:
    with pytest.raises(results.InvalidResult, match=message):
        results.parse_restore(stdout)
