#!/usr/bin/env bash
# Builds what a job VM installs instead of compiling (make artifacts): CRIU with its plugin and the Debian 12
# libraries it links against, as one tarball with its sha256, and the agent's Python packages for Debian 12's
# python3 (3.11) and Ubuntu 24.04's (3.12: the GPU image). For the machine's own architecture: amd64 here; for
# arm64 run the same on an arm64 Debian 12 with SPOTCR_VM_ARCHITECTURE=arm64.
# Output under .build/ (or $1): spotcr-criu-<version>-<arch>.tar.gz{,.sha256} and agent-python-<arch>/.
# `build-artifact.sh --check-host` only checks that this machine may build it (check_build_host).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-$(dirname "$HERE")/.build}
PYTHON=${PYTHON:-python3}
ARCH=$(dpkg --print-architecture)
CRIU_VERSION=$(sed -n 's/^CRIU_VERSION=//p' "$HERE/install-criu.sh")
NAME="spotcr-criu-$CRIU_VERSION-$ARCH"
# Libraries every Debian 12 system has (glibc's own): the VM's are used, never a copy.
EXTRA_PYTHONS="3.12"  # besides Debian 12's 3.11: the GPU image's Ubuntu 24.04
AGENT_SERVICES="s3 ssm events sts"  # the AWS services the agent calls (sts: credential chains)
SYSTEM_LIBS='^(libc|libm|libdl|libpthread|librt|libresolv|ld-linux[^.]*)\.so'

log() { echo "build-artifact: $*" >&2; }
# CRIU and the agent's Python parts link against this machine's glibc and libraries: only a Debian 12 machine of
# the VMs' architecture (SPOTCR_VM_ARCHITECTURE, the stack's vm_architecture: amd64 by default) builds them.
check_build_host() {
  local os_release=${SPOTCR_OS_RELEASE:-/etc/os-release} target=${SPOTCR_VM_ARCHITECTURE:-amd64} found
  [[ -r "$os_release" ]] || { log "cannot read $os_release: build on Debian 12 ($target)"; return 1; }
  found=$(. "$os_release" && echo "${ID:-?} ${VERSION_ID:-?} ${PRETTY_NAME:-}")
  if [[ "$found" != "debian 12 "* ]]; then
    log "this machine runs ${found#* * } (ID=${found%% *}); the artifact must be built on Debian 12 (bookworm)," \
      "the job VMs' system, or CRIU and the agent's parts may need a newer glibc than the VMs have"
    return 1
  fi
  if [[ "$ARCH" != "$target" ]]; then
    log "this machine is $ARCH, the job VMs are $target: build on a Debian 12 $target machine" \
      "(or set SPOTCR_VM_ARCHITECTURE=$ARCH and deploy with -c vm_architecture=$ARCH)"
    return 1
  fi
}
check_build_host
[[ "${1:-}" == "--check-host" ]] && exit 0
# The Debian package (and version) a library comes from, for the record: merged /usr means either path.
debian_package() {
  local real candidate owner
  real=$(realpath "$1")
  for candidate in "$1" "$real" "/usr${real#/usr}" "${real#/usr}"; do
    owner=$(dpkg -S "$candidate" 2>/dev/null | head -1 | cut -d: -f1) && [[ -n "$owner" ]] && break
  done
  [[ -n "$owner" ]] && dpkg-query -W -f='${binary:Package} ${Version}\n' "$owner"
  return 0
}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

tarball="$OUT/$NAME.tar.gz"
if [[ -f "$tarball" && -f "$tarball.sha256" && "$tarball" -nt "$HERE/install-criu.sh" && "$tarball" -nt "$0" ]]; then
  log "$NAME.tar.gz is up to date"
else
  command -v patchelf >/dev/null || { apt-get update -qq && apt-get install -y -qq patchelf >/dev/null; }
  SPOTCR_CRIU_BUILD_DIR="$OUT/criu-build" bash "$HERE/install-criu.sh"
  src="$OUT/criu-build/criu-$CRIU_VERSION"
  stage="$OUT/stage/$NAME"
  rm -rf "$OUT/stage"
  mkdir -p "$stage/bin" "$stage/lib/criu"
  install -m 0755 "$src/criu/criu" "$stage/bin/criu"
  install -m 0644 "$src/plugins/cuda/cuda_plugin.so" "$stage/lib/criu/"
  : >"$stage/DEBIAN-PACKAGES"
  while read -r lib; do
    [[ $(basename "$lib") =~ $SYSTEM_LIBS ]] && continue
    cp -L "$lib" "$stage/lib/"
    debian_package "$lib" >>"$stage/DEBIAN-PACKAGES"
  done < <(ldd "$src/criu/criu" | awk '$2 == "=>" && $3 ~ /^\// {print $3}')
  sort -u -o "$stage/DEBIAN-PACKAGES" "$stage/DEBIAN-PACKAGES"
  # DT_RPATH (not RUNPATH) so the libraries' own dependencies are found beside them too; nothing in the
  # environment changes, so the processes CRIU starts (action scripts, iptables) see the VM's own libraries.
  patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "$stage/bin/criu"
  echo "$CRIU_VERSION" >"$stage/VERSION"
  env -i "$stage/bin/criu" --version | grep -q "Version: $CRIU_VERSION" \
    || { log "the packaged criu does not run"; exit 1; }
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$OUT/stage" -cf - "$NAME" \
    | gzip -n -6 >"$tarball.tmp"
  mv "$tarball.tmp" "$tarball"
  (cd "$OUT" && sha256sum "$NAME.tar.gz" >"$NAME.tar.gz.sha256")
  rm -rf "$OUT/stage"
  log "$tarball ($(du -h "$tarball" | cut -f1)), sha256 $(cut -d' ' -f1 "$tarball.sha256")"
fi

python_dir="$OUT/agent-python-$ARCH"
if [[ -d "$python_dir" && "$python_dir" -nt "$HERE/requirements.txt" && "$python_dir" -nt "$0" ]]; then
  log "agent-python-$ARCH is up to date"
else
  rm -rf "$python_dir.new"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform "manylinux2014_$(uname -m)" --python-version 3.11 --implementation cp \
    --target "$python_dir.new" -r "$HERE/requirements.txt"
  # Only what the agent uses: botocore's models of the services it calls (a test checks the agent's clients
  # against AGENT_SERVICES), zstandard's C backend. 59 MB becomes about 12, which every VM downloads and unpacks.
  for dir in "$python_dir.new"/botocore/data/*/; do
    [[ " $AGENT_SERVICES " == *" $(basename "$dir") "* ]] || rm -rf "$dir"
  done
  rm -f "$python_dir.new"/zstandard/_cffi.*.so "$python_dir.new"/zstandard/backend_cffi.py
  # The GPU image (Ubuntu 24.04) runs python3.12: zstandard's, xxhash's and blake3's compiled modules for it too,
  # beside 3.11's (the names differ).
  for version in $EXTRA_PYTHONS; do
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --platform "manylinux2014_$(uname -m)" --python-version "$version" --implementation cp \
      --target "$python_dir.new/.cp$version" $(grep -E '^(zstandard|xxhash|blake3)==' "$HERE/requirements.txt")
    cp "$python_dir.new/.cp$version"/zstandard/backend_c.cpython-*.so "$python_dir.new/zstandard/"
    cp "$python_dir.new/.cp$version"/xxhash/_xxhash.cpython-*.so "$python_dir.new/xxhash/"
    cp "$python_dir.new/.cp$version"/blake3/blake3.cpython-*.so "$python_dir.new/blake3/"
    rm -rf "$python_dir.new/.cp$version"
  done
  # zstandard's debug symbols are 10 of its 11 MB
  strip --strip-unneeded "$python_dir.new"/zstandard/*.so "$python_dir.new"/xxhash/*.so "$python_dir.new"/blake3/*.so
  rm -rf "$python_dir" && mv "$python_dir.new" "$python_dir"
  log "$python_dir ($(du -sh "$python_dir" | cut -f1))"
fi
