#!/usr/bin/env bash
# One run on a lent GPU machine (one NVIDIA H100 or H200, 16 cores, Ubuntu 24.04, no network, no apt): the GPU
# checks and the 16-core pipeline, each step under its own timeout, all of it within SPOTCR_DEVICE_BUDGET_S
# (540 s). Every step logs to a file of its own; what comes back in $OUT (the device tool returns 8 files at most):
#   summary.txt   the machine's facts and each step's exit code and seconds
#   run.tar.gz    logs/ (every step's log, the VMs' consoles, CRIU's logs) and results/ (the new bench/results files)
#   *.md, *.json  the new bench/results files, also loose, to read at once
# Before: `bash bench/device/prepare.sh` on the Debian 12 development machine, then the device tool's `run` with
# carry ["bench/device/carry"] and the command `bash bench/device/run.sh`. Docs: docs/gpu.md.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CARRY=${SPOTCR_DEVICE_CARRY:-$HERE/carry}
BUDGET_S=${SPOTCR_DEVICE_BUDGET_S:-540}
GPU_MIB=${SPOTCR_DEVICE_GPU_MIB:-1024 16384} # bench gpu's sizes: small, and the largest that fits about 2 minutes
# Not under /tmp: every bare VM mounts an empty tmpfs there, so its files would vanish inside the VMs.
WORK=${SPOTCR_DEVICE_WORK:-/root/spotcr-device}
LOGS=$WORK/logs
RESULTS=$WORK/results
OUT=${OUT:?"OUT names the folder that comes back (the device tool sets it)"}
# The host's /usr/local: every VM sees it (unlike /opt/spotcr, which each VM has its own of) and has sbin on PATH.
CRIU_DIR=${SPOTCR_DEVICE_CRIU_DIR:-/usr/local/lib/spotcr-criu}
SBIN=${SPOTCR_DEVICE_SBIN:-/usr/local/sbin}
PYTHON=${SPOTCR_DEVICE_PYTHON:-/opt/torch/.venv/bin/python3} # Python 3.12 with PyTorch
START=$SECONDS
RESERVE_S=20 # kept back for packing the logs
NEW_RESULTS="gpu.json gpu.md gpu_test.json gpu-host-check.json pipeline-16core-16gib.json pipeline-16core-16gib.md
pipeline-16core-4gib.json pipeline-16core-4gib.md"

export PATH=$SBIN:/usr/local/sbin:/usr/local/bin:$PATH PYTHONUNBUFFERED=1 SPOTCR_EFS_UTILS=stand-in
export CARRY WORK CRIU_DIR SBIN PYTHON # for the steps that are functions of this script

case "$REPO/" in
  /tmp/* | /var/tmp/* | /dev/shm/*)
    # A checkout there vanishes inside the VMs (Makefile: where): run from a copy.
    rm -rf "$WORK/repo" && mkdir -p "$WORK" && cp -a "$REPO" "$WORK/repo" || exit 2
    echo "run.sh: the checkout $REPO is under a VM's own tmpfs; running from the copy $WORK/repo"
    SPOTCR_DEVICE_CARRY="$WORK/repo/bench/device/carry" exec bash "$WORK/repo/bench/device/run.sh"
    ;;
esac
cd "$REPO" || exit 2
export PYTHONPATH=$REPO/functions:$REPO/vm-bootstrap:$REPO/cli:$REPO
rm -rf "$LOGS" "$RESULTS" && mkdir -p "$LOGS" "$RESULTS"
SUMMARY=$LOGS/summary.txt
: >"$SUMMARY"

say() { echo "$*" | tee -a "$SUMMARY"; }

gpu_pids() { nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | sort -u; }
GPU_PIDS_BEFORE=$(gpu_pids)

# A step stopped by its timeout can leave a CUDA job running (the agent starts jobs in a session of their own),
# holding device memory that the next step needs: end the CUDA processes that were not there before this run.
free_gpu() {
  local pid
  for pid in $(comm -13 <(echo "$GPU_PIDS_BEFORE") <(gpu_pids)); do
    say "  ending CUDA process $pid left by the step: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-200)"
    kill -KILL "$pid" 2>/dev/null
  done
}

# step NAME SECONDS COMMAND...: runs COMMAND (or a function of this script) under `timeout`, within what is left
# of the budget; logs to NAME.log.
step() {
  local name=$1 limit=$2 left rc started note=""
  shift 2
  left=$((BUDGET_S - RESERVE_S - (SECONDS - START)))
  ((left < limit)) && limit=$left
  if ((limit < 15)); then
    say "$(printf '%-22s skipped: %d s of the budget left' "$name" "$left")"
    return 99
  fi
  echo "== $name, at most $limit s: $*" >>"$LOGS/$name.log"
  declare -F "$1" >/dev/null && set -- bash -c "$(declare -f "$1"); $1"
  started=$SECONDS
  timeout -k 10 "$limit" "$@" >>"$LOGS/$name.log" 2>&1
  rc=$?
  ((rc == 124 || rc == 137)) && note=" (stopped by its $limit s timeout)"
  say "$(printf '%-22s exit %3d in %4d s%s' "$name" "$rc" $((SECONDS - started)) "$note")"
  free_gpu
  return "$rc"
}

facts() {
  set -x
  date -u
  nvidia-smi
  nvidia-smi --query-gpu=name,memory.total,driver_version,mig.mode.current --format=csv
  cat /proc/driver/nvidia/version
  nproc
  free -g
  uname -a
  cat /etc/os-release
  df -h / /var/tmp /dev/shm /tmp
  command -v ip iptables unshare nsenter mount setsid nvcc
  echo "PATH=$PATH LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  ldconfig -p | grep -E 'libcuda\.so|libnvidia-ml'
  ls -l /dev/nvidia* /dev/nvidia-caps
  cat /proc/driver/nvidia-caps/mig-minors | head -4
  "$PYTHON" -c 'import sys, torch; print(sys.version, torch.__version__, torch.cuda.is_available())'
  criu --version
  criu check
  criu check --feature uffd-noncoop
  ls -l "$CRIU_DIR/lib/criu"
}

# CRIU from the VM artifact (its rpath finds the Debian libraries beside it), on the PATH every VM has; `ip` and
# `iptables` from the carry only where the machine lacks them (bare local VMs need both).
install() {
  set -ex
  rm -rf "$CRIU_DIR" && mkdir -p "$CRIU_DIR"
  tar -xzf "$CARRY/criu.tar.gz" -C "$CRIU_DIR" --strip-components=1
  mkdir -p "$SBIN"
  ln -sfn "$CRIU_DIR/bin/criu" "$SBIN/criu"
  for tool in ip iptables; do
    command -v "$tool" || ln -sfn "$CARRY/tools/bin/$tool" "$SBIN/$tool"
  done
  # The VMs and the agent's jobs get a fixed environment, as on a job VM: the driver's library and nvidia-smi must
  # be where a GPU AMI has them (the loader's cache, the standard PATH), not only on this shell's variables.
  local dir vm_path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  if ! ldconfig -p | grep -q 'libcuda\.so\.1 '; then
    for dir in ${LD_LIBRARY_PATH//:/ } /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
      if [[ -e "$dir/libcuda.so.1" ]]; then echo "$dir" >>/etc/ld.so.conf.d/spotcr-nvidia.conf; fi
    done
    if [[ -f /etc/ld.so.conf.d/spotcr-nvidia.conf ]]; then ldconfig; fi
  fi
  ldconfig -p | grep 'libcuda\.so\.1 ' || echo "libcuda.so.1 is not in the loader's cache: CUDA jobs may fail"
  if ! PATH=$vm_path command -v nvidia-smi && command -v nvidia-smi; then
    ln -sfn "$(command -v nvidia-smi)" /usr/local/bin/nvidia-smi
  fi
  rm -rf "$WORK/venv"
  # Ubuntu's python may lack ensurepip, and pip is not needed: a wheel installs by unpacking.
  "$PYTHON" -m venv --without-pip "$WORK/venv"
  local site
  site=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  "$WORK/venv/bin/python" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
    "$site" "$CARRY"/wheels/*.whl
  "$WORK/venv/bin/python" -c 'import boto3, moto.server, pytest, zstandard'
}

pack() {
  local name
  for name in $NEW_RESULTS; do
    [[ -f "bench/results/$name" ]] && cp "bench/results/$name" "$RESULTS/"
  done
  # The VMs' consoles and CRIU's logs of the GPU test, for a failure's diagnosis.
  find "$WORK/pytest-gpu" \( -name console.log -o -name '*.log' \) -size -4M 2>/dev/null \
    | tar -cf - -T - 2>/dev/null | tar -xf - -C "$LOGS" 2>/dev/null
  tar -czf "$OUT/run.tar.gz" -C "$WORK" logs results
  cp "$SUMMARY" "$OUT/summary.txt"
  for name in gpu.md gpu_test.json gpu-host-check.json pipeline-16core-16gib.md pipeline-16core-4gib.md; do
    [[ -f "$RESULTS/$name" ]] && cp "$RESULTS/$name" "$OUT/"
  done
  echo "== summary"
  cat "$SUMMARY"
}
trap pack EXIT

rm -f $(printf 'bench/results/%s ' $NEW_RESULTS)
say "spotcr device run at $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), budget $BUDGET_S s"
step install 90 install || { say "install failed: see logs/install.log"; tail -20 "$LOGS/install.log"; exit 2; }
step facts 60 facts
say "machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1);" \
  "$(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB, Linux $(uname -r), $(criu --version | head -1)"
PY=$WORK/venv/bin/python

step test-gpu 240 "$PY" -m pytest -p no:cacheprovider -m gpu -v --basetemp="$WORK/pytest-gpu" tests/agent/test_gpu_criu.py
tested=$?
if ((tested != 0 && tested != 99)); then
  say "test-gpu failed: the same check on this host, without bare local VMs (bench/device/host_check.py)"
  step host-check 150 "$PY" bench/device/host_check.py --mib 1024
fi
# shellcheck disable=SC2086 # GPU_MIB is a list of sizes
step bench-gpu 200 "$PY" -m bench gpu --mib $GPU_MIB
step pipeline-16gib 150 "$PY" -m bench pipeline --sizes 16 --cores 16 --stores dir --dirty 0.05 \
  --name pipeline-16core-16gib
step pipeline-4gib 150 "$PY" -m bench pipeline --sizes 4 --cores 2 4 8 16 --stores dir --dirty 0.05 \
  --name pipeline-16core-4gib
for name in test-gpu host-check bench-gpu pipeline-16gib pipeline-4gib; do
  [[ -f "$LOGS/$name.log" ]] || continue
  echo "== the end of logs/$name.log"
  tail -25 "$LOGS/$name.log"
done
say "done in $((SECONDS - START)) s"
