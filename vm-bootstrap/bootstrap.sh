#!/usr/bin/env bash
# spotcr job VM bootstrap (EC2 user data, Debian 12 AMI). Installs CRIU and the agent, reads the job from
# the instance's tags (IMDSv2, instance metadata tags enabled), prepares its storage and starts the agent.
#
# Placeholders that infra/ substitutes before this becomes user data (an empty value means "not used"):
#   __SPOTCR_AGENT_ASSET_URL__   s3://bucket/key.zip of the agent asset. The zip's root holds: spotcr_agent/,
#                                spotcr_contracts/, bin/spotcr-agent, spotcr-agent.service, install-criu.sh,
#                                criu-*.patch, requirements.txt (that is vm-bootstrap/ plus functions/spotcr_contracts/).
#   __SPOTCR_BUCKET__            bucket of the job's checkpoints (s3 storage)
#   __SPOTCR_EVENT_BUS__         EventBridge bus name for the agent's events
#   __SPOTCR_EFS_ID__            EFS file system id (efs storage)
#   __SPOTCR_FSX_DNS__           FSx for Lustre DNS name (fsx storage)
#   __SPOTCR_FSX_MOUNT_NAME__    FSx for Lustre mount name (fsx storage)
# The instance role needs s3:GetObject on the asset (and on a job spec), the store's S3 actions, events:PutEvents.
set -euo pipefail

AGENT_ASSET_URL="__SPOTCR_AGENT_ASSET_URL__"
BUCKET="__SPOTCR_BUCKET__"
EVENT_BUS="__SPOTCR_EVENT_BUS__"
EFS_ID="__SPOTCR_EFS_ID__"
FSX_DNS="__SPOTCR_FSX_DNS__"
FSX_MOUNT_NAME="__SPOTCR_FSX_MOUNT_NAME__"
PREFIX=/opt/spotcr

say() {
  echo "spotcr-bootstrap: $*"
  { echo "spotcr-bootstrap: $*" >/dev/console; } 2>/dev/null || true
}

step="start"
on_error() {
  local code=$?
  say "FAILED at step '$step' (exit $code); see /var/log/cloud-init-output.log"
  # Once the agent is installed it reports the failure on the bus itself; before that, the console says it.
  if [[ -x "$PREFIX/bin/spotcr-agent" && "$step" != "agent-bootstrap" ]]; then
    "$PREFIX/bin/spotcr-agent" bootstrap --event-bus "$EVENT_BUS" --report-failure "$step" || true
  fi
  exit "$code"
}
trap on_error ERR

step="packages"
say "installing packages"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# python3-venv: the agent's venv; awscli: fetches the asset; nfs-common: EFS over NFS 4.1 (amazon-efs-utils is not
# packaged for Debian: where it is installed, mount -t efs -o tls is used instead); e2fsprogs: formats EBS volumes.
# FSx for Lustre needs the Lustre client, which Debian does not ship: use an AMI that has it for fsx storage.
apt-get install -y -qq python3-venv awscli unzip nfs-common e2fsprogs util-linux ca-certificates curl

step="asset"
say "fetching the agent from $AGENT_ASSET_URL"
workdir=$(mktemp -d)
aws s3 cp --only-show-errors "$AGENT_ASSET_URL" "$workdir/agent.zip"
rm -rf "$PREFIX/lib.new"
mkdir -p "$PREFIX/lib.new" "$PREFIX/bin"
unzip -q "$workdir/agent.zip" -d "$PREFIX/lib.new"
rm -rf "$PREFIX/lib"
mv "$PREFIX/lib.new" "$PREFIX/lib"
rm -rf "$workdir"

step="venv"
say "creating $PREFIX/venv"
python3 -m venv "$PREFIX/venv"
"$PREFIX/venv/bin/pip" install -q --disable-pip-version-check -r "$PREFIX/lib/requirements.txt"
install -m 0755 "$PREFIX/lib/bin/spotcr-agent" "$PREFIX/bin/spotcr-agent"
install -m 0644 "$PREFIX/lib/spotcr-agent.service" /etc/systemd/system/spotcr-agent.service

step="criu"
say "installing CRIU"
bash "$PREFIX/lib/install-criu.sh"

step="agent-bootstrap"
say "reading the job and preparing its storage"
# On failure the agent itself publishes BootstrapFailed with the step and reason.
"$PREFIX/bin/spotcr-agent" bootstrap --bucket "$BUCKET" --event-bus "$EVENT_BUS" --efs-id "$EFS_ID" \
  --fsx-dns "$FSX_DNS" --fsx-mount-name "$FSX_MOUNT_NAME"

step="service"
systemctl daemon-reload
systemctl enable --now spotcr-agent.service
say "agent started"
