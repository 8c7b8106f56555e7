#!/bin/bash
# What the tracked-memory test VM (tests/tracked) needs: QEMU, a static busybox and cpio for its initramfs, kmod;
# and Debian 12's own kernel (CONFIG_MEM_SOFT_DIRTY=y), downloaded as the package linux-image-amd64 depends on
# from the Debian mirror in apt's sources, extracted (never installed) into a cache. `make test` runs this;
# a second run downloads and installs nothing. SPOTCR_KERNEL_CACHE overrides the cache directory.
set -euo pipefail
CACHE=${SPOTCR_KERNEL_CACHE:-${HOME:-/root}/.cache/spotcr/debian-kernel}
log() { echo "tracked-vm: $*" >&2; }
export DEBIAN_FRONTEND=noninteractive
updated=
update() { [ -n "$updated" ] || { apt-get update -qq; updated=1; }; }

missing=()
for p in qemu-system-x86 busybox-static cpio kmod; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  update
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The kernel: linux-image-amd64 is Debian's metapackage; the image it depends on is the kernel itself.
image_package() { apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1; }
if [ -f "$CACHE/current" ] && [ -f "$CACHE/$(cat "$CACHE/current")/vmlinux" ]; then
  exit 0
fi
package=$(image_package)
[ -n "$package" ] || { update; package=$(image_package); }
[ -n "$package" ] || { log "apt knows no linux-image-amd64 (no Debian archive in apt sources?)"; exit 1; }
version=${package#linux-image-}
dir=$CACHE/$version
log "fetching $package from the Debian mirror"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && { apt-get download -q "$package" >/dev/null 2>&1 || { update; apt-get download -q "$package" >/dev/null; }; })
rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
dpkg -x "$work"/"$package"_*.deb "$dir.tmp/root"
grep -q '^CONFIG_MEM_SOFT_DIRTY=y' "$dir.tmp/root/boot/config-$version" \
  || { log "$package lacks CONFIG_MEM_SOFT_DIRTY"; exit 1; }
depmod -b "$dir.tmp/root" "$version"
# The uncompressed ELF vmlinux boots directly (PVH), which skips the decompressor: seconds under emulation.
python3 - "$dir.tmp/root/boot/vmlinuz-$version" "$dir.tmp/vmlinux" <<'PY'
import lzma, sys
data = open(sys.argv[1], "rb").read()
start = data.find(b"\xfd7zXZ\x00")
if start < 0:
    sys.exit("no xz payload in " + sys.argv[1])
open(sys.argv[2], "wb").write(lzma.LZMADecompressor().decompress(data[start:]))
PY
echo "$version" >"$dir.tmp/version"
rm -rf "$dir" && mv "$dir.tmp" "$dir"
echo "$version" >"$CACHE/current"
log "Debian kernel $version in $dir"
