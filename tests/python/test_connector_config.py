"""The connector's settings: secrets come from the environment or files, so that
none has to sit in --kv-transfer-config (visible in `ps` and vLLM's startup log)."""

from __future__ import annotations

import logging

import pytest
from connex.adapters.vllm.config import ConfigError, ConnexConfig


@pytest.fixture(autouse=True)
def no_secrets_in_env(monkeypatch):
    monkeypatch.delenv("CONNEX_REGISTER_TOKEN", raising=False)
    monkeypatch.delenv("CONNEX_TRANSFER_SECRET", raising=False)


def test_register_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("CONNEX_REGISTER_TOKEN", "env-token")
    assert ConnexConfig.from_extra({}, 14579).register_token == "env-token"


def test_secrets_come_from_files(tmp_path):
    token, secret = tmp_path / "token", tmp_path / "secret"
    token.write_text("file-token\n")
    secret.write_text("file-secret\n")
    cfg = ConnexConfig.from_extra(
        {"register_token_file": str(token), "transfer_secret_file": str(secret)}, 14579
    )
    assert (cfg.register_token, cfg.transfer_secret) == ("file-token", "file-secret")


def test_a_file_wins_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CONNEX_REGISTER_TOKEN", "env-token")
    token = tmp_path / "token"
    token.write_text("file-token")
    cfg = ConnexConfig.from_extra({"register_token_file": str(token)}, 14579)
    assert cfg.register_token == "file-token"


def test_without_a_transfer_secret_the_bindings_read_the_environment():
    # None tells connex._transfer to take CONNEX_TRANSFER_SECRET itself.
    assert ConnexConfig.from_extra({}, 14579).transfer_secret is None


def test_a_missing_or_empty_secret_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="missing"):
        ConnexConfig.from_extra({"transfer_secret_file": str(tmp_path / "missing")}, 14579)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        ConnexConfig.from_extra({"register_token_file": str(empty)}, 14579)


def test_inline_secrets_still_work_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="connex.vllm.config"):
        cfg = ConnexConfig.from_extra({"register_token": "t", "transfer_secret": "s"}, 14579)
    assert (cfg.register_token, cfg.transfer_secret) == ("t", "s")
    assert "CONNEX_REGISTER_TOKEN" in caplog.text and "CONNEX_TRANSFER_SECRET" in caplog.text


def test_holds_are_staged_unless_in_place_is_asked_for():
    assert ConnexConfig.from_extra({}, 14579).hold == "staged"
    for mode in ("staged", "in_place"):
        assert ConnexConfig.from_extra({"hold": mode}, 14579).hold == mode


def test_an_unknown_hold_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="hold must be one of"):
        ConnexConfig.from_extra({"hold": "pinned"}, 14579)


@pytest.mark.parametrize(
    ("backend", "env", "published"),
    [
        # No address in the environment: the connector's host, not loopback.
        ("mooncake", {}, "10.1.2.3"),
        # A wildcard bind address says where to listen, not where to be reached.
        ("mooncake", {"MC_TCP_BIND_ADDRESS": "0.0.0.0"}, "10.1.2.3"),
        # What the environment says wins (the transfer crate reads it).
        ("mooncake", {"CONNEX_MOONCAKE_HOST": "10.9.9.9"}, None),
        ("mooncake", {"MC_TCP_BIND_ADDRESS": "10.8.8.8"}, None),
        # Other backends have no segment names.
        ("tcp", {}, None),
    ],
)
def test_mooncake_publishes_the_connectors_host(backend, env, published):
    cfg = ConnexConfig.from_extra({"backend": backend, "host": "10.1.2.3"}, 14579)
    environ = dict(env)
    assert cfg.publish_mooncake_host(environ) == published
    want = env.get("CONNEX_MOONCAKE_HOST", published)
    assert environ.get("CONNEX_MOONCAKE_HOST") == want


@pytest.mark.parametrize(
    ("host", "url", "ctrl"),
    [
        ("10.1.2.3", "http://10.1.2.3:8000", "10.1.2.3:14579"),
        ("fd00:10::7", "http://[fd00:10::7]:8000", "[fd00:10::7]:14579"),
        ("engine-0.pool", "http://engine-0.pool:8000", "engine-0.pool:14579"),
    ],
)
def test_the_url_and_hold_address_are_ipv6_safe(host, url, ctrl):
    """The chart's one form (`http://{host}:8000`, host the pod's IP) is a URL on
    IPv4 and IPv6 pods alike; the hold listener's address is bracketed too."""
    cfg = ConnexConfig.from_extra({"host": host, "url": "http://{host}:8000"}, 14579)
    assert (cfg.url, cfg.ctrl_addr()) == (url, ctrl)
    assert cfg.ctrl_addr(1).endswith(":14580")
