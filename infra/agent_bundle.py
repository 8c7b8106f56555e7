"""The agent asset's contents, staged as bootstrap.sh unpacks them (no CDK here: the rehearsal stages it too)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
VM_BOOTSTRAP_DIR = REPO_ROOT / "vm-bootstrap"
CONTRACTS_DIR = REPO_ROOT / "functions" / "spotcr_contracts"
BOOTSTRAP_SCRIPT = VM_BOOTSTRAP_DIR / "bootstrap.sh"  # the job VMs' user data, once rendered
PLACEHOLDER = re.compile(r"__SPOTCR_[A-Z0-9_]+__")
EFS_UTILS_ENV = "SPOTCR_EFS_UTILS"  # "stand-in": a test build (make test, demo, bench) may stage spotcr's stand-in
BUILD_DIR = REPO_ROOT / ".build"  # vm-bootstrap/build-artifact.sh (make artifacts) writes the prebuilt parts here
_STAGE_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache", ".pytest_cache", "tests")
# Build-time files: a VM installs the prebuilt artifact instead.
_BUILD_ONLY = shutil.ignore_patterns(
    "install-criu.sh",
    "build-artifact.sh",
    "fetch-debian-packages.sh",
    "fetch-efs-utils.sh",
    "mount-efs-stand-in",
    "*.lock",
    "*.patch",
    "__pycache__",
    "*.pyc",
)


def render_user_data(script: str, values: Mapping[str, str]) -> str:
    """Put deployment values into the bootstrap's `__SPOTCR_*__` placeholders; an unknown one is an error."""
    used = set(PLACEHOLDER.findall(script))
    unknown, unused = sorted(used - set(values)), sorted(set(values) - used)
    if unknown:
        raise ValueError(f"{BOOTSTRAP_SCRIPT.name} uses placeholders infra does not provide: {', '.join(unknown)}")
    if unused:
        raise ValueError(f"{BOOTSTRAP_SCRIPT.name} does not use the placeholders {', '.join(unused)}")
    return PLACEHOLDER.sub(lambda match: values[match.group(0)], script)


class ArtifactMissing(FileNotFoundError):
    pass


def stage_agent_bundle(
    destination: Path, architecture: str = "amd64", build_dir: Path = BUILD_DIR, *, allow_stand_in: bool = False
) -> Path:
    """The agent bundle as bootstrap.sh unpacks it: vm-bootstrap/'s files at the root, spotcr_contracts/, and the
    prebuilt parts for `architecture`: criu/ (CRIU's tarball and sha256), python/ (the agent's packages) and debs/
    (the Debian packages a VM installs instead of using apt, with the lock they match) and amazon-efs-utils/ (the EFS
    mount helper, or in a test build its stand-in: its SOURCE says which)."""
    criu = sorted(build_dir.glob(f"spotcr-criu-*-{architecture}.tar.gz"))
    python = build_dir / f"agent-python-{architecture}"
    debs = build_dir / f"debian-packages-{architecture}"
    if len(criu) != 1 or not criu[0].with_name(criu[0].name + ".sha256").is_file() or not python.is_dir():
        raise ArtifactMissing(
            f"no prebuilt CRIU and agent packages for {architecture} in {build_dir}: run `make artifacts` "
            f"on a Debian 12 {architecture} machine (vm-bootstrap/build-artifact.sh)"
        )
    if not (debs / "packages.lock").is_file():
        raise ArtifactMissing(
            f"no Debian packages for {architecture} VMs in {build_dir}: run `make artifacts` "
            f"on a Debian 12 {architecture} machine (vm-bootstrap/fetch-debian-packages.sh)"
        )
    efs_utils = build_dir / "amazon-efs-utils"
    if not (efs_utils / "SOURCE").is_file():
        raise ArtifactMissing(
            f"no amazon-efs-utils in {build_dir}: run `make artifacts` (vm-bootstrap/fetch-efs-utils.sh; "
            "SPOTCR_EFS_UTILS=stand-in for a test build that cannot reach GitHub)"
        )
    # make test, demo and bench set it (the rehearsal mounts no EFS): a plain `cdk deploy` must not ship it.
    allow_stand_in = allow_stand_in or os.environ.get(EFS_UTILS_ENV) == "stand-in"
    if (efs_utils / "SOURCE").read_text().startswith("stand-in") and not allow_stand_in:
        raise ArtifactMissing(
            f"{efs_utils} holds spotcr's stand-in of mount.efs (a test build's), which mounts nothing: run "
            "`make artifacts` (or `make deploy`) to fetch amazon-efs-utils before a deploy"
        )
    shutil.copytree(VM_BOOTSTRAP_DIR, destination, ignore=_BUILD_ONLY, dirs_exist_ok=True)
    shutil.copytree(CONTRACTS_DIR, destination / "spotcr_contracts", ignore=_STAGE_IGNORE)
    (destination / "criu").mkdir(exist_ok=True)
    for path in (criu[0], criu[0].with_name(criu[0].name + ".sha256")):
        shutil.copy2(path, destination / "criu" / path.name)
    shutil.copytree(python, destination / "python", dirs_exist_ok=True)
    shutil.copytree(debs, destination / "debs", dirs_exist_ok=True)
    shutil.copytree(efs_utils, destination / "amazon-efs-utils", dirs_exist_ok=True)
    return destination
