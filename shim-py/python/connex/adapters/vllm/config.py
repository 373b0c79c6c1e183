"""The connector's settings, read once from `kv_connector_extra_config`.

Keys: `backend` (tcp|ucx|mooncake, default tcp), `retain_s` (60), `release`
(on_release|after_pull), `host` (the address decoders reach this engine's hold
control listener at, default 127.0.0.1; with mooncake also the address its
engine publishes, see `publish_mooncake_host`), `ctrl_port` (that listener's port for TP
rank 0; rank r listens on ctrl_port + r; default: kv_port), `hold_budget_bytes`
(0: no cap; with staged holds, the host memory they may take), `hold`
(staged|in_place, default staged: whether a hold serves host copies of the
prompt blocks, which vLLM gets back right after the prompt step, or the blocks
themselves, kept until the hold ends; in place needs a backend that moves the
KV cache's memory, and measured slower on the CPU with many live holds,
docs/bench.md "stage"), `pull_timeout_s` (30), `idle_step_ms` (10: how long an engine
step that computes nothing waits while holds keep it stepping), and for
self-registration `router` (the router's registration URL: its internal
listener where it has one), `url` (this engine's HTTP base URL; `{host}` in
it is replaced by `host`, in brackets when that is an IPv6 address, so that one
form, e.g. the chart's `http://{host}:8000` with `host` the pod's IP, is a URL
on IPv4 and IPv6 pods alike), `instance_id`.

Secrets stay out of `--kv-transfer-config` (which `ps` and vLLM's startup log
show): the register token comes from the environment's CONNEX_REGISTER_TOKEN or
the file named by `register_token_file`; the transfer secret (what the hold
control listeners require of every peer, the same on every engine and the
router) from CONNEX_TRANSFER_SECRET or the file named by `transfer_secret_file`.
Inline `register_token` / `transfer_secret` values still work, with a warning.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from connex.credentials import REGISTER_TOKEN_ENV, TRANSFER_SECRET_ENV, read_secret

logger = logging.getLogger("connex.vllm.config")

BACKENDS = ("tcp", "ucx", "mooncake")
# What the Mooncake backend (in the transfer crate) reads when it starts its
# engine: the address peers reach this engine at, and Mooncake's own bind address.
MOONCAKE_HOST_ENV = "CONNEX_MOONCAKE_HOST"
MOONCAKE_BIND_ENV = "MC_TCP_BIND_ADDRESS"
WILDCARDS = ("", "0.0.0.0", "::")
RELEASE_MODES = ("on_release", "after_pull")
HOLD_MODES = ("staged", "in_place")


class ConfigError(ValueError):
    """A bad `kv_connector_extra_config` value."""


@dataclass(frozen=True)
class ConnexConfig:
    backend: str = "tcp"
    retain_s: float = 60.0
    release: str = "on_release"
    host: str = "127.0.0.1"
    ctrl_port: int = 14579
    hold_budget_bytes: int = 0
    hold: str = "staged"
    pull_timeout_s: float = 30.0
    idle_step_ms: float = 10.0
    router: str | None = None
    url: str | None = None
    instance_id: str | None = None
    register_token: str | None = None
    register_token_file: str | None = None
    # None: the transfer crate reads CONNEX_TRANSFER_SECRET itself.
    transfer_secret: str | None = None
    transfer_secret_file: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any], kv_port: int) -> ConnexConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys for ConnexConnector: {sorted(unknown)}"
            )
        values: dict[str, Any] = {"ctrl_port": kv_port, **extra}
        try:
            cfg = cls(
                backend=str(values.get("backend", "tcp")),
                retain_s=float(values.get("retain_s", 60.0)),
                release=str(values.get("release", "on_release")),
                host=str(values.get("host", "127.0.0.1")),
                ctrl_port=int(values["ctrl_port"]),
                hold_budget_bytes=int(values.get("hold_budget_bytes", 0)),
                hold=str(values.get("hold", "staged")),
                pull_timeout_s=float(values.get("pull_timeout_s", 30.0)),
                idle_step_ms=float(values.get("idle_step_ms", 10.0)),
                router=values.get("router"),
                url=_fill_host(values.get("url"), str(values.get("host", "127.0.0.1"))),
                instance_id=values.get("instance_id"),
                register_token=read_secret(
                    values.get("register_token"),
                    values.get("register_token_file"),
                    REGISTER_TOKEN_ENV,
                ),
                register_token_file=values.get("register_token_file"),
                transfer_secret=read_secret(
                    values.get("transfer_secret"), values.get("transfer_secret_file")
                ),
                transfer_secret_file=values.get("transfer_secret_file"),
            )
        except (TypeError, ValueError, OSError) as err:
            raise ConfigError(f"bad kv_connector_extra_config: {err}") from err
        for key, env in (
            ("register_token", REGISTER_TOKEN_ENV),
            ("transfer_secret", TRANSFER_SECRET_ENV),
        ):
            if extra.get(key):
                logger.warning(
                    "%s in --kv-transfer-config is visible in `ps` and the engine's log; "
                    "set %s or %s_file instead",
                    key,
                    env,
                    key,
                )
        if cfg.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, not {cfg.backend!r}")
        if cfg.release not in RELEASE_MODES:
            raise ConfigError(f"release must be one of {RELEASE_MODES}, not {cfg.release!r}")
        if cfg.hold not in HOLD_MODES:
            raise ConfigError(f"hold must be one of {HOLD_MODES}, not {cfg.hold!r}")
        if cfg.retain_s <= 0 or cfg.pull_timeout_s <= 0 or cfg.idle_step_ms < 0:
            raise ConfigError("retain_s, pull_timeout_s and idle_step_ms must be positive")
        if not 0 < cfg.ctrl_port < 65536:
            raise ConfigError(f"ctrl_port must be a TCP port, not {cfg.ctrl_port}")
        if cfg.router and not cfg.url:
            raise ConfigError("`router` needs `url` (this engine's HTTP base URL) to register")
        return cfg

    def ctrl_addr(self, tp_rank: int = 0) -> str:
        return f"{url_host(self.host)}:{self.ctrl_port + tp_rank}"

    def publish_mooncake_host(self, environ: MutableMapping[str, str] = os.environ) -> str | None:
        """Gives the Mooncake engine this engine's configured `host` (the address
        decoders reach it at) as the host of its segment name, unless the
        environment names one (CONNEX_MOONCAKE_HOST, else Mooncake's
        MC_TCP_BIND_ADDRESS): the transfer crate starts that engine with the
        Holder or Reader and reads only the environment, which without this
        would make it publish loopback. Returns the host it set, if any.
        (Where registered memory lives, Mooncake finds per buffer: host
        buffers and each GPU's KV cache alike; CONNEX_MOONCAKE_LOCATION pins it.)"""
        if self.backend != "mooncake":
            return None
        if environ.get(MOONCAKE_HOST_ENV, "").strip():
            return None
        if environ.get(MOONCAKE_BIND_ENV, "").strip() not in WILDCARDS:
            return None
        if self.host.strip() in WILDCARDS:
            return None
        environ[MOONCAKE_HOST_ENV] = self.host.strip()
        return self.host.strip()


def url_host(host: str) -> str:
    """`host` as it goes before `:port`: an IPv6 address in brackets."""
    host = host.strip()
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    except ValueError:
        pass
    return host


def _fill_host(url: object, host: str) -> str | None:
    """`url` with `{host}` filled in (bracketed when an IPv6 address); a
    missing url stays missing, and any other value is the config's error."""
    if url is None:
        return None
    if not isinstance(url, str):
        raise ConfigError("`url` must be a string")
    return url.replace("{host}", url_host(host))
