#!/usr/bin/env bash
# spotcr job VM bootstrap (EC2 user data, Debian 12 AMI). Installs and starts the SSM Agent, installs the
# prebuilt agent and CRIU from the agent asset (no compiler, no pip), reads the job from the instance's tags
# (IMDSv2, instance metadata tags enabled), prepares its storage, waits until SSM reaches the instance, and
# starts the agent. Each step prints its duration on the console.
#
# The quoted placeholders below are substituted by infra/ before this becomes user data: one for each field of
# spotcr_contracts.settings.VmSettings, which says what each means (docs/settings.md lists them; an empty value means
# "not used"). The agent asset (AGENT_ASSET_URL) is a zip whose root holds: spotcr_agent/,
# spotcr_contracts/, bin/spotcr-agent, spotcr-agent.service, install-artifact.sh,
# criu/spotcr-criu-<version>-<arch>.tar.gz{,.sha256}, python/ (the agent's packages), amazon-efs-utils/ (mount.efs,
# at efs-utils.lock), debs/ (the Debian 12 packages, with packages.lock: for, name, version, sha256).
# The instance role needs s3:GetObject on the asset (and on a job spec), the store's S3 actions, events:PutEvents,
# what SSM Agent needs for Run Command, and ssm:DescribeInstanceInformation (the readiness check).
# Sourcing this file (tests) defines its functions and runs nothing.
set -eEuo pipefail

AGENT_ASSET_URL="__SPOTCR_AGENT_ASSET_URL__"
BUCKET="__SPOTCR_BUCKET__"
EVENT_BUS="__SPOTCR_EVENT_BUS__"
EFS_ID="__SPOTCR_EFS_ID__"
EFS_ISOLATION="__SPOTCR_EFS_ISOLATION__"
FSX_DNS="__SPOTCR_FSX_DNS__"
FSX_MOUNT_NAME="__SPOTCR_FSX_MOUNT_NAME__"
STORE_CREDENTIALS_URL="__SPOTCR_STORE_CREDENTIALS_URL__"
PREFIX=/opt/spotcr
IMDS=${SPOTCR_IMDS_ENDPOINT:-http://169.254.169.254}
EMPTY_SHA256=e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855

say() {
  echo "spotcr-bootstrap: $*"
  { echo "spotcr-bootstrap: $*" >/dev/console; } 2>/dev/null || true
}

imds() {
  local token
  token=$(curl -fsS --retry 3 -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 300" "$IMDS/latest/api/token")
  curl -fsS --retry 3 -H "X-aws-ec2-metadata-token: $token" "$IMDS/latest/$1"
}

# GET an S3 object with SigV4 (curl signs it: no AWS CLI to install). Credentials as the SDKs find them:
# the environment first, else the instance role from IMDS. AWS_ENDPOINT_URL is honoured as boto3 honours it.
s3_get() {
  local url=$1 dest=$2 region=$3
  local path=${url#s3://}
  local bucket=${path%%/*} key=${path#*/}
  local id=${AWS_ACCESS_KEY_ID:-} secret=${AWS_SECRET_ACCESS_KEY:-} token=${AWS_SESSION_TOKEN:-}
  if [[ -z "$id" ]]; then
    local role
    role=$(imds meta-data/iam/security-credentials/ | head -1)
    { read -r id; read -r secret; read -r token; } < <(imds "meta-data/iam/security-credentials/$role" \
      | python3 -c 'import json, sys; c = json.load(sys.stdin); print(c["AccessKeyId"], c["SecretAccessKey"], c["Token"], sep="\n")')
  fi
  local endpoint="https://$bucket.s3.$region.amazonaws.com"
  [[ -n "${AWS_ENDPOINT_URL:-}" ]] && endpoint="${AWS_ENDPOINT_URL%/}/$bucket"
  # The secret goes to curl on stdin, not on its command line.
  {
    echo "user = \"$id:$secret\""
    [[ -n "$token" ]] && echo "header = \"x-amz-security-token: $token\""
    echo "header = \"x-amz-content-sha256: $EMPTY_SHA256\""
  } | curl -fsS --retry 5 --retry-all-errors --aws-sigv4 "aws:amz:$region:s3" -K - -o "$dest" "$endpoint/$key"
}

missing_packages() {
  # CRIU locks a job's TCP connections with iptables-restore; EFS is mounted over NFS 4.1.
  command -v iptables-restore >/dev/null || echo iptables
  if [[ -n "$EFS_ID" ]] && ! command -v mount.nfs4 >/dev/null; then echo nfs-common; fi
  # mount.efs (the agent asset's amazon-efs-utils) tunnels an isolated EFS mount's NFS through TLS with stunnel.
  if [[ -n "$EFS_ID" && "$EFS_ISOLATION" == "true" ]] && ! command -v stunnel >/dev/null; then echo stunnel4; fi
}

is_debian_12() {
  # shellcheck disable=SC1091
  (. /etc/os-release && [[ "${ID:-}" == "debian" && "${VERSION_ID:-}" == "12" ]])
}

# What this VM lacks, from the agent asset's debs/ (locked versions, sha256 checked), never from apt: a backup boots
# in the middle of a recovery and must not wait for, or depend on, the Debian mirror.
install_packages() {
  local debs=$1 wanted package
  shift
  local files=()
  (cd "$debs" && awk '!/^#/ {print $4 "  " $2 ".deb"}' packages.lock | sort -u | sha256sum -c --quiet) \
    || { say "the agent asset's Debian packages do not match their lock"; return 1; }
  for wanted in "$@"; do
    grep -q "^$wanted " "$debs/packages.lock" || { say "the agent asset has no Debian package $wanted"; return 1; }
    while read -r package; do
      dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q " installed$" || files+=("$debs/$package.deb")
    done < <(awk -v wanted="$wanted" '$1 == wanted {print $2}' "$debs/packages.lock")
  done
  [[ ${#files[@]} -gt 0 ]] || return 0
  # One dpkg run: it orders the packages by their dependencies itself.
  mapfile -t files < <(printf '%s\n' "${files[@]}" | sort -u)
  DEBIAN_FRONTEND=noninteractive dpkg -i --force-confdef --force-confold "${files[@]}" >/dev/null
}

install_missing_packages() {
  local missing
  missing=$(missing_packages | xargs)
  if [[ -n "$missing" ]] && is_debian_12; then
    say "installing $missing from the agent asset"
    # shellcheck disable=SC2086
    install_packages "$PREFIX/lib/debs" $missing
  elif [[ -n "$missing" ]]; then
    # Another image (ami_id, gpu_image): Debian 12's packages may not fit it, so its own apt; bake them in instead.
    say "installing $missing with apt (not a Debian 12 image)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
  fi
}

install_ssm_agent() {
  local region=$1 arch
  if systemctl is-active --quiet amazon-ssm-agent || systemctl is-active --quiet snap.amazon-ssm-agent.amazon-ssm-agent; then
    return 0
  fi
  arch=$(dpkg --print-architecture)
  # AWS's documented install for Debian: the package from the regional bucket.
  curl -fsS --retry 5 --retry-all-errors -o /tmp/amazon-ssm-agent.deb \
    "https://s3.$region.amazonaws.com/amazon-ssm-$region/latest/debian_$arch/amazon-ssm-agent.deb"
  dpkg -i /tmp/amazon-ssm-agent.deb >/dev/null
  rm -f /tmp/amazon-ssm-agent.deb
  systemctl enable --now amazon-ssm-agent
}

# Milliseconds since the epoch (bash 5's EPOCHREALTIME: no fork).
now_ms() {
  local micros=${EPOCHREALTIME/[.,]/}
  echo $((micros / 1000))
}

# The callers' $step and $mark (set by main, or by the rehearsal's boot): each step's duration on the console, as
# "spotcr-bootstrap: STEP took SECONDS s" (rehearsal/asset.py reads these lines back).
done_step() {
  local now elapsed
  now=$(now_ms)
  elapsed=$((now - mark))
  say "$step took $((elapsed / 1000)).$((elapsed % 1000 / 100)) s"
  mark=$now
}

on_error() {
  local code=$?
  say "FAILED at step '$step' (exit $code); see /var/log/cloud-init-output.log"
  # Once the agent is installed it reports the failure on the bus itself; before that, the console says it.
  if [[ -x "$PREFIX/bin/spotcr-agent" && "$step" != "agent-bootstrap" ]]; then
    "$PREFIX/bin/spotcr-agent" bootstrap --event-bus "$EVENT_BUS" --report-failure "$step" || true
  fi
  exit "$code"
}

# The agent asset (a zip) unpacked whole into $PREFIX/lib, or $PREFIX/lib left as it was.
fetch_asset() {
  local url=$1 region=$2 workdir
  workdir=$(mktemp -d)
  s3_get "$url" "$workdir/agent.zip" "$region"
  rm -rf "$PREFIX/lib.new"
  mkdir -p "$PREFIX/lib.new"
  python3 -m zipfile -e "$workdir/agent.zip" "$PREFIX/lib.new"
  rm -rf "$PREFIX/lib" "$workdir"
  mv "$PREFIX/lib.new" "$PREFIX/lib"
}

main() {
  local step="start" started=$SECONDS mark
  mark=$(now_ms)
  trap on_error ERR

  local region
  region=$(imds meta-data/placement/region)

  step="ssm-agent"
  say "installing and starting the SSM Agent (Debian's AMI has none; SSM delivers every spotcr command)"
  install_ssm_agent "$region"
  done_step

  step="asset"
  say "fetching the agent from $AGENT_ASSET_URL"
  fetch_asset "$AGENT_ASSET_URL" "$region"
  done_step

  step="packages"
  install_missing_packages
  done_step

  step="install"
  say "installing the prebuilt CRIU and agent"
  bash "$PREFIX/lib/install-artifact.sh" "$PREFIX/lib" "$PREFIX" --system
  install -m 0644 "$PREFIX/lib/spotcr-agent.service" /etc/systemd/system/spotcr-agent.service
  done_step

  step="agent-bootstrap"
  say "reading the job, preparing its storage, waiting for SSM to reach this instance"
  # On failure the agent itself publishes BootstrapFailed with the step and reason.
  "$PREFIX/bin/spotcr-agent" bootstrap --bucket "$BUCKET" --event-bus "$EVENT_BUS" --efs-id "$EFS_ID" \
    --efs-isolation "$EFS_ISOLATION" --fsx-dns "$FSX_DNS" --fsx-mount-name "$FSX_MOUNT_NAME" \
    --store-credentials-url "$STORE_CREDENTIALS_URL"
  done_step

  step="service"
  systemctl daemon-reload
  systemctl enable --now spotcr-agent.service
  say "agent started, $((SECONDS - started)) s after the bootstrap began"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
