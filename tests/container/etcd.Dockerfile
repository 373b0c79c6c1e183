# etcd for the container tier: the host's Debian etcd binary (tests/run installs
# etcd-server) on the project's base image; nothing is pulled.
FROM connex/debian:bookworm
COPY etcd /usr/local/bin/etcd
ENTRYPOINT ["/usr/local/bin/etcd"]
