#!/usr/bin/env bash
# Build the gateway image with podman where no registry serves base images: a Debian
# bookworm base with python3 made by mmdebstrap from Debian's packages, imported into
# podman, then the repository's Dockerfile on it (BASE build argument). Where a registry
# is reachable, `docker build -t kvgate .` needs none of this.
#
#   bash deploy/image/build.sh            # -> localhost/kvgate:dev
#   IMAGE=localhost/kvgate:1 bash deploy/image/build.sh
#
# Needs root and Debian's mmdebstrap and podman (apt-get install mmdebstrap podman).
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE=${IMAGE:-localhost/kvgate:dev}
BASE_IMAGE=${BASE_IMAGE:-localhost/kvgate-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=${SECURITY:-http://deb.debian.org/debian-security}

if ! podman image exists "$BASE_IMAGE"; then
  tar=$(mktemp --suffix=.tar)
  trap 'rm -f "$tar"' EXIT
  mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    --aptopt='Acquire::Languages "none"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm "$tar" "deb $MIRROR bookworm main" "deb $SECURITY bookworm-security main"
  podman import "$tar" "$BASE_IMAGE"
fi

# pip inside the build trusts the host's CA bundle (a TLS-intercepting proxy's CA is in
# it where there is one); the Dockerfile itself needs nothing of the host.
podman build --runtime runc --format docker --network host \
  -v /etc/ssl/certs:/etc/ssl/host-certs:ro \
  --env PIP_CERT=/etc/ssl/host-certs/ca-certificates.crt \
  --build-arg BASE="$BASE_IMAGE" -t "$IMAGE" .
podman image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "image size: %.0f MB\n", $1/1e6}'
