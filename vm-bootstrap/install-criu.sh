#!/usr/bin/env bash
# Installs CRIU >= 4 for spotcr: on developer machines (make), in CI and on job VMs (bootstrap.sh).
# Debian 12's criu 3.17 fails `criu check` on recent kernels, so we build the pinned upstream
# release from the source tarball Debian ships in its package pool, with one socket fix.
# It also installs CRIU's CUDA plugin in PREFIX/lib/criu, where the agent finds it and loads it (--libdir) only
# for a job that holds a GPU: not in CRIU's compiled-in /usr/lib/criu, which every dump would load.
# Idempotent: exits at once when a working CRIU >= 4 is already on PATH and the plugin is installed.
# With SPOTCR_CRIU_BUILD_DIR set it only builds (criu and its cuda plugin) in that directory, installs
# nothing and reuses an earlier build there: build-artifact.sh packages the result for job VMs.
set -euo pipefail

CRIU_VERSION=4.1.1
CRIU_SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
PREFIX=${SPOTCR_CRIU_PREFIX:-/usr/local}
PLUGIN="$PREFIX/lib/criu/cuda_plugin.so"
BUILD_DIR=${SPOTCR_CRIU_BUILD_DIR:-}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BUILD_DEPS=(build-essential pkg-config curl ca-certificates xz-utils python3 python3-protobuf
  libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
  libnl-3-dev libnl-route-3-dev libcap-dev libnet1-dev libbsd-dev libnftables-dev
  libgnutls28-dev uuid-dev libaio-dev)
RUN_DEPS=(iproute2 iptables libprotobuf-c1 libnl-3-200 libnet1 libnftables1 libgnutls30 libbsd0 libcap2)

log() { echo "install-criu: $*" >&2; }

working_criu() {
  local bin
  bin=$(PATH="$PREFIX/sbin:$PATH" command -v criu 2>/dev/null) || return 1
  local major
  major=$("$bin" --version 2>/dev/null | sed -n 's/^Version: \([0-9]*\)\..*/\1/p')
  [[ -n "$major" && "$major" -ge 4 ]] || return 1
  "$bin" check >/dev/null 2>&1 || return 1
  echo "$bin"
}

if [[ -z "$BUILD_DIR" ]] && bin=$(working_criu) && [[ -f "$PLUGIN" ]]; then
  log "$("$bin" --version | head -1) at $bin passes 'criu check', its CUDA plugin is in $PLUGIN; nothing to do"
  exit 0
fi
if [[ -n "$BUILD_DIR" && -x "$BUILD_DIR/criu-$CRIU_VERSION/criu/criu" && -f "$BUILD_DIR/criu-$CRIU_VERSION/.spotcr-built" ]]; then
  log "reusing the build in $BUILD_DIR/criu-$CRIU_VERSION"
  exit 0
fi

[[ $(id -u) -eq 0 ]] || { log "must run as root (CRIU needs root to build-install and to run)"; exit 1; }

debian_mirror() {
  # The pool lives beside the archive the machine already uses; SPOTCR_DEBIAN_MIRROR overrides.
  if [[ -n "${SPOTCR_DEBIAN_MIRROR:-}" ]]; then echo "$SPOTCR_DEBIAN_MIRROR"; return; fi
  local uri
  uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | sed -n 's/^URIs:[[:space:]]*//p' \
    | tr ' ' '\n' | grep -v -- '-security' | grep '/debian/\?$' | head -1)
  [[ -n "$uri" ]] || uri=$(grep -hE '^deb[[:space:]]' /etc/apt/sources.list 2>/dev/null \
    | awk '{print $2}' | grep -v -- '-security' | grep '/debian/\?$' | head -1)
  [[ -n "$uri" ]] || { log "no Debian archive in apt sources; set SPOTCR_DEBIAN_MIRROR"; exit 1; }
  echo "${uri%/}"
}

export DEBIAN_FRONTEND=noninteractive
if dpkg -s "${BUILD_DEPS[@]}" "${RUN_DEPS[@]}" >/dev/null 2>&1; then
  log "build dependencies already installed"
else
  log "installing build dependencies"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${BUILD_DEPS[@]}" "${RUN_DEPS[@]}" >/dev/null
fi

if [[ -z "$BUILD_DIR" ]] && dpkg -s criu >/dev/null 2>&1; then
  log "removing the distribution's criu ($(dpkg-query -W -f='${Version}' criu)): it fails on this kernel"
  apt-get remove -y -qq criu >/dev/null
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [[ -n "$BUILD_DIR" ]]; then
  mkdir -p "$BUILD_DIR"
  rm -rf "$BUILD_DIR/criu-$CRIU_VERSION"
fi
tarball="criu_${CRIU_VERSION}.orig.tar.xz"
log "fetching $tarball"
curl -fsSL --retry 3 -o "$work/$tarball" "$(debian_mirror)/pool/main/c/criu/$tarball"
echo "$CRIU_SHA256  $work/$tarball" | sha256sum -c --quiet - \
  || { log "checksum mismatch for $tarball"; exit 1; }
src_root=${BUILD_DIR:-$work}
tar -xJf "$work/$tarball" -C "$src_root"
src="$src_root/criu-$CRIU_VERSION"
patch -d "$src" -p1 --quiet < "$HERE/criu-4.1.1-eopnotsupp-sockopt.patch"

log "building CRIU $CRIU_VERSION ($(nproc) cores)"
make -C "$src" -j"$(nproc)" criu >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; exit 1; }
if [[ -n "$BUILD_DIR" ]]; then
  # The GPU plugin needs no CUDA headers to build (it talks to the driver at run time).
  make -C "$src" -j"$(nproc)" cuda_plugin >>"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; exit 1; }
  touch "$src/.spotcr-built"
  log "built CRIU $CRIU_VERSION in $src"
  exit 0
fi
# The GPU plugin needs no CUDA headers to build (it talks to the driver at run time).
make -C "$src" -j"$(nproc)" cuda_plugin >>"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; exit 1; }
install -D -m 0644 "$src/plugins/cuda/cuda_plugin.so" "$PLUGIN"
log "installed CRIU's CUDA plugin at $PLUGIN"
if bin=$(working_criu) && "$bin" --version | grep -q "Version: $CRIU_VERSION\$"; then
  # A working CRIU of this version stays (other users may be running it); it only lacked the plugin.
  log "$("$bin" --version | head -1) at $bin already works; kept"
  exit 0
fi
install -D -m 0755 "$src/criu/criu" "$PREFIX/sbin/criu"

bin=$(working_criu) || { "$PREFIX/sbin/criu" check || true; log "built CRIU fails 'criu check'"; exit 1; }
log "installed $("$bin" --version | head -1) at $bin"
