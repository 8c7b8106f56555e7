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
install -m 0755 "$ASSET/bin/spotcr-launch" "$PREFIX/bin/spotcr-launch"

# amazon-efs-utils (MIT; make artifacts fetches the release efs-utils.lock pins: its SOURCE says which): mount.efs
# and its watchdog, which EFS through the job's own access point with IAM and TLS needs (efs_isolation; stunnel4 comes
# from Debian at boot). Plain Python 3, no build. An image that has its own mount.efs keeps it. In an asset built for
# tests (SPOTCR_EFS_UTILS=stand-in) they are spotcr's stand-in, which refuses to mount, saying why.
efs="$ASSET/amazon-efs-utils"
[[ -f "$efs/mount.efs" && -f "$efs/SOURCE" ]] || fail "the agent asset has no amazon-efs-utils/mount.efs"
mkdir -p "$PREFIX/efs-utils"
install -m 0755 "$efs/mount.efs" "$efs/amazon-efs-mount-watchdog" "$PREFIX/efs-utils/"
install -m 0644 "$efs/SOURCE" "$PREFIX/efs-utils/"
python3 "$PREFIX/efs-utils/mount.efs" --version >/dev/null || fail "the packaged mount.efs does not run"

if [[ "$SYSTEM" == "--system" ]]; then
  ln -sfn "$PREFIX/criu/bin/criu" /usr/local/sbin/criu
  if [[ ! -e /sbin/mount.efs ]]; then
    if [[ -f "$efs/efs-utils.conf" ]]; then  # the stand-in has no configuration, certificate or unit
      install -D -m 0644 "$efs/efs-utils.conf" /etc/amazon/efs/efs-utils.conf
      install -D -m 0444 "$efs/efs-utils.crt" /etc/amazon/efs/efs-utils.crt
      install -D -m 0644 "$efs/amazon-efs-mount-watchdog.service" /etc/systemd/system/amazon-efs-mount-watchdog.service
    fi
    mkdir -p /var/log/amazon/efs
    ln -sfn "$PREFIX/efs-utils/mount.efs" /sbin/mount.efs
    ln -sfn "$PREFIX/efs-utils/amazon-efs-mount-watchdog" /usr/bin/amazon-efs-mount-watchdog
    if command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]; then systemctl daemon-reload; fi
  fi
fi
echo "install-artifact: CRIU $(cat "$PREFIX/criu/VERSION") in $PREFIX/criu, $(head -1 "$efs/SOURCE") in $PREFIX/efs-utils"
