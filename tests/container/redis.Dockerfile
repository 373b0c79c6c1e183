# Redis for the container tier (the shared response store): the host's Debian
# redis-server (tests/run installs it) and the libraries it links, on the
# project's base image; nothing is pulled.
FROM connex/debian:bookworm
COPY redis-server /usr/local/bin/redis-server
COPY lib/ /usr/local/lib/redis/
ENV LD_LIBRARY_PATH=/usr/local/lib/redis
ENTRYPOINT ["/usr/local/bin/redis-server"]
