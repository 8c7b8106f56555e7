"""Fixtures shared by every test area. Areas add their own in tests/<area>/conftest.py."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


@pytest.fixture(scope="session")
def criu_bin() -> str:
    """The CRIU that `make test` installed; a test that needs it fails loudly rather than skip."""
    path = shutil.which("criu", path=f"/usr/local/sbin:{os.environ.get('PATH', '')}")
    assert path, "criu not found: run `make criu` (vm-bootstrap/install-criu.sh)"
    assert os.geteuid() == 0, "CRIU tests need root"
    check = subprocess.run([path, "check"], capture_output=True, text=True, check=False)
    assert check.returncode == 0, f"criu check failed: {check.stdout}{check.stderr}"
    return path
