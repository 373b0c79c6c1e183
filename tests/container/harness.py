"""A Connex cluster of real containers, each its own host on private Docker networks.

Two networks, so that a fault can cut one path and leave the others:
- ``data``: routers and engines (requests, KV pulls, registration);
- ``ctrl``: routers and the etcd members (membership).
The client (this process) reaches the routers only through ports published on
127.0.0.1; it never sends traffic to a container address.

Images come from ``docker/build-images.sh`` (router, mock engine) and small
etcd and Redis images made here from the host's Debian binaries: nothing is
pulled. The router's arguments, what a test asks a router and the waiting come
from tests/connex_harness, which every Python tier shares.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# On sys.path through this tier's conftest.py.
from connex_harness import ROOT, RUNNING, RouterApi, router_args
from connex_harness import UNREACHABLE as UNREACHABLE
from connex_harness import wait_for as wait_for

TAG = os.environ.get("CONNEX_IMAGE_TAG", "dev")
ROUTER_IMAGE = f"connex-router:{TAG}"
ENGINE_IMAGE = f"connex-engine:{TAG}"
ETCD_IMAGE = f"connex-etcd:{TAG}"
REDIS_IMAGE = f"connex-redis:{TAG}"
ADMIN_TOKEN = "container-admin-token"
REGISTER_TOKEN = "container-register-token"
TRANSFER_SECRET = "container-transfer-secret"
LABEL = "connex-container-tier"


class DockerError(RuntimeError):
    pass


def docker(*args: str, check: bool = True, timeout: float = 120) -> str:
    """Runs the docker CLI and returns its stdout."""
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise DockerError(f"docker {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def require_docker() -> None:
    """Fails (never skips) when no Docker daemon answers: every machine of the project has one."""
    try:
        docker("info", "--format", "{{.ServerVersion}}", timeout=30)
    except (DockerError, FileNotFoundError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(
            "the container tier needs a running Docker daemon (`docker info` failed): "
            f"{err}. Start dockerd; this tier is part of tests/run and is never skipped."
        ) from err


def build_images() -> None:
    """Router and engine images from the host's binaries (unless
    CONNEX_IMAGES_BUILT says whoever started the tier has just built them:
    tests/run does, then runs the tier beside its cargo steps, which the
    script's own `cargo build` would wait for), and the etcd image."""
    if not os.environ.get("CONNEX_IMAGES_BUILT"):
        subprocess.run([str(ROOT / "docker" / "build-images.sh")], check=True, cwd=ROOT)
    host_binary_image(ETCD_IMAGE, "etcd.Dockerfile", "etcd", "etcd-server")


def build_redis_image() -> None:
    """A Redis image (the shared response store's)."""
    host_binary_image(
        REDIS_IMAGE, "redis.Dockerfile", "redis-server", "redis-server", with_libraries=True
    )


def host_binary_image(
    image: str, dockerfile: str, binary: str, package: str, with_libraries=False
) -> None:
    """`image` unless it exists: the host's Debian `binary` on the project's
    base image (tests/container/`dockerfile`), with the libraries it links
    beyond the base image's C library when `with_libraries` (under lib/)."""
    if not subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
        return
    path = shutil.which(binary)
    if path is None:
        raise RuntimeError(f"the host has no {binary} (Debian {package}; tests/run installs it)")
    with tempfile.TemporaryDirectory() as ctx:
        shutil.copy(path, Path(ctx) / binary)
        if with_libraries:
            (Path(ctx) / "lib").mkdir()
            for lib in linked_libraries(path):
                shutil.copy(lib, Path(ctx) / "lib" / Path(lib).name)
        subprocess.run(
            ["docker", "build", "--quiet", "-f", str(ROOT / "tests" / "container" / dockerfile)]
            + ["-t", image, ctx],
            check=True,
            capture_output=True,
            env={**os.environ, "DOCKER_BUILDKIT": "0"},
        )


def linked_libraries(path: str) -> list[str]:
    """The libraries `path` links, but the C library's own (the base image has
    them, of the same Debian release)."""
    linked = subprocess.run(["ldd", path], check=True, capture_output=True, text=True)
    libs = []
    for line in linked.stdout.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) > 2 and parts[2].startswith("/"):
            if not Path(parts[2]).name.startswith(("libc.so", "libm.so", "ld-linux")):
                libs.append(parts[2])
    return libs


def published_port(container: str, port: int) -> int:
    out = docker("port", container, f"{port}/tcp")
    # e.g. "127.0.0.1:49153"
    return int(out.splitlines()[0].rsplit(":", 1)[1])


class RouterHandle(RouterApi):
    """A router container (`name`), reached through its published ports."""

    def __init__(self, name: str, url: str, internal: str, admin_token: str = ADMIN_TOKEN):
        super().__init__(url, internal, admin_token)
        self.name = name

    def refresh(self) -> None:
        """Re-reads the published ports (a restarted container may get new ones)."""
        self.url = f"http://127.0.0.1:{published_port(self.name, 8000)}"
        self.internal = f"http://127.0.0.1:{published_port(self.name, 8001)}"


def wait_sees(router: RouterHandle, engines: set[str], timeout_s: float = 30) -> None:
    """Waits until `router` has every one of `engines` registered and ready
    (through restarts and cuts: an unreachable router is asked again)."""
    wait_for(
        lambda: router.instance_ids() >= engines,
        timeout_s,
        f"{router.name} to see every engine",
        tolerate=UNREACHABLE,
    )


@dataclass
class Cluster:
    """Names every container and network it made, and removes them all on close."""

    prefix: str = field(default_factory=lambda: f"cx{secrets.token_hex(3)}")
    containers: list[str] = field(default_factory=list)
    networks: list[str] = field(default_factory=list)
    routers: list[RouterHandle] = field(default_factory=list)
    etcd_members: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Running until closed: a failed test's report shows the containers' log
        # tails (connex_harness/reports.py).
        RUNNING[self.title] = self

    @property
    def title(self) -> str:
        return f"containers {self.prefix}"

    # -- networks and containers ------------------------------------------------
    def network(self, role: str) -> str:
        name = f"{self.prefix}-{role}"
        docker("network", "create", "--label", LABEL, name)
        self.networks.append(name)
        return name

    def run(
        self,
        name: str,
        image: str,
        networks: list[str],
        *args: str,
        publish=(),
        aliases=(),
        labels: dict[str, str] | None = None,
        volumes=(),
        entrypoint: str | None = None,
    ) -> str:
        full = f"{self.prefix}-{name}"
        cmd = ["run", "-d", "--name", full, "--hostname", name, "--label", LABEL]
        for key, value in (labels or {}).items():
            cmd += ["--label", f"{key}={value}"]
        cmd += ["--network", networks[0], "--network-alias", name]
        for alias in aliases:
            cmd += ["--network-alias", alias]
        for port in publish:
            cmd += ["-p", f"127.0.0.1::{port}"]
        for volume in volumes:
            cmd += ["-v", volume]
        if entrypoint is not None:
            cmd += ["--entrypoint", entrypoint]
        cmd += [image, *args]
        docker(*cmd)
        self.containers.append(full)
        for extra in networks[1:]:
            docker("network", "connect", "--alias", name, extra, full)
        return full

    def close(self) -> None:
        RUNNING.pop(self.title, None)
        for name in reversed(self.containers):
            docker("rm", "-f", "-v", name, check=False)
        for name in self.networks:
            docker("network", "rm", name, check=False)

    def kill(self) -> None:
        self.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, error_type, *_) -> None:
        """Closes the cluster; one that failed to come up prints its logs first
        (its containers are gone by the time pytest reports the failure)."""
        if error_type is not None:
            print(self.log_tail())
        self.close()

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of every container's log."""
        out = []
        for name in self.containers:
            done = subprocess.run(
                ["docker", "logs", "--tail", str(lines), name], capture_output=True, text=True
            )
            out.append(f"--- {name}\n{done.stdout}{done.stderr}")
        return "\n".join(out)

    # -- the parts ----------------------------------------------------------------
    def start_etcd(self, ctrl: str, members: int = 3) -> list[str]:
        names = [f"etcd{i}" for i in range(1, members + 1)]
        initial = ",".join(f"{n}=http://{n}:2380" for n in names)
        for name in names:
            self.run(
                name,
                ETCD_IMAGE,
                [ctrl],
                "--name", name,
                "--data-dir", "/tmp/etcd",
                "--listen-client-urls", "http://0.0.0.0:2379",
                "--advertise-client-urls", f"http://{name}:2379",
                "--listen-peer-urls", "http://0.0.0.0:2380",
                "--initial-advertise-peer-urls", f"http://{name}:2380",
                "--initial-cluster", initial,
                "--initial-cluster-state", "new",
                "--initial-cluster-token", self.prefix,
            )  # fmt: skip
        self.etcd_members = [f"{self.prefix}-{n}" for n in names]
        return names

    def start_router(
        self, name: str, data: str, ctrl: str, etcd: list[str], *extra: str
    ) -> RouterHandle:
        args = router_args(
            "--heartbeat-ttl-s", "5",
            "--stall-timeout-ms", "1500",
            *extra,
            listen="0.0.0.0:8000",
            internal_listen="0.0.0.0:8001",
            admin_token=ADMIN_TOKEN,
            register_token=REGISTER_TOKEN,
            transfer_secret=TRANSFER_SECRET,
            expose_instance_headers=True,
            etcd=(f"http://{n}:2379" for n in etcd),
        )  # fmt: skip
        full = self.run(
            name,
            ROUTER_IMAGE,
            [data, ctrl],
            *args,
            publish=(8000, 8001),
            # Engines register through "routers", as through the chart's
            # internal Service: any live replica answers.
            aliases=("routers",),
        )
        handle = RouterHandle(
            name=full,
            url=f"http://127.0.0.1:{published_port(full, 8000)}",
            internal=f"http://127.0.0.1:{published_port(full, 8001)}",
        )
        self.routers.append(handle)
        wait_for(
            lambda: handle.get_json("/health")[0] == 200, 30, f"{full} health", tolerate=UNREACHABLE
        )
        return handle

    def start_engine(self, name: str, role: str, data: str, *faults: str) -> str:
        # The engine binds its container address (not 0.0.0.0), so that the
        # URL and the hold address it announces are the ones its peers reach.
        script = (
            'exec connex-mock-engine --listen "$(hostname -i | cut -d" " -f1):8100" '
            f"--id {name} --role {role} --model mock --router http://routers:8001 "
            f"--register-token {REGISTER_TOKEN} --transfer-secret {TRANSFER_SECRET} "
            "--decode-us-per-token 25000 " + " ".join(faults)
        )
        full = f"{self.prefix}-{name}"
        docker(
            "run", "-d", "--name", full, "--hostname", name, "--label", LABEL,
            "--network", data, "--network-alias", name,
            "--entrypoint", "/bin/sh", ENGINE_IMAGE, "-c", script,
        )  # fmt: skip
        self.containers.append(full)
        return full

    def pid(self, container: str) -> int:
        return int(docker("inspect", "--format", "{{.State.Pid}}", container))

    def address(self, container: str, network: str) -> str:
        fmt = '{{(index .NetworkSettings.Networks "' + network + '").IPAddress}}'
        return docker("inspect", "--format", fmt, container)


def stream_completion(
    router: RouterHandle, prompt: str, max_tokens: int, on_token=None, timeout=60.0
):
    """Streams a completion; returns (text, finish_reason, headers, error events)."""
    body = {"model": "mock", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    text, finish, errors = [], None, []
    with httpx.Client(timeout=timeout) as client:
        with client.stream("POST", f"{router.url}/v1/completions", json=body) as reply:
            headers = dict(reply.headers)
            if reply.status_code != 200:
                raise AssertionError(f"HTTP {reply.status_code}: {reply.read()!r}")
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                    continue
                for choice in event.get("choices", []):
                    text.append(choice.get("text", ""))
                    finish = choice.get("finish_reason") or finish
                if on_token is not None:
                    on_token(len(text), headers)
    return "".join(text), finish, headers, errors
