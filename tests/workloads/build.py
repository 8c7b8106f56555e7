"""Compiling the suite's Go, C and Java programs once into .build/workloads/<digest>/, reused while nothing changed."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

PROGRAMS = Path(__file__).parent / "programs"
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".build" / "workloads"
BUILD_PATH = "/usr/local/go/bin:/usr/local/bin:/usr/bin:/bin"  # Go's own tarball installs in /usr/local/go

# name: (source, the command that builds it into OUT, the tool whose version is part of the cache key)
BUILDS = {
    "java": ("Work.java", ["javac", "-d", "{out}", "{src}"], ["javac", "-version"]),
    "goroutines": ("goroutines.go", ["go", "build", "-o", "{out}", "{src}"], ["go", "version"]),
    "openmp": ("openmp.c", ["gcc", "-O2", "-fopenmp", "-o", "{out}", "{src}"], ["gcc", "--version"]),
    "io_uring": ("io_uring.c", ["gcc", "-O2", "-o", "{out}", "{src}"], ["gcc", "--version"]),
    "mpi": ("mpi.c", ["mpicc", "-O2", "-o", "{out}", "{src}"], ["mpicc", "--version"]),
    "mpi-openmpi": ("mpi.c", ["mpicc.openmpi", "-O2", "-o", "{out}", "{src}"], ["mpicc.openmpi", "--version"]),
}


def _tool_version(argv: list[str]) -> str:
    tool = shutil.which(argv[0], path=BUILD_PATH)
    assert tool, f"{argv[0]} is not installed: `make test` installs it (make workload-deps)"
    result = subprocess.run([tool, *argv[1:]], capture_output=True, text=True, check=True)
    return result.stdout + result.stderr


def build_all() -> Path:
    """The directory holding every built program (java/, goroutines, openmp, mpi, mpi-openmpi); builds what is
    missing."""
    digest = hashlib.sha256()
    for name, (source, _, version) in sorted(BUILDS.items()):
        digest.update(name.encode() + (PROGRAMS / source).read_bytes() + _tool_version(version).encode())
    out_dir = CACHE / digest.hexdigest()[:16]
    if (out_dir / ".complete").exists():
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)
    (out_dir / "gocache").mkdir(parents=True)
    env = {"PATH": BUILD_PATH, "HOME": str(out_dir), "LANG": "C.UTF-8"}
    env |= {"GOCACHE": str(out_dir / "gocache"), "GOPATH": str(out_dir / "gopath"), "GO111MODULE": "off"}
    for name, (source, command, _) in BUILDS.items():
        argv = [arg.format(out=out_dir / name, src=PROGRAMS / source) for arg in command]
        result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=out_dir, check=False)
        assert result.returncode == 0, f"building {source} failed: {' '.join(argv)}\n{result.stdout}{result.stderr}"
    shutil.rmtree(out_dir / "gocache", ignore_errors=True)
    (out_dir / ".complete").touch()
    return out_dir
