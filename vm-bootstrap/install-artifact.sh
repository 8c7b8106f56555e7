#!/usr/bin/env bash
# Installs the agent asset's prebuilt parts on a job VM: CRIU from its tarball (checksum verified) into
# PREFIX/criu, and the agent's launcher. No compiler, no pip, no apt: CRIU carries the Debian 12 libraries it
# links against and the asset carries the agent's Python packages (python/). Run by bootstrap.sh, and by the
# rehearsal's local VMs on their private /opt/spotcr.
# CRIU's CUDA plugin stays in PREFIX/criu/lib/criu, beside the binary, where the agent finds it and loads it (--libdir)
# only for a job that holds a GPU; CRIU's compiled-in plugin dir (/usr/lib/criu) would load it for every dump.
# Usage: install-artifact.sh ASSET_DIR PREFIX [--system]   (--system: also /usr/local/sbin/criu)
set -euo pipefail

ASSET=${1:?usage: install-artifact.sh ASSET_DIR PREFIX [--system]}
PREFIX=${2:?usage: install-artifact.sh ASSET_DIR PREFIX [--system]}
SYSTEM=${3:-}
ARCH=$(dpkg --print-architecture 2>/dev/null || uname -m | sed 's/x86_64/amd64/; s/aarch64/arm64/')

fail() { echo "install-artifact: $*" >&2; exit 1; }

shopt -s nullglob
tarballs=("$ASSET"/criu/spotcr-criu-*-"$ARCH".tar.gz)
[[ ${#tarballs[@]} -eq 1 ]] || fail "the agent asset has no CRIU artifact for $ARCH (build it with 'make artifacts' on $ARCH)"
tarball=${tarballs[0]}
(cd "$(dirname "$tarball")" && sha256sum -c --quiet "$(basename "$tarball").sha256") \
  || fail "checksum mismatch for $(basename "$tarball")"
[[ -d "$ASSET/python/boto3" ]] || fail "the agent asset has no python/ packages"

rm -rf "$PREFIX/criu.new"
mkdir -p "$PREFIX/criu.new" "$PREFIX/bin"
tar -xzf "$tarball" -C "$PREFIX/criu.new" --strip-components=1
"$PREFIX/criu.new/bin/criu" --version >/dev/null || fail "the packaged criu does not run on this system"
rm -rf "$PREFIX/criu"
mv "$PREFIX/criu.new" "$PREFIX/criu"
install -m 0755 "$ASSET/bin/spotcr-agent" "$PREFIX/bin/spotcr-agent"

if [[ "$SYSTEM" == "--system" ]]; then
  ln -sfn "$PREFIX/criu/bin/criu" /usr/local/sbin/criu
fi
echo "install-artifact: CRIU $(cat "$PREFIX/criu/VERSION") in $PREFIX/criu"
