"""The probe document `spotcr probe --instance` sends: synthesized from the one PROBE command, named by stack."""

from __future__ import annotations

import pytest
from spotcr_contracts import commands

from tests.infra.conftest import Synth


def test_the_stack_ships_the_probe_document_and_names_it(default_synth: Synth) -> None:
    documents = default_synth.of_type("AWS::SSM::Document")
    probe = [d["Properties"] for d in documents.values() if d["Properties"].get("Name") == "spotcr-probe"]

    assert len(probe) == 1
    assert probe[0]["DocumentType"] == "Command"
    assert probe[0]["Content"] == commands.PROBE.document()
    step = probe[0]["Content"]["mainSteps"][0]["inputs"]["runCommand"][0]
    assert step.startswith(f"exec {commands.AGENT_BIN} probe ")  # the agent bootstrap.sh installs under /opt/spotcr
    assert all(p["interpolationType"] == "ENV_VAR" for p in probe[0]["Content"]["parameters"].values())
    outputs = default_synth.template.to_json()["Outputs"]
    assert "ProbeDocument" in outputs


def test_probe_parameters_are_checked_as_ssm_checks_them() -> None:
    argv = commands.PROBE.agent_argv({"Streams": "1,8", "SizeMiB": "256"})

    assert argv == [
        commands.AGENT_BIN, "probe", "--streams", "1,8", "--block-kib", "64,1024", "--size-mib", "256",
        "--pipeline-mib", "16",
    ]  # fmt: skip
    for hostile in ({"Streams": "1;reboot"}, {"SizeMiB": "$(id)"}, {"BlockKiB": "64 1024"}):
        with pytest.raises(ValueError, match=next(iter(hostile))):
            commands.PROBE.agent_argv(hostile)
