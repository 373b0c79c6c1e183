#!/usr/bin/env bash
# Builds the router and mock-engine images from binaries built on the host (no
# Rust toolchain can be fetched inside a container here, and no registry can be
# pulled from): makes the base image if missing (docker/base-image.sh), stages the
# binaries into a small build context and builds each Dockerfile's `prebuilt`
# stage. Users with a registry build the default stage instead (docs/operations.md).
#
# Usage: docker/build-images.sh [PROFILE]   (PROFILE: debug (default) or release)
# Tags:  connex-router:dev, connex-engine:dev (override with CONNEX_IMAGE_TAG)
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${1:-debug}
TAG=${CONNEX_IMAGE_TAG:-dev}
docker/base-image.sh

cargo_flags=(--locked -p connex-router --features connex-router/etcd --bin connex-router --bin connex-mock-engine)
[ "$PROFILE" = release ] && cargo_flags+=(--release)
cargo build --quiet "${cargo_flags[@]}"

ctx=$(mktemp -d /tmp/connex-image-ctx.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/bin"
for bin in connex-router connex-mock-engine; do
    install -m 0755 "target/$PROFILE/$bin" "$ctx/bin/$bin"
done
build() { # DOCKERFILE IMAGE
    # The classic builder (no buildx here) prints a deprecation notice; only
    # failures matter.
    DOCKER_BUILDKIT=0 docker build --quiet -f "$1" --target prebuilt -t "$2" "$ctx" >/dev/null 2>"$ctx/build.log" || {
        cat "$ctx/build.log" >&2
        return 1
    }
}
build docker/router.Dockerfile "connex-router:$TAG"
build docker/engine.Dockerfile "connex-engine:$TAG"
echo "built connex-router:$TAG and connex-engine:$TAG from target/$PROFILE" >&2
