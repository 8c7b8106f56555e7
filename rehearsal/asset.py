"""The agent asset in the local cloud: staged and uploaded as `cdk deploy` does, installed by each VM's boot.

A local VM installs the same bundle a job VM does (infra.vm_launch.stage_agent_bundle: the agent, the prebuilt
CRIU tarball, the agent's Python packages), fetched from S3 by bootstrap.sh's own s3_get and installed by the
bundle's install-artifact.sh into the VM's private /opt/spotcr. What differs from EC2: the SSM agent is the
rehearsal's stand-in, nothing is installed system-wide (the host's CRIU stays as it is), no apt.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

from infra.agent_bundle import stage_agent_bundle
from rehearsal.vm import REPO

ASSET_KEY = "assets/spotcr-agent.zip"
VM_PREFIX = "/opt/spotcr"


def publish(s3: Any, bucket: str, architecture: str = "amd64", key: str = ASSET_KEY) -> str:
    """Stage the bundle, zip it and upload it, as CDK's asset publishing does; returns its s3:// URL."""
    with tempfile.TemporaryDirectory(prefix="spotcr-rehearsal-asset-") as work:
        staged = stage_agent_bundle(Path(work) / "bundle", architecture)
        archive = shutil.make_archive(str(Path(work) / "agent"), "zip", staged)
        s3.create_bucket(Bucket=bucket)
        s3.upload_file(archive, bucket, key)
    return f"s3://{bucket}/{key}"


def install_command(asset_url: str, region: str) -> list[str]:
    """bootstrap.sh's asset and install steps, run inside a local VM (its own /opt/spotcr)."""
    script = f"""
set -eEuo pipefail
source {shlex.quote(str(REPO / "vm-bootstrap" / "bootstrap.sh"))}
work=$(mktemp -d)
s3_get {shlex.quote(asset_url)} "$work/agent.zip" {shlex.quote(region)}
rm -rf {VM_PREFIX}/lib && mkdir -p {VM_PREFIX}/lib
python3 -m zipfile -e "$work/agent.zip" {VM_PREFIX}/lib
rm -rf "$work"
bash {VM_PREFIX}/lib/install-artifact.sh {VM_PREFIX}/lib {VM_PREFIX}
"""
    return ["bash", "-c", script]
