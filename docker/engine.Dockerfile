# The mock engine image (`connex-mock-engine`): speaks the subset of vLLM's OpenAI
# API that Connex uses, registers itself with a router and serves its prompt KV
# through the transfer crate. For tests, demos and the container fault tier.
#
#   tests: docker build -f docker/engine.Dockerfile --target prebuilt -t connex-engine <dir>
#          (<dir>/bin/connex-mock-engine built on the host; docker/build-images.sh)
#   users: docker build -f docker/engine.Dockerfile -t connex-engine .
ARG BASE=connex/debian:bookworm
ARG RUST_IMAGE=rust:1-bookworm

FROM ${BASE} AS runtime-base
RUN groupadd --system --gid 10001 connex \
 && useradd --system --uid 10001 --gid connex --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin connex
USER 10001:10001
EXPOSE 8100 7100
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/connex-mock-engine"]

FROM runtime-base AS prebuilt
COPY --chown=0:0 bin/connex-mock-engine /usr/local/bin/connex-mock-engine

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p connex-router --bin connex-mock-engine

FROM runtime-base AS runtime
COPY --from=build --chown=0:0 /src/target/release/connex-mock-engine /usr/local/bin/connex-mock-engine
