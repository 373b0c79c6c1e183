"""connex-router for tests: its start arguments (built here only, for a local
process, a container or a config check alike), what a test asks of a running
router, and a router process on loopback."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import httpx

from .metrics import sum_metric
from .processes import Process
from .waiting import wait_for

# The admin token of the routers the tests start, unless a test names another.
ADMIN_TOKEN = "t"
LOOPBACK_ANY_PORT = "127.0.0.1:0"


def router_args(
    *flags: str,
    listen: str = LOOPBACK_ANY_PORT,
    internal_listen: str = LOOPBACK_ANY_PORT,
    admin_token: str | None = ADMIN_TOKEN,
    register_token: str | None = None,
    transfer_secret: str | None = None,
    expose_instance_headers: bool = False,
    etcd: Iterable[str] = (),
    config: Path | None = None,
) -> list[str]:
    """`connex-router serve`'s arguments: the client and internal listeners,
    the admin token (None: no admin API), the registration token and transfer
    secret where given, `--expose-instance-headers` (tests that check which
    decoder served), the etcd endpoints (membership), a config file, then
    `flags` (the test's own: they come last, so they read as the test's)."""
    args = ["serve"]
    if config is not None:
        args += ["--config", str(config)]
    args += ["--listen", listen, "--internal-listen", internal_listen]
    if admin_token is not None:
        args += ["--admin-token", admin_token]
    if register_token is not None:
        args += ["--register-token", register_token]
    if transfer_secret is not None:
        args += ["--transfer-secret", transfer_secret]
    if expose_instance_headers:
        args.append("--expose-instance-headers")
    endpoints = ",".join(etcd)
    if endpoints:
        args += ["--etcd", endpoints]
    return [*args, *flags]


class RouterApi:
    """What a test asks a running router: `url` is its client API, `internal`
    its internal listener (registration, admin, metrics)."""

    def __init__(self, url: str, internal: str, admin_token: str = ADMIN_TOKEN) -> None:
        self.url = url
        self.internal = internal
        self.admin_token = admin_token

    def get_json(self, path: str, internal: bool = False, timeout: float = 5) -> tuple[int, dict]:
        """GETs `path` of the client API (of the internal listener where
        `internal`) with the admin token: its status and JSON body, whatever
        the status (a probe's 503 says why in its body)."""
        base = self.internal if internal else self.url
        reply = httpx.get(
            base + path, headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=timeout
        )
        return reply.status_code, reply.json() if reply.content else {}

    def _admin(self, method: str, path: str) -> httpx.Response:
        reply = httpx.request(
            method,
            f"{self.internal}/admin/{path}",
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=5,
        )
        reply.raise_for_status()
        return reply

    def admin(self, path: str) -> list[dict]:
        """GETs an admin list (`instances`, `requests`): its `data`."""
        return self._admin("GET", path).json()["data"]

    def admin_post(self, path: str) -> None:
        """POSTs to the admin API (drain, activate: `instances/{id}/drain`)."""
        self._admin("POST", path)

    def admin_delete(self, path: str) -> None:
        """DELETEs through the admin API (`instances/{id}`: removes it)."""
        self._admin("DELETE", path)

    def instances(self) -> list[dict]:
        return self.admin("instances")

    def instance_ids(self, state: str = "ready") -> set[str]:
        """The ids of the instances in `state`."""
        return {i["id"] for i in self.instances() if i["state"] == state}

    def requests(self) -> list[dict]:
        """The journal: requests in flight."""
        return self.admin("requests")

    def metric(self, name: str, absent: float | None = None) -> float:
        """Sum of a Prometheus metric's samples on this router (see `sum_metric`)."""
        return sum_metric(httpx.get(f"{self.internal}/metrics", timeout=10).text, name, absent)

    def wait_instances(self, ids: set[str], timeout_s: float = 60) -> None:
        """Waits until every one of `ids` is registered and ready."""
        wait_for(
            lambda: ids <= self.instance_ids(), timeout_s, f"instances {sorted(ids)} to register"
        )

    def wait_ready_count(self, count: int, timeout_s: float = 10) -> None:
        """Waits until `count` instances (whichever) are registered and ready."""
        wait_for(
            lambda: len(self.instance_ids()) >= count,
            timeout_s,
            f"{count} instances to register",
            interval_s=0.05,
        )


class Router(RouterApi):
    """A connex-router process on free loopback ports, started with
    `router_args(*flags, **options)`."""

    def __init__(self, *flags: str, log_dir: Path | None = None, **options) -> None:
        self.process = Process("connex-router", *router_args(*flags, **options), log_dir=log_dir)
        super().__init__(
            self.process.url,
            self.process.announced("internal API on "),
            options.get("admin_token") or ADMIN_TOKEN,
        )

    def alive(self) -> bool:
        return self.process.alive()

    def kill(self) -> None:
        """Kills it at once (a crash, as the tests of failover want) and waits."""
        self.process.stop()

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
