#!/usr/bin/env bash
# Fetches amazon-efs-utils (mount.efs and its watchdog: efs_isolation mounts with them) at the version of
# efs-utils.lock, checks each file it installs against the lock's sha256, and lays them out as upstream's build-deb.sh installs it, for the agent asset (make artifacts). Debian
# 12 does not package it; version 1.x is plain Python 3 (TLS through Debian's stunnel4), so one copy serves all VMs.
# Output under .build/ (or $1): amazon-efs-utils/ (mount.efs, amazon-efs-mount-watchdog, efs-utils.conf,
# efs-utils.crt, amazon-efs-mount-watchdog.service, LICENSE, and SOURCE: what it is and where it came from).
# SPOTCR_LOCK_EFS_UTILS=1 first pins the release's files in the lock (then review and commit it).
# SPOTCR_EFS_UTILS=stand-in (make test, where GitHub cannot be reached): the asset carries this project's stand-in
# of mount.efs's command line instead, which answers --version and refuses to mount. Never for a deploy.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-$(dirname "$HERE")/.build}
LOCK="$HERE/efs-utils.lock"

log() { echo "fetch-efs-utils: $*" >&2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
dir="$OUT/amazon-efs-utils"
read -r version url < <(grep -v '^#' "$LOCK" | head -1)
pins=$(grep -v '^#' "$LOCK" | tail -n +2)
# What build-deb.sh installs from the release: the two programs from src/, the configuration, certificate and unit.
FILES=(src/mount_efs/__init__.py src/watchdog/__init__.py dist/efs-utils.conf dist/efs-utils.crt
  dist/amazon-efs-mount-watchdog.service LICENSE)

if [[ "${SPOTCR_EFS_UTILS:-}" == "stand-in" ]]; then
  rm -rf "$dir.new" && mkdir -p "$dir.new"
  install -m 0755 "$HERE/mount-efs-stand-in" "$dir.new/mount.efs"
  install -m 0755 "$HERE/mount-efs-stand-in" "$dir.new/amazon-efs-mount-watchdog"
  echo "stand-in for amazon-efs-utils $version (SPOTCR_EFS_UTILS=stand-in): it mounts nothing" >"$dir.new/SOURCE"
  rm -rf "$dir" && mv "$dir.new" "$dir"
  log "$dir: the stand-in (SPOTCR_EFS_UTILS=stand-in), not amazon-efs-utils: for tests, never for a deploy"
  exit 0
fi

# A stand-in left by a test build never reaches a deploy, even one whose fetch fails below.
if [[ -f "$dir/SOURCE" ]] && grep -q '^stand-in' "$dir/SOURCE"; then rm -rf "$dir"; fi

download() {
  curl -fsSL --retry 3 -o "$2" "$1" \
    || { log "cannot download amazon-efs-utils $version from $1: a deploy needs it (efs_isolation mounts with it)"; return 1; }
}

fetch_release() { # $1: the directory to unpack the release into
  mkdir -p "$1"
  download "$url" "$1.tar.gz"
  tar -xzf "$1.tar.gz" -C "$1" --strip-components=1
  rm -f "$1.tar.gz"
}

if [[ "${SPOTCR_LOCK_EFS_UTILS:-}" == "1" ]]; then
  tmp=$(mktemp -d)
  fetch_release "$tmp/release"
  pins=$(cd "$tmp/release" && sha256sum "${FILES[@]}")
  rm -rf "$tmp"
  { grep '^#' "$LOCK" || true; echo "$version $url"; echo "$pins"; } >"$LOCK.new" && mv "$LOCK.new" "$LOCK"
  log "pinned the files of amazon-efs-utils $version in $LOCK"
fi
pinned_files=$(grep -E '^[0-9a-f]{64}  ' <<<"$pins" | cut -c67- || true)
[[ "$pinned_files" == "$(printf '%s\n' "${FILES[@]}")" ]] \
  || { log "$LOCK pins no sha256 for the ${#FILES[@]} files of amazon-efs-utils $version: run SPOTCR_LOCK_EFS_UTILS=1 make artifacts once on a machine that reaches GitHub, then review and commit the lock"; exit 1; }

source_line="amazon-efs-utils $version from $url, files pinned $(sha256sum <<<"$pins" | cut -c1-16)"
if [[ -f "$dir/SOURCE" && "$(head -1 "$dir/SOURCE")" == "$source_line" ]]; then
  log "amazon-efs-utils $version is up to date"
  exit 0
fi
rm -rf "$dir.new" && mkdir -p "$dir.new"
release="$dir.new/release"
fetch_release "$release"
(cd "$release" && sha256sum -c --quiet --strict) <<<"$pins" \
  || { log "sha256 mismatch in $url: not the amazon-efs-utils $version that $LOCK pins"; exit 1; }
install -m 0755 "$release/src/mount_efs/__init__.py" "$dir.new/mount.efs"
install -m 0755 "$release/src/watchdog/__init__.py" "$dir.new/amazon-efs-mount-watchdog"
install -m 0644 "$release/dist/efs-utils.conf" "$release/dist/efs-utils.crt" \
  "$release/dist/amazon-efs-mount-watchdog.service" "$release/LICENSE" "$dir.new/"
echo "$source_line" >"$dir.new/SOURCE"
rm -rf "$release"
python3 "$dir.new/mount.efs" --version | grep -q "Version: $version" \
  || { log "the fetched mount.efs does not say version $version"; exit 1; }
rm -rf "$dir" && mv "$dir.new" "$dir"
log "$dir (amazon-efs-utils $version, every file checked against its sha256)"
