#!/usr/bin/env bash
# Makes the base image every Dockerfile here starts from, `connex/debian:bookworm`,
# out of Debian's own packages: no container registry is needed (or reachable on
# the project's machines). debootstrap a minimal bookworm into a folder, then
# `docker import` it. A no-op when the image already exists (cached by the daemon
# between runs on the same machine); `--force` makes it again.
#
# Usage: docker/base-image.sh [--force]
set -euo pipefail
TAG=${CONNEX_BASE_IMAGE:-connex/debian:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [ "${1:-}" != "--force" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    exit 0
fi
if ! docker info >/dev/null 2>&1; then
    echo "docker/base-image.sh: no Docker daemon answers (docker info failed)" >&2
    exit 1
fi
if ! command -v debootstrap >/dev/null; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >/dev/null
fi
root=$(mktemp -d /tmp/connex-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "docker/base-image.sh: debootstrap bookworm (minbase) into $root ..." >&2
# ca-certificates: the router talks TLS to etcd when configured to; tini-less on
# purpose: the router handles SIGTERM as PID 1 itself.
debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$MIRROR" >/dev/null
# Keep the image small: no apt lists, docs or caches.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$TAG" >/dev/null
echo "docker/base-image.sh: imported $TAG" >&2
