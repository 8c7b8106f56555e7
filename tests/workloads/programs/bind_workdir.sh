#!/bin/bash
# A sandboxed job: in a mount namespace of its own it bind-mounts a directory of its work dir over another one
# and runs the program there, so every file it writes goes through that bind mount.
set -euo pipefail
mkdir -p data view
ln -sfn data/progress.log progress.log  # where the test watches the steps (a link: not part of the result)
exec unshare --mount --propagation private bash -c 'mount --bind data view && cd view && exec "$@"' job "$@"
