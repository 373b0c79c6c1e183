"""Keeps an engine registered with a Connex router.

Registers the engine (`POST /v1/instances` {role, url, model, ctrl?, id?}) once its
HTTP server answers `/health`, heartbeats every third of the lease the router
grants (`POST /v1/instances/{id}/heartbeat` with load stats), registers again when
the router has forgotten it (404), skips heartbeats while the engine is unhealthy
(so that the router's TTL marks it dead) and deregisters on exit.

The router answers a registration with a per-instance `credential`; the agent
keeps it and presents it (header `x-connex-credential`) on every heartbeat,
re-registration and deregistration of that id, so that nobody else can take the
id over. A router that issues none gets none. No exception ends the agent: a
failed round is logged, counted (`errors`) and retried, and heartbeats go on.

With a deregister file (CONNEX_DEREGISTER_FILE, as the chart sets it), the agent
deregisters and stops as soon as that file exists: a pod's preStop hook creates
it, so that the routers send the engine no new request while its streams
finish, before the engine gets SIGTERM.

Two ways to run it:
- beside any engine: `python -m connex.agent --router URL --role decode
  --url http://host:port --model NAME [--ctrl host:port] [--id ID]`; load stats
  are read from the engine's Prometheus `/metrics`; the register token comes
  from CONNEX_REGISTER_TOKEN or `--token-file` (never the command line, which
  `ps` shows);
- inside vLLM: the ConnexConnector starts an `Agent` thread when
  `kv_connector_extra_config.router` is set, with load stats from its scheduler.

Only the standard library is used, so it runs wherever vLLM does.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.client import HTTPMessage
from typing import IO, Any

from .credentials import REGISTER_TOKEN_ENV, read_secret

logger = logging.getLogger("connex.agent")

ROLES = ("prefill", "decode", "both")
CREDENTIAL_HEADER = "x-connex-credential"
# The file whose existence tells the agent to deregister and stop (preStop).
DEREGISTER_FILE_ENV = "CONNEX_DEREGISTER_FILE"
# How often the agent looks for the deregister file between rounds.
DEREGISTER_POLL_S = 0.5
# Router replies are small JSON objects; a larger one is not read whole.
MAX_REPLY_BYTES = 1 << 20


class Agent:
    """Registration and heartbeats for one engine, on a daemon thread."""

    def __init__(
        self,
        router: str,
        role: str,
        url: str,
        model: str,
        ctrl: str | None = None,
        instance_id: str | None = None,
        token: str | None = None,
        load: Callable[[], dict[str, Any]] | None = None,
        timeout_s: float = 5.0,
        deregister_file: str | None = None,
        kv_events: str | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL, not {url!r}")
        self.router = router.rstrip("/")
        self.role = role
        self.url = url.rstrip("/")
        self.model = model
        self.ctrl = ctrl
        self.requested_id = instance_id
        self.token = token
        self.load = load or (lambda: metrics_load(self.url, timeout_s))
        self.timeout_s = timeout_s
        self.deregister_file = deregister_file or None
        # Deregistered for good (the deregister file appeared).
        self.retired = False
        self.instance_id: str | None = None
        # Issued by the router at the first registration of this id.
        self.credential: str | None = None
        self.lease_ttl_s = 10.0
        self.registrations = 0
        self.heartbeats = 0
        # Rounds that ended in an exception (logged, then retried).
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The engine's ZMQ KV event endpoint: its events are forwarded to the
        # router (connex.kv_events) while the agent runs.
        self.kv_events_endpoint = kv_events
        self.kv_events: Any = None

    # ---- lifecycle -------------------------------------------------------------

    def start(self) -> Agent:
        self._thread = threading.Thread(target=self.run, name="connex-agent", daemon=True)
        self._thread.start()
        self.start_kv_events()
        return self

    def start_kv_events(self) -> None:
        if self.kv_events_endpoint is None:
            return
        from .kv_events import KvEventForwarder

        self.kv_events = KvEventForwarder(self.kv_events_endpoint, self.forward_kv_events).start()

    def stop(self, deregister: bool = True) -> None:
        if self.kv_events is not None:
            self.kv_events.stop()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s * 2)
        if deregister:
            self.deregister()

    def run(self) -> None:
        """Registers and heartbeats until `stop()` or the deregister file; no
        exception ends it."""
        while not self._stop.is_set():
            if self.retire_requested():
                self.retire()
                return
            try:
                wait = self.tick()
            except Exception:
                # A malformed reply, a broken connection, a bug: this round is lost,
                # the engine must not silently drop out of the pool for it.
                self.errors += 1
                logger.exception("agent round failed (%d so far); retrying", self.errors)
                wait = min(1.0, self.lease_ttl_s / 3)
            self._wait(wait)

    def _wait(self, seconds: float) -> None:
        """Waits until the next round, `stop()` or the deregister file."""
        if self.deregister_file is None:
            self._stop.wait(seconds)
            return
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and not self.retire_requested():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._stop.wait(min(left, DEREGISTER_POLL_S))

    def retire_requested(self) -> bool:
        return self.deregister_file is not None and os.path.exists(self.deregister_file)

    def retire(self) -> None:
        """Deregisters for good: no more registration or heartbeat."""
        logger.info("%s exists: deregistering for good", self.deregister_file)
        self.deregister()
        self.retired = True
        self._stop.set()

    def tick(self) -> float:
        """One round: register or heartbeat. Returns the seconds until the next."""
        if not self.engine_healthy():
            return 0.5 if self.instance_id is None else self.lease_ttl_s / 3
        if self.instance_id is None:
            return self.register()
        return self.heartbeat()

    # ---- router calls ----------------------------------------------------------

    def register(self) -> float:
        body = {"role": self.role, "url": self.url, "model": self.model}
        if self.ctrl:
            body["ctrl"] = self.ctrl
        if self.requested_id:
            body["id"] = self.requested_id
        try:
            status, reply = self._call("POST", "/v1/instances", body)
        except OSError as err:
            logger.debug("router %s unreachable: %s", self.router, err)
            return 0.5
        if status not in (200, 201) or not isinstance(reply, dict) or "id" not in reply:
            logger.warning("router refused registration (HTTP %s): %s", status, reply)
            return 2.0
        lease = reply.get("lease_ttl_s") or 10
        if not isinstance(lease, int | float) or not math.isfinite(lease):
            raise ValueError(f"router answered a bad lease_ttl_s: {lease!r}")
        credential = reply.get("credential")
        if credential is not None and not isinstance(credential, str):
            raise ValueError("router answered a credential that is not a string")
        self.instance_id = str(reply["id"])
        self.lease_ttl_s = min(max(float(lease), 0.3), 3600.0)
        if credential:
            self.credential = credential
        self.registrations += 1
        logger.info(
            "registered with %s as %s (%s, lease %ss)",
            self.router,
            self.instance_id,
            self.role,
            self.lease_ttl_s,
        )
        return self.lease_ttl_s / 3

    def heartbeat(self) -> float:
        try:
            stats = self.load()
        except Exception as err:  # load stats are best effort; the heartbeat is not
            logger.debug("load stats unavailable: %s", err)
            stats = {}
        try:
            status, _ = self._call("POST", f"/v1/instances/{self.instance_id}/heartbeat", stats)
        except OSError as err:
            logger.debug("heartbeat failed: %s", err)
            return min(1.0, self.lease_ttl_s / 3)
        if status == 404:
            logger.warning("router forgot instance %s; registering again", self.instance_id)
            self.instance_id = None
            return 0.0
        if status in (401, 403):
            # Another registrant (or the admin API) holds this id now.
            logger.error(
                "router refused the heartbeat of %s (HTTP %s); registering again",
                self.instance_id,
                status,
            )
            self.instance_id = None
            return 2.0
        if status >= 300:
            logger.warning("heartbeat of %s failed (HTTP %s)", self.instance_id, status)
            return min(1.0, self.lease_ttl_s / 3)
        self.heartbeats += 1
        return self.lease_ttl_s / 3

    def forward_kv_events(self, events: list[dict[str, Any]]) -> bool:
        """Posts KV events to the router; False to keep them for later (not
        registered yet, router unreachable)."""
        if self.instance_id is None:
            return False
        try:
            status, reply = self._call(
                "POST", f"/v1/instances/{self.instance_id}/kv-events", {"events": events}
            )
        except OSError as err:
            logger.debug("KV events not forwarded: %s", err)
            return False
        if status == 404 or status >= 500 or 300 <= status < 400:
            return False  # not registered there yet, or the router is failing: later
        if status >= 400:
            # Refused for good (a bad or too large batch): dropped, and the
            # router's index of this engine is cleared next, since a lost
            # removal would leave it claiming blocks the engine evicted.
            logger.warning("router refused KV events (HTTP %s): %s", status, reply)
            if self.kv_events is not None:
                self.kv_events.reset()
        return True

    def deregister(self) -> None:
        if self.instance_id is None:
            return
        try:
            status, reply = self._call("DELETE", f"/v1/instances/{self.instance_id}", None)
            if status >= 300 and status != 404:
                logger.warning(
                    "router refused to deregister %s (HTTP %s): %s", self.instance_id, status, reply
                )
            else:
                logger.info("deregistered %s", self.instance_id)
        except Exception as err:  # at exit: say so, never raise
            logger.warning("could not deregister %s: %s", self.instance_id, err)
        self.instance_id = None

    def engine_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=self.timeout_s) as r:
                return bool(r.status == 200)
        except (OSError, ValueError):
            return False

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, object]:
        """One request to the router: its status (a redirect is not followed,
        and counts as a refusal) and its JSON body."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.router}{path}", data=data, method=method)
        if data is not None:
            request.add_header("content-type", "application/json")
        if self.token:
            request.add_header("authorization", f"Bearer {self.token}")
        if self.credential:
            request.add_header(CREDENTIAL_HEADER, self.credential)
        try:
            with _NO_REDIRECTS.open(request, timeout=self.timeout_s) as reply:
                status, raw = reply.status, reply.read(MAX_REPLY_BYTES)
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read(MAX_REPLY_BYTES)
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """Follows no redirect: urllib would send the register token
    (`Authorization`) and the instance credential along to wherever the
    redirect points. The router never redirects; a 3xx is answered as an error."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        return None


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


def metrics_load(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """Load stats of a vLLM engine from its Prometheus metrics: requests running
    and waiting, and the fraction of its KV cache in use (`kv_usage`, 0 to 1),
    as the router's `load_aware` and `cache_aware` policies read them."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode(errors="replace")
    counts = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
    # vLLM V1 names it kv_cache_usage_perc (a fraction despite the name); older
    # releases gpu_cache_usage_perc.
    usage = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    stats: dict[str, Any] = {v: 0 for v in counts.values()}
    kv_usage: list[float] = []
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in counts and name not in usage:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        if not math.isfinite(value):
            continue
        if name in counts:
            stats[counts[name]] += int(value)
        else:
            kv_usage.append(value)
    if kv_usage:
        # One series per engine core (data parallel): the fullest one decides.
        stats["kv_usage"] = min(max(max(kv_usage), 0.0), 1.0)
    return stats


def engine_load(url: str, inflight: int, timeout_s: float = 2.0) -> dict[str, Any]:
    """Load stats of the engine the connector runs in: its metrics when its API
    server answers them, else the connector's own count of requests in flight."""
    try:
        stats = metrics_load(url, timeout_s)
    except (OSError, ValueError) as err:
        logger.debug("engine metrics unavailable (%s); reporting in-flight only", err)
        return {"running": inflight}
    stats["running"] = max(int(stats.get("running", 0)), inflight)
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m connex.agent", description="Register an engine with a Connex router."
    )
    parser.add_argument("--router", required=True, help="router base URL")
    parser.add_argument("--role", required=True, choices=ROLES)
    parser.add_argument("--url", required=True, help="the engine's base URL")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--ctrl", help="host:port of the engine's hold control listener")
    parser.add_argument("--id", dest="instance_id", help="instance id (default: router picks)")
    parser.add_argument(
        "--token-file",
        help=f"file holding the registration bearer token (default: env {REGISTER_TOKEN_ENV})",
    )
    parser.add_argument(
        "--kv-events",
        help="the engine's ZMQ KV event endpoint (vLLM --kv-events-config), forwarded to "
        "the router",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    agent = Agent(
        args.router,
        args.role,
        args.url,
        args.model,
        ctrl=args.ctrl,
        instance_id=args.instance_id,
        token=read_secret(file=args.token_file, env=REGISTER_TOKEN_ENV),
        deregister_file=os.environ.get(DEREGISTER_FILE_ENV),
        kv_events=args.kv_events,
    )
    agent.start_kv_events()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent._stop.set())
    agent.run()
    if agent.kv_events is not None:
        agent.kv_events.stop()
    agent.deregister()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
