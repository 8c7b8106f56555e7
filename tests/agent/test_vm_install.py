"""What a job VM installs instead of compiling: the prebuilt CRIU artifact, the agent bundle, the signed S3 fetch."""

import hashlib
import http.server
import os
import re
import shutil
import subprocess
import tarfile
import threading
from pathlib import Path
from typing import ClassVar

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from spotcr_agent import gpu

from infra.agent_bundle import BUILD_DIR, ArtifactMissing, stage_agent_bundle

VM = Path(__file__).parents[2] / "vm-bootstrap"
ARCH = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """The agent bundle as the stack uploads it (needs `make artifacts`, which `make test` runs)."""
    return stage_agent_bundle(tmp_path_factory.mktemp("asset") / "bundle", ARCH)


def test_the_bundle_carries_the_prebuilt_parts_and_no_build_scripts(bundle):
    names = {path.name for path in bundle.iterdir()}
    assert {
        "spotcr_agent",
        "spotcr_contracts",
        "bin",
        "install-artifact.sh",
        "criu",
        "python",
        "amazon-efs-utils",
    } <= names
    assert not {"install-criu.sh", "build-artifact.sh"} & names
    assert not list(bundle.glob("*.patch"))
    tarball = next((bundle / "criu").glob(f"spotcr-criu-*-{ARCH}.tar.gz"))
    recorded = (bundle / "criu" / f"{tarball.name}.sha256").read_text().split()[0]
    assert recorded == hashlib.sha256(tarball.read_bytes()).hexdigest()
    assert (bundle / "python" / "boto3").is_dir() and list((bundle / "python").glob("zstandard/backend_c*.so"))
    assert not {"fetch-debian-packages.sh", f"debian-packages-{ARCH}.lock"} & names


def test_the_bundle_carries_every_debian_package_a_vm_installs_as_locked(bundle):
    # Given the lock of the Debian 12 packages a VM may lack (iptables; nfs-common and stunnel4 for EFS)
    lock = (VM / f"debian-packages-{ARCH}.lock").read_text()
    entries = {tuple(line.split()) for line in lock.splitlines() if not line.startswith("#")}
    assert {wanted for wanted, *_ in entries} == {"iptables", "nfs-common", "stunnel4"}
    # Then the bundle's debs/ holds each at its locked sha256, with the lock the VM checks them against
    assert (bundle / "debs" / "packages.lock").read_text() == lock
    for _, name, version, sha256 in entries:
        deb = bundle / "debs" / f"{name}.deb"
        assert hashlib.sha256(deb.read_bytes()).hexdigest() == sha256, name
        control = subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Package", "Version"], capture_output=True, text=True, check=True
        )
        assert control.stdout.split() == ["Package:", name, "Version:", version]
    # And it stays small: every VM downloads the asset at boot
    assert sum(path.stat().st_size for path in (bundle / "debs").iterdir()) < 5 * 2**20


def _packages_step(
    bundle: Path, tmp_path: Path, efs_id: str, isolation: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """bootstrap.sh's packages step on this Debian 12 machine, with dpkg -i and apt-get recorded, not run."""
    shims, log = tmp_path / "shims", tmp_path / "system.log"
    shims.mkdir()
    for name, body in {
        "dpkg": 'if [ "$1" = -i ]; then echo "dpkg $*" >> "$SHIM_LOG"; exit 0; fi; exec /usr/bin/dpkg "$@"',
        "apt-get": 'echo "apt-get $*" >> "$SHIM_LOG"; exit 1',
        "mount.nfs4": "exit 0",  # present or not: set by the case below
    }.items():
        (shims / name).write_text(f"#!/bin/sh\n{body}\n")
        (shims / name).chmod(0o755)
    if efs_id:
        (shims / "mount.nfs4").unlink()  # a fresh VM: no NFS client
    script = (
        f"source {VM / 'bootstrap.sh'}; PREFIX={tmp_path / 'opt'}; EFS_ID={efs_id!r}; EFS_ISOLATION={isolation!r};"
        " install_missing_packages"
    )
    (tmp_path / "opt").mkdir()
    (tmp_path / "opt" / "lib").symlink_to(bundle)
    ran = subprocess.run(
        ["/bin/bash", "-c", script],
        check=False,
        capture_output=True,
        text=True,
        env={"PATH": f"{shims}:/usr/sbin:/usr/bin:/sbin:/bin", "SHIM_LOG": str(log)},
    )
    return ran, log.read_text().splitlines() if log.exists() else []


@pytest.mark.skipif(shutil.which("stunnel") is not None, reason="needs a machine without stunnel, as a fresh VM")
def test_an_isolated_efs_vm_installs_its_packages_from_the_asset_without_apt(bundle, tmp_path):
    # Given a Debian 12 VM without an NFS client or stunnel, and an isolated EFS job
    ran, recorded = _packages_step(bundle, tmp_path, "fs-0123456789abcdef0", "true")
    # Then its packages come from the asset in one dpkg run, and apt (the Debian mirror) is never called
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert not [line for line in recorded if line.startswith("apt-get")]
    [dpkg] = [line for line in recorded if line.startswith("dpkg -i")]
    installed = {Path(arg).name for arg in dpkg.split() if arg.endswith(".deb")}
    assert {"nfs-common.deb", "stunnel4.deb"} <= installed
    assert all(Path(arg).parent == tmp_path / "opt" / "lib" / "debs" for arg in dpkg.split() if arg.endswith(".deb"))
    # And only what the machine lacks: a package it already has (netbase, say) is left alone
    assert not [name for name in installed if _installed(name.removesuffix(".deb"))]


def _installed(package: str) -> bool:
    status = subprocess.run(
        ["dpkg-query", "-W", "-f=${db:Status-Status}", package], capture_output=True, text=True, check=False
    )
    return status.stdout == "installed"


def test_a_deb_that_does_not_match_its_lock_is_refused(bundle, tmp_path):
    # Given an asset whose nfs-common package was replaced
    tampered = tmp_path / "bundle"
    shutil.copytree(bundle / "debs", tampered / "debs")
    (tampered / "debs" / "nfs-common.deb").write_bytes(b"not the locked package")
    ran, recorded = _packages_step(tampered, tmp_path, "fs-0123456789abcdef0", "")
    # Then nothing is installed, and the step fails saying why
    assert ran.returncode != 0
    assert "do not match their lock" in ran.stdout
    assert not recorded


def test_a_missing_artifact_is_named_with_how_to_build_it(tmp_path):
    with pytest.raises(ArtifactMissing, match=r"no prebuilt CRIU and agent packages for arm64 .* `make artifacts`"):
        stage_agent_bundle(tmp_path / "bundle", "arm64", build_dir=BUILD_DIR)


def _install(bundle: Path, prefix: Path) -> Path:
    """install-artifact.sh run as a VM runs it, into a private prefix; returns the prefix."""
    installed = subprocess.run(
        ["bash", str(bundle / "install-artifact.sh"), str(bundle), str(prefix)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr
    return prefix


def test_the_vm_artifact_installs_cuda_plugin_where_the_agent_finds_it(bundle, tmp_path):
    # Given the bundle installed as on a VM
    prefix = _install(bundle, tmp_path / "opt-spotcr")

    # Then the agent finds CRIU's CUDA plugin beside the VM's criu, and the plugin's libraries resolve
    directory = gpu.plugin_dir(str(prefix / "criu" / "bin" / "criu"), dirs=())
    assert directory is not None
    assert directory == prefix / "criu" / "lib" / "criu"
    linked = subprocess.run(["ldd", str(directory / gpu.PLUGIN)], capture_output=True, text=True, check=True).stdout
    assert "not found" not in linked, linked


@pytest.mark.criu
def test_the_artifact_installs_without_a_compiler_and_passes_criu_check(bundle, tmp_path):
    # Given the bundle unpacked as on a VM, When install-artifact.sh installs it into a private prefix
    prefix = _install(bundle, tmp_path / "opt-spotcr")
    criu = prefix / "criu" / "bin" / "criu"
    # Then its CRIU finds its libraries beside it with no environment, and works on this kernel
    linked = subprocess.run(["ldd", str(criu)], capture_output=True, text=True, check=True).stdout
    assert f"libprotobuf-c.so.1 => {prefix}/criu/bin/../lib/libprotobuf-c.so.1" in linked
    check = subprocess.run(["env", "-i", str(criu), "check"], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert (prefix / "bin" / "spotcr-agent").stat().st_mode & 0o111


def test_the_artifact_installs_the_efs_mount_helper_that_efs_isolation_needs(bundle, tmp_path):
    # Given the bundle installed as on a VM (make test builds it with SPOTCR_EFS_UTILS=stand-in: no GitHub here)
    prefix = _install(bundle, tmp_path / "opt-spotcr")
    # Then mount.efs and its watchdog run on the VM's python3 with nothing else installed, and say what they are
    source = (bundle / "amazon-efs-utils" / "SOURCE").read_text()
    for tool in ("mount.efs", "amazon-efs-mount-watchdog"):
        ran = subprocess.run(
            [str(prefix / "efs-utils" / tool), "--version"], capture_output=True, text=True, check=False
        )
        assert ran.returncode == 0 and ran.stdout.strip().endswith("Version: 1.36.0"), ran.stdout + ran.stderr
    if source.startswith("stand-in"):
        # The stand-in refuses to mount, saying why
        refused = subprocess.run(
            [str(prefix / "efs-utils" / "mount.efs"), "fs-12345678:/", str(tmp_path / "mnt"), "-o", "tls,iam"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert refused.returncode == 32
        assert "the EFS mount helper was not fetched at artifact build" in refused.stderr
    else:
        assert source.startswith("amazon-efs-utils 1.36.0 from https://github.com/aws/efs-utils/")


def _fetch_efs_utils(tmp_path: Path, lock: str, **env: str) -> subprocess.CompletedProcess[str]:
    """fetch-efs-utils.sh run from a copy of vm-bootstrap/ whose lock is `lock`, into tmp_path/out."""
    scripts = tmp_path / "vm-bootstrap"
    scripts.mkdir(exist_ok=True)
    for name in ("fetch-efs-utils.sh", "mount-efs-stand-in"):
        shutil.copy2(VM / name, scripts / name)
    (scripts / "efs-utils.lock").write_text(lock)
    return subprocess.run(
        ["bash", str(scripts / "fetch-efs-utils.sh"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "SPOTCR_EFS_UTILS": "", **env},
    )


RELEASE_FILES = {
    "src/mount_efs/__init__.py": 'import sys\nprint(sys.argv[0], "Version: 1.36.0")\n',
    "src/watchdog/__init__.py": "",
    "dist/efs-utils.conf": "",
    "dist/efs-utils.crt": "",
    "dist/amazon-efs-mount-watchdog.service": "",
    "LICENSE": "MIT",
}


def _release(tmp_path: Path) -> Path:
    """A tarball laid out as upstream's release is (efs-utils-<version>/src, dist, LICENSE)."""
    root = tmp_path / "efs-utils-1.36.0"
    for path, text in RELEASE_FILES.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    with tarfile.open(tmp_path / "release.tar.gz", "w:gz") as archive:
        archive.add(root, arcname=root.name)
    return tmp_path / "release.tar.gz"


def _lock(url: str, **digests: str) -> str:
    """The lock: "version url", then each installed file's sha256 (the release's own unless given by its name)."""
    pins = "".join(
        f"{digests.get(Path(path).name, hashlib.sha256(text.encode()).hexdigest())}  {path}\n"
        for path, text in RELEASE_FILES.items()
    )
    return f"1.36.0 {url}\n{pins}"


def test_the_efs_mount_helper_is_the_pinned_release_or_the_build_fails(tmp_path):
    # Given the release tarball the lock names
    release = _release(tmp_path)

    # When the lock pins the sha256 of each file it installs, Then they are installed as build-deb.sh lays them out
    fetched = _fetch_efs_utils(tmp_path, _lock(f"file://{release}"))
    assert fetched.returncode == 0, fetched.stderr
    out = tmp_path / "out" / "amazon-efs-utils"
    assert {p.name for p in out.iterdir()} == {
        "mount.efs",
        "amazon-efs-mount-watchdog",
        "efs-utils.conf",
        "efs-utils.crt",
        "amazon-efs-mount-watchdog.service",
        "LICENSE",
        "SOURCE",
    }
    assert (out / "SOURCE").read_text().startswith(f"amazon-efs-utils 1.36.0 from file://{release}, files pinned")

    # When a file of the release is not the pinned one, Then the build fails
    mismatch = _fetch_efs_utils(tmp_path, _lock(f"file://{release}", **{"__init__.py": "0" * 64}))
    assert mismatch.returncode == 1 and "sha256 mismatch" in mismatch.stderr

    # When the lock pins nothing, Then the build fails naming the pin to make (never skipping the check)
    unpinned = _fetch_efs_utils(tmp_path, f"1.36.0 file://{release}\n")
    assert unpinned.returncode == 1 and "pins no sha256" in unpinned.stderr
    assert "SPOTCR_LOCK_EFS_UTILS=1" in unpinned.stderr

    # When the lock mode pins them, Then the lock holds each file's sha256 and the build succeeds
    locked = _fetch_efs_utils(tmp_path, f"1.36.0 file://{release}\n", SPOTCR_LOCK_EFS_UTILS="1")
    assert locked.returncode == 0, locked.stderr
    assert (tmp_path / "vm-bootstrap" / "efs-utils.lock").read_text() == _lock(f"file://{release}")


def test_the_lock_pins_the_files_the_vendored_copy_had(tmp_path):
    # The committed lock's pins are those of the upstream files this repository carried before (unchanged, tag
    # v1.36.0): read back from the lock, they name exactly the files the script installs.
    lines = [line for line in (VM / "efs-utils.lock").read_text().splitlines() if not line.startswith("#")]
    assert lines[0] == "1.36.0 https://github.com/aws/efs-utils/archive/refs/tags/v1.36.0.tar.gz"
    assert [line.split("  ")[1] for line in lines[1:]] == list(RELEASE_FILES)
    assert all(len(line.split("  ")[0]) == 64 for line in lines[1:])


def test_a_deploy_build_never_ships_the_stand_in(tmp_path):
    # Given a test build's stand-in in the build dir
    standin = _fetch_efs_utils(tmp_path, "1.36.0 file:///nonexistent.tar.gz\n", SPOTCR_EFS_UTILS="stand-in")
    assert standin.returncode == 0, standin.stderr
    assert (tmp_path / "out" / "amazon-efs-utils" / "SOURCE").read_text().startswith("stand-in")
    # When an artifact build without the flag cannot fetch the release
    failed = _fetch_efs_utils(tmp_path, _lock(f"file://{tmp_path}/missing.tar.gz"))
    # Then it fails saying so, and the stand-in is gone (a later synth finds no EFS helper rather than the stand-in)
    assert failed.returncode == 1 and "cannot download amazon-efs-utils 1.36.0" in failed.stderr
    assert not (tmp_path / "out" / "amazon-efs-utils").exists()
    with pytest.raises(ArtifactMissing, match="amazon-efs-utils"):
        stage_agent_bundle(tmp_path / "bundle", ARCH, _build_dir_without_efs_utils(tmp_path))


def test_a_bundle_staged_outside_a_test_build_refuses_the_stand_in(tmp_path, monkeypatch):
    # Given a build dir whose EFS helper is the stand-in a test build left (make test sets SPOTCR_EFS_UTILS)
    standin = _fetch_efs_utils(tmp_path, "1.36.0 file:///nonexistent.tar.gz\n", SPOTCR_EFS_UTILS="stand-in")
    assert standin.returncode == 0, standin.stderr
    build = _build_dir_without_efs_utils(tmp_path)
    (build / "amazon-efs-utils").symlink_to(tmp_path / "out" / "amazon-efs-utils")
    # When a synth stages the agent without that flag (a plain `cdk deploy`), Then it refuses, naming the fix
    monkeypatch.delenv("SPOTCR_EFS_UTILS", raising=False)
    with pytest.raises(ArtifactMissing, match=r"stand-in of mount\.efs"):
        stage_agent_bundle(tmp_path / "deploy", ARCH, build)
    # And a test build still stages it
    monkeypatch.setenv("SPOTCR_EFS_UTILS", "stand-in")
    assert (stage_agent_bundle(tmp_path / "test", ARCH, build) / "amazon-efs-utils" / "SOURCE").is_file()


def _build_dir_without_efs_utils(tmp_path: Path) -> Path:
    """The real build dir's other parts, linked, without amazon-efs-utils."""
    build = tmp_path / "build"
    build.mkdir()
    for path in BUILD_DIR.iterdir():
        if path.name != "amazon-efs-utils":
            (build / path.name).symlink_to(path)
    return build


def test_a_tampered_artifact_is_refused(bundle, tmp_path):
    copy = shutil.copytree(bundle, tmp_path / "bundle")
    tarball = next((copy / "criu").glob("*.tar.gz"))
    with tarfile.open(tarball, "w:gz") as archive:
        archive.addfile(tarfile.TarInfo("spotcr-criu/VERSION"))
    refused = subprocess.run(
        ["bash", str(copy / "install-artifact.sh"), str(copy), str(tmp_path / "prefix")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode == 1
    assert "checksum mismatch" in refused.stderr
    assert not (tmp_path / "prefix" / "criu").exists()


class _Capture(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, dict[str, str]]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, dict(self.headers.items())))
        body = b"PK-the-asset"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_the_bootstraps_s3_fetch_is_signed_as_aws_signs(tmp_path):
    # Given an endpoint that records requests, and temporary credentials
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    environ = {
        "PATH": os.environ["PATH"],
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "ASIAEXAMPLEKEY",
        "AWS_SECRET_ACCESS_KEY": "secret/example+key",
        "AWS_SESSION_TOKEN": "session-token-example",
    }
    try:
        # When bootstrap.sh's s3_get fetches the asset
        fetched = subprocess.run(
            [
                "bash",
                "-c",
                f'source {VM / "bootstrap.sh"} && s3_get s3://assets-bucket/abc/agent.zip "$1" eu-west-1',
                "-",
                str(tmp_path / "agent.zip"),
            ],
            env=environ,
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        server.shutdown()
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "agent.zip").read_bytes() == b"PK-the-asset"
    path, headers = _Capture.seen[-1]
    lower = {k.lower(): v for k, v in headers.items()}
    # Then the request carries the session token and a SigV4 signature that botocore computes the same way
    assert lower["x-amz-security-token"] == "session-token-example"
    credential, signed, signature = (
        part.strip().split("=", 1)[1] for part in lower["authorization"].split(" ", 1)[1].split(",")
    )
    assert credential.startswith("ASIAEXAMPLEKEY/") and credential.endswith("/eu-west-1/s3/aws4_request")
    assert {"host", "x-amz-content-sha256", "x-amz-date", "x-amz-security-token"} <= set(signed.split(";"))
    request = AWSRequest(method="GET", url=endpoint + path, headers={h: lower[h] for h in signed.split(";")})
    request.context["timestamp"] = lower["x-amz-date"]
    auth = S3SigV4Auth(Credentials("ASIAEXAMPLEKEY", "secret/example+key", "session-token-example"), "s3", "eu-west-1")
    auth._modify_request_before_signing = lambda request: None
    expected = auth.signature(auth.string_to_sign(request, auth.canonical_request(request)), request)
    assert signature == expected


def test_the_bundles_python_packages_serve_every_aws_service_the_agent_calls(bundle):
    # Given the services the agent's code makes clients for, and those the artifact keeps botocore models of
    called = set()
    for source in (VM / "spotcr_agent").rglob("*.py"):
        called |= set(re.findall(r'client\(\s*"([a-z0-9-]+)"', source.read_text()))
    script = (VM / "build-artifact.sh").read_text()
    kept = set(re.search(r'AGENT_SERVICES="([^"]+)"', script).group(1).split())  # type: ignore[union-attr]
    assert called and called <= kept
    # Then Debian's python3 runs the agent's imports from the bundle alone, with zstandard's C backend
    probe = "import boto3, zstandard; [boto3.client(s, region_name='us-east-1') for s in %r]; print(zstandard.backend)"
    ran = subprocess.run(
        ["env", "-i", f"PYTHONPATH={bundle / 'python'}", "/usr/bin/python3", "-c", probe % sorted(called)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.stdout.strip() == "cext", ran.stderr
