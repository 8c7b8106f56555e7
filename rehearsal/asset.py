"""The agent asset in the local cloud: staged and uploaded as `cdk deploy` does, installed by each VM's boot.

A local VM installs the same bundle a job VM does (infra.vm_launch.stage_agent_bundle: the agent, the prebuilt
CRIU tarball, the agent's Python packages), fetched from S3 by bootstrap.sh's own fetch_asset and installed by the
bundle's install-artifact.sh into the VM's private /opt/spotcr. Which asset: the one its own user data names (the
launch template version it was launched from), as on EC2. What differs from EC2: the SSM agent is the rehearsal's
stand-in, nothing is installed system-wide (the host's CRIU stays as it is), no packages step.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.agent_bundle import stage_agent_bundle
from rehearsal.vm import REPO

VM_PREFIX = "/opt/spotcr"
MARKER = "rehearsal-deployment"  # a file at the asset's root naming the deployment that published it
# bootstrap.sh's console lines (its `say`, `done_step` and asset step), as the rehearsal's boot prints them too.
_STEP_LINE = re.compile(r"^spotcr-bootstrap: (?P<step>[a-z0-9-]+) took (?P<seconds>\d+(?:\.\d+)?) s$", re.MULTILINE)
_FETCH_LINE = re.compile(r"^spotcr-bootstrap: fetching the agent from (?P<url>\S+)$", re.MULTILINE)
_MARKER_LINE = re.compile(r"^spotcr-bootstrap: agent asset of (?P<label>.+)$", re.MULTILINE)


def publish(s3: Any, bucket: str, deployment: str = "", key: str = "") -> str:
    """Stage the bundle, zip it and upload it, as CDK's asset publishing does: under `key`, else under its content's
    hash (a changed asset gets a new key); `deployment` goes into its MARKER file. Returns its s3:// URL."""
    with tempfile.TemporaryDirectory(prefix="spotcr-rehearsal-asset-") as work:
        staged = stage_agent_bundle(Path(work) / "bundle", "amd64", allow_stand_in=True)  # it mounts no EFS
        if deployment:
            (staged / MARKER).write_text(f"{deployment}\n")
        archive = Path(shutil.make_archive(str(Path(work) / "agent"), "zip", staged))
        key = key or f"{hashlib.sha256(archive.read_bytes()).hexdigest()}.zip"
        s3.create_bucket(Bucket=bucket)
        s3.upload_file(str(archive), bucket, key)
    return f"s3://{bucket}/{key}"


def boot_command(agent_bootstrap: list[str]) -> list[str]:
    """bootstrap.sh's steps inside a local VM, each timed and a failed one reported as bootstrap.sh does: the SSM
    agent stand-in, the asset this VM's user data names, its install into the VM's own /opt/spotcr, then
    `agent_bootstrap` (`spotcr-agent bootstrap ...`)."""
    bootstrap = shlex.quote(str(REPO / "vm-bootstrap" / "bootstrap.sh"))
    script = f"""
set -eEuo pipefail
source {bootstrap}
user_data=$(mktemp)
imds user-data > "$user_data"
source "$user_data"  # this VM's launch template version: its AGENT_ASSET_URL and EVENT_BUS
rm -f "$user_data"
say() {{ echo "spotcr-bootstrap: $*"; }}  # the VM's console is its console.log, not the host's /dev/console
region=$(imds meta-data/placement/region)
step=start
mark=$(now_ms)
trap on_error ERR
step=ssm-agent
{shlex.quote(sys.executable)} -m rehearsal.ssm_agent
done_step
step=asset
say "fetching the agent from $AGENT_ASSET_URL"
fetch_asset "$AGENT_ASSET_URL" "$region"
if [[ -f {VM_PREFIX}/lib/{MARKER} ]]; then say "agent asset of $(cat {VM_PREFIX}/lib/{MARKER})"; fi
done_step
step=install
bash {VM_PREFIX}/lib/install-artifact.sh {VM_PREFIX}/lib {VM_PREFIX}
done_step
step=agent-bootstrap
{shlex.join(agent_bootstrap)}
done_step
"""
    return ["bash", "-c", script]


@dataclass
class Boot:
    """What a VM's console says about its boot: each step's seconds, in order, and the asset it installed."""

    phases_s: dict[str, float] = field(default_factory=dict)
    asset_url: str = ""
    deployment: str = ""

    def describe(self, boot_to_ready_s: float) -> str:
        """`ssm-agent 0.3 s, asset 1.2 s, ...` and the rest of launch to ready (VM start, the agent's start)."""
        if not self.phases_s:
            return "no boot steps on its console"
        steps = [f"{step} {seconds:.1f} s" for step, seconds in self.phases_s.items()]
        rest = boot_to_ready_s - sum(self.phases_s.values())
        return ", ".join([*steps, f"other {max(0.0, rest):.1f} s"])


def read_boot(console: str) -> Boot:
    fetched, deployed = _FETCH_LINE.findall(console), _MARKER_LINE.findall(console)
    return Boot(
        phases_s={match["step"]: float(match["seconds"]) for match in _STEP_LINE.finditer(console)},
        asset_url=fetched[-1] if fetched else "",
        deployment=deployed[-1] if deployed else "",
    )
