#!/usr/bin/env bash
# Fetches the Debian 12 packages a job VM installs at boot instead of using apt (iptables; nfs-common, and stunnel4
# for mount.efs's TLS tunnel), at the versions and sha256 of debian-packages-<arch>.lock, so that no VM, a backup in
# the middle of a recovery least of all, needs the Debian mirror (make artifacts). For the machine's architecture.
# Output under .build/ (or $1): debian-packages-<arch>/ (<package>.deb files and packages.lock, the lock they match).
# SPOTCR_LOCK_DEBIAN_PACKAGES=1 first rewrites the lock from the machine's apt sources (then review and commit it).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-$(dirname "$HERE")/.build}
ARCH=$(dpkg --print-architecture)
# What a VM may lack and installs from the asset. What it surely has, Debian's required packages and what an image
# must have for spotcr (systemd, python3, curl, dpkg: README), the lock leaves out.
VM_PACKAGES="iptables nfs-common stunnel4"
IMAGE_PACKAGES="systemd python3 curl dpkg"
DEBIAN_LOCK="$HERE/debian-packages-$ARCH.lock"

log() { echo "fetch-debian-packages: $*" >&2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# One package from the machine's apt sources (their signed Release files vouch for it), into the current directory.
apt_download() { apt-get download -q -o APT::Sandbox::User=root "$1" >/dev/null; }

# The packages apt would install for `$*` on an empty system, as "name version" lines.
simulated_install() {
  local empty
  empty=$(mktemp -d)
  : >"$empty/status"
  apt-get install -s --no-install-recommends -o Dir::State::status="$empty/status" "$@" 2>/dev/null \
    | sed -n 's/^Inst \([^ ]*\) (\([^ ]*\) .*/\1 \2/p' | sort -u
  rm -rf "$empty"
}

if [[ "${SPOTCR_LOCK_DEBIAN_PACKAGES:-}" == "1" ]]; then
  required=$(apt-cache dumpavail | awk '/^Package:/ {p = $2} /^Priority: required/ {print p}' | sort -u)
  # shellcheck disable=SC2086
  base=$(simulated_install $IMAGE_PACKAGES $required | cut -d' ' -f1)
  lock_dir=$(mktemp -d)
  {
    echo "# for package version sha256: the Debian 12 ($ARCH) packages a VM installs for each of: $VM_PACKAGES"
    for wanted in $VM_PACKAGES; do
      # shellcheck disable=SC2086
      simulated_install $IMAGE_PACKAGES $required "$wanted" | join -v1 - <(echo "$base") | while read -r name version; do
        [[ -f "$lock_dir/$name.deb" ]] || (cd "$lock_dir" && apt_download "$name=$version" && mv "${name}"_*.deb "$name.deb")
        echo "$wanted $name $version $(sha256sum "$lock_dir/$name.deb" | cut -d' ' -f1)"
      done
    done
  } >"$DEBIAN_LOCK.new"
  rm -rf "$lock_dir"
  mv "$DEBIAN_LOCK.new" "$DEBIAN_LOCK"
  log "wrote $DEBIAN_LOCK"
fi

debs_dir="$OUT/debian-packages-$ARCH"
[[ -f "$DEBIAN_LOCK" ]] || { log "no $DEBIAN_LOCK: run with SPOTCR_LOCK_DEBIAN_PACKAGES=1 on Debian 12 $ARCH"; exit 1; }
if [[ -d "$debs_dir" ]] && cmp -s "$DEBIAN_LOCK" "$debs_dir/packages.lock"; then
  log "debian-packages-$ARCH is up to date"
else
  rm -rf "$debs_dir.new"
  mkdir -p "$debs_dir.new"
  grep -v '^#' "$DEBIAN_LOCK" | while read -r _ name version sha256; do
    [[ -f "$debs_dir.new/$name.deb" ]] && continue  # needed by two of VM_PACKAGES
    (cd "$debs_dir.new" && apt_download "$name=$version" && mv "${name}"_*.deb "$name.deb") \
      || { log "cannot download $name=$version (Debian replaced it? update the lock)"; exit 1; }
    echo "$sha256  $name.deb" | (cd "$debs_dir.new" && sha256sum -c --quiet) \
      || { log "sha256 mismatch for $name=$version"; exit 1; }
  done
  cp "$DEBIAN_LOCK" "$debs_dir.new/packages.lock"
  rm -rf "$debs_dir" && mv "$debs_dir.new" "$debs_dir"
  log "$debs_dir ($(du -sh "$debs_dir" | cut -f1))"
fi
