"""SLOW (about 30-60 s): the real pinned CDK CLI synthesizes offline with no credentials, then cfn-lint checks it.

This is the one infra test that leaves the process: it runs `npx --no-install cdk synth` exactly as
`make synth` does (cdk-nag runs inside it and fails the synth on any unacknowledged finding).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.infra.conftest import REPO_ROOT

# cfn-lint warnings reviewed and kept (listed in the README's deploy section):
# W3005: CDK adds DependsOn on each function's role, which a GetAtt already implies; harmless.
REVIEWED_WARNINGS = {"W3005"}


def _offline_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        CDK_DISABLE_CLI_TELEMETRY="1",
        CDK_DISABLE_VERSION_CHECK="1",
        JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION="20",
        PYTHONPATH=os.pathsep.join(str(REPO_ROOT / p) for p in ("functions", "vm-bootstrap", ".")),
        # no credentials and no config: a lookup would fail instead of silently using an account
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_CONFIG_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
    )
    return env


def test_cli_synth_offline_then_cfn_lint(tmp_path: Path) -> None:
    # Given no AWS credentials, when the pinned CLI synthesizes the app
    synth = subprocess.run(
        ["npx", "--no-install", "cdk", "--no-notices", "synth", "--quiet", "--output", str(tmp_path)],
        cwd=REPO_ROOT,
        env=_offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert synth.returncode == 0, synth.stdout[-3000:] + synth.stderr[-3000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    stacks = [a for a in manifest["artifacts"].values() if a["type"] == "aws:cloudformation:stack"]
    assert len(stacks) == 1
    template = tmp_path / stacks[0]["properties"]["templateFile"]

    # Then cfn-lint finds no error, and no warning that was not reviewed
    lint = subprocess.run(
        [str(REPO_ROOT / ".venv" / "bin" / "cfn-lint"), "--format", "json", str(template)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    findings = {(m["Rule"]["Id"], m["Message"]) for m in json.loads(lint.stdout or "[]")}
    assert not [f for f in findings if f[0].startswith("E")], findings
    assert {rule for rule, _ in findings} <= REVIEWED_WARNINGS, findings
