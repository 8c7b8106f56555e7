#!/usr/bin/env bash
# Builds the MinIO server that `make bench` runs on loopback, from the Go module proxy, into
# ~/.cache/spotcr/minio/minio (where bench/pipeline.py looks after SPOTCR_BENCH_MINIO and PATH).
# Pinned: the last commit of github.com/minio/minio the proxy serves (2026-02-12); the go command checks the
# module against the Go checksum database, and this script against the sum pinned here. About 5-10 minutes on
# 2 cores. MinIO is AGPLv3: it is built and run here as a separate program, never shipped with spotcr.
set -euo pipefail

MODULE=github.com/minio/minio
VERSION=v0.0.0-20260212201848-7aac2a2c5b7c
SUM=h1:/qdoYujxF5MBLDMVLeiYJ/7fBa1HikX39Dvzb9Ji8pA=
DEST="${HOME}/.cache/spotcr/minio"
GO="$(command -v go || echo /usr/local/go/bin/go)"

[ -x "${GO}" ] || { echo "install-minio: no Go toolchain (go on PATH or /usr/local/go/bin/go)" >&2; exit 2; }
if [ -x "${DEST}/minio" ]; then
  echo "install-minio: ${DEST}/minio is there"
  exit 0
fi
got="$(cd /tmp && "${GO}" mod download -json "${MODULE}@${VERSION}" | sed -n 's/^\t"Sum": "\(.*\)",$/\1/p')"
[ "${got}" = "${SUM}" ] || { echo "install-minio: ${MODULE}@${VERSION} has sum ${got}, expected ${SUM}" >&2; exit 1; }
mkdir -p "${DEST}"
echo "install-minio: building ${MODULE}@${VERSION} into ${DEST} (several minutes)"
(cd /tmp && GOBIN="${DEST}" GOFLAGS=-mod=mod nice -n 10 "${GO}" install "${MODULE}@${VERSION}")
"${DEST}/minio" --version | head -1
