# The Connex router image (`connex-router`, with the etcd membership backend).
#
# Two ways to fill it, one runtime:
#   * users:  docker build -f docker/router.Dockerfile -t connex-router .
#             (the `build` stage compiles the router in a Rust image; needs a registry)
#   * tests:  docker build -f docker/router.Dockerfile --target prebuilt -t connex-router <dir>
#             where <dir>/bin/connex-router was built on the host (docker/build-images.sh);
#             no registry and no toolchain inside a container.
# Stages that tests build come first: the classic builder stops at --target, so
# it never reaches (or pulls) the Rust image below.
#
# The runtime base `connex/debian:bookworm` is made from Debian's packages by
# docker/base-image.sh; any debian:bookworm-slim works the same.
ARG BASE=connex/debian:bookworm
ARG RUST_IMAGE=rust:1-bookworm

FROM ${BASE} AS runtime-base
# A fixed non-root uid, so that the chart's securityContext (runAsNonRoot) holds.
RUN groupadd --system --gid 10001 connex \
 && useradd --system --uid 10001 --gid connex --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin connex
USER 10001:10001
EXPOSE 8000 8001
# The router is PID 1 and handles SIGTERM itself (graceful drain of streams).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/connex-router"]
CMD ["serve", "--listen", "0.0.0.0:8000"]

FROM runtime-base AS prebuilt
COPY --chown=0:0 bin/connex-router /usr/local/bin/connex-router

FROM ${RUST_IMAGE} AS build
RUN apt-get update -q && apt-get install -y -q --no-install-recommends protobuf-compiler libprotobuf-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The production binary: etcd in, the demo and its mock engine out.
RUN cargo build --release --locked -p connex-router --no-default-features --features etcd --bin connex-router

FROM runtime-base AS runtime
COPY --from=build --chown=0:0 /src/target/release/connex-router /usr/local/bin/connex-router
