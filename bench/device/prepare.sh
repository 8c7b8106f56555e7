#!/usr/bin/env bash
# Fills bench/device/carry/ (git-ignored) with what run.sh needs on a GPU machine that has no network and no apt:
#   criu.tar.gz  the VM artifact's CRIU (bin/criu with its Debian 12 libraries in lib/, lib/criu/cuda_plugin.so)
#   tools/   Debian 12's `ip` and `iptables` with their libraries, for a machine that lacks them (bare local VMs)
#   wheels/  CPython 3.12 wheels of bench/device/packages.txt at their requirements/dev.lock versions
# Run it on the Debian 12 development machine after `make artifacts`; then carry bench/device/carry.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CARRY="$HERE/carry"
LIMIT_MIB=48 # the device tool carries 64 MiB in all, the checkout included
SYSTEM_LIBS='^(libc|libm|libdl|libpthread|librt|libresolv|ld-linux[^.]*)\.so'
PIP=${PIP:-$REPO/.venv/bin/pip}

log() { echo "prepare: $*" >&2; }

criu_version=$(sed -n 's/^CRIU_VERSION=//p' "$REPO/vm-bootstrap/install-criu.sh")
tarball="$REPO/.build/spotcr-criu-$criu_version-amd64.tar.gz"
[[ -f "$tarball" ]] || { log "$tarball is missing: run \`make artifacts\` first"; exit 1; }

rm -rf "$CARRY"
mkdir -p "$CARRY/tools/bin" "$CARRY/tools/libexec" "$CARRY/tools/lib" "$CARRY/wheels"
cp "$tarball" "$CARRY/criu.tar.gz" # packed: 6 MiB, not 15

# Each tool's real binary in libexec/ finds its libraries in ../lib (DT_RPATH); bin/ holds the wrappers run.sh
# links into /usr/local/sbin where the machine lacks the tool.
carry_binary() {
  local binary=$1 lib
  install -m 0755 "$binary" "$CARRY/tools/libexec/"
  patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "$CARRY/tools/libexec/$(basename "$binary")"
  while read -r lib; do
    [[ $(basename "$lib") =~ $SYSTEM_LIBS ]] || cp -L "$lib" "$CARRY/tools/lib/"
  done < <(ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// {print $3}')
}
carry_binary "$(command -v ip)"
carry_binary /usr/sbin/xtables-nft-multi
mkdir "$CARRY/tools/xtables" # the extensions of the one rule a VM adds (rehearsal/vm.py: a DNAT of tcp port 80)
cp -L /usr/lib/x86_64-linux-gnu/xtables/{libxt_standard,libxt_tcp,libxt_DNAT}.so "$CARRY/tools/xtables/"
cat >"$CARRY/tools/bin/ip" <<'SH'
#!/bin/sh
exec "$(dirname "$(readlink -f "$0")")/../libexec/ip" "$@"
SH
cat >"$CARRY/tools/bin/iptables" <<'SH'
#!/bin/sh
tools=$(dirname "$(readlink -f "$0")")/..
XTABLES_LIBDIR="$tools/xtables" exec "$tools/libexec/xtables-nft-multi" iptables "$@"
SH
chmod 0755 "$CARRY/tools/bin/"*
env -i "$CARRY/tools/bin/iptables" --version >/dev/null || { log "the carried iptables does not run"; exit 1; }
env -i "$CARRY/tools/bin/ip" -V >/dev/null || { log "the carried ip does not run"; exit 1; }

specs=()
while read -r name; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  spec=$(grep -i "^$name==" "$REPO/requirements/dev.lock" | cut -d' ' -f1)
  [[ -n "$spec" ]] || { log "$name is not in requirements/dev.lock"; exit 1; }
  specs+=("$spec")
done <"$HERE/packages.txt"
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$CARRY/wheels" "${specs[@]}"

size=$(du -sm "$CARRY" | cut -f1)
log "bench/device/carry: ${size} MiB (${#specs[@]} wheels, CRIU $criu_version with its CUDA plugin, ip, iptables)"
((size <= LIMIT_MIB)) || { log "more than $LIMIT_MIB MiB: the device tool would refuse the call"; exit 1; }
