"""The helm chart renders with a real helm, every manifest is valid against the
Kubernetes schemas (offline, kubernetes-validate), and what it renders is what an
operator needs: router replicas with probes and config, etcd, vLLM pools whose
ConnexConnector registers them. The rendered router config is accepted by the
real connex-router binary."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from conftest import BIN_DIR, ROOT

CHART = ROOT / "helm" / "connex"
HELM = os.environ.get("HELM", str(ROOT / ".venv" / "bin" / "helm"))
KUBE_VERSIONS = ("1.29.0", "1.33.0")


def render(*sets: str, check: bool = True) -> subprocess.CompletedProcess:
    args = [HELM, "template", "rel", str(CHART), "--namespace", "llm"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, check=check)


def manifests(*sets: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(render(*sets).stdout) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {[(d['kind'], d['metadata']['name']) for d in docs]}"
    return matches[0]


def container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


POOLS = ("vllm.prefill.enabled=true", "vllm.decode.enabled=true", "vllm.model=Qwen/Qwen3-0.6B")


def test_helm_lint_passes():
    subprocess.run([HELM, "lint", "--strict", str(CHART)], check=True, capture_output=True)
    subprocess.run([HELM, "lint", "--strict", str(CHART), "--set", ",".join(POOLS)], check=True)


@pytest.mark.parametrize(
    "sets",
    [(), POOLS, ("etcd.enabled=false", "router.replicas=1"), ("etcd.replicas=3", *POOLS)],
    ids=["defaults", "pools", "no-etcd", "etcd-quorum"],
)
def test_every_manifest_is_valid_kubernetes(sets):
    docs = manifests(*sets)
    assert docs
    for version in KUBE_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def test_router_deployment_replicas_probes_config_and_token():
    docs = manifests("router.replicas=3", "router.config.decode_policy=power_of_two")
    router = find(docs, "Deployment", "rel-connex-router")
    assert router["spec"]["replicas"] == 3
    c = container(router)
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "--etcd=http://rel-connex-etcd:2379" in c["args"]
    assert "--etcd-prefix=/connex" in c["args"]
    token = next(e for e in c["env"] if e["name"] == "CONNEX_ADMIN_TOKEN")
    ref = token["valueFrom"]["secretKeyRef"]
    secret = find(docs, "Secret", ref["name"])
    assert secret["data"][ref["key"]]
    config = find(docs, "ConfigMap", "rel-connex-router")["data"]["router.toml"]
    assert 'decode_policy = "power_of_two"' in config
    etcd = find(docs, "StatefulSet", "rel-connex-etcd")
    assert etcd["spec"]["replicas"] == 1
    internal = find(docs, "Service", "rel-connex-router-internal")
    assert internal["spec"]["publishNotReadyAddresses"] is True


def test_an_existing_secret_is_used_and_none_is_made():
    docs = manifests("router.adminToken.existingSecret=ops-token")
    c = container(find(docs, "Deployment", "rel-connex-router"))
    token = next(e for e in c["env"] if e["name"] == "CONNEX_ADMIN_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "ops-token"
    assert not [d for d in docs if d["kind"] == "Secret"]


def test_vllm_pools_use_the_connex_connector_and_register_with_the_routers():
    docs = manifests(*POOLS, "vllm.decode.replicas=4", "router.registerToken.value=reg")
    for pool, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        workload = find(docs, "Deployment", f"rel-connex-{pool}")
        c = container(workload)
        args = c["args"]
        assert args[0] == "Qwen/Qwen3-0.6B"
        ktc = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert ktc["kv_connector"] == "ConnexConnector"
        assert ktc["kv_connector_module_path"] == "connex.adapters.vllm.pd_connector"
        assert ktc["kv_role"] == role
        extra = ktc["kv_connector_extra_config"]
        assert extra["router"] == "http://rel-connex-router-internal:8000"
        # Kubernetes expands $(VAR) in args from the container's env.
        assert extra["url"] == "http://$(POD_IP):8000"
        assert extra["register_token"] == "$(CONNEX_REGISTER_TOKEN)"
        env = {e["name"] for e in c["env"]}
        assert {"POD_IP", "POD_NAME", "CONNEX_REGISTER_TOKEN"} <= env
    assert find(docs, "Deployment", "rel-connex-decode")["spec"]["replicas"] == 4


def test_a_transfer_secret_reaches_the_routers_and_every_engine():
    docs = manifests(*POOLS, "router.transferSecret.value=kv-s3cret")
    secret = find(docs, "Secret", "rel-connex-transfer")
    assert secret["data"]["transfer-secret"] == "a3YtczNjcmV0"  # base64 of kv-s3cret
    for name in ("rel-connex-router", "rel-connex-prefill", "rel-connex-decode"):
        env = container(find(docs, "Deployment", name))["env"]
        entry = next(e for e in env if e["name"] == "CONNEX_TRANSFER_SECRET")
        ref = entry["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("rel-connex-transfer", "transfer-secret"), name
    # None by default: no Secret, no variable.
    docs = manifests(*POOLS)
    assert not [d for d in docs if d["metadata"]["name"] == "rel-connex-transfer"]
    env = container(find(docs, "Deployment", "rel-connex-decode"))["env"]
    assert "CONNEX_TRANSFER_SECRET" not in {e["name"] for e in env}


def test_bad_values_are_refused():
    no_model = render("vllm.prefill.enabled=true", check=False)
    assert no_model.returncode != 0 and "vllm.model is required" in no_model.stderr
    shared = render("etcd.enabled=false", "router.replicas=2", check=False)
    assert shared.returncode != 0 and "needs shared membership" in shared.stderr


def test_the_rendered_router_config_is_accepted_by_connex_router(tmp_path: Path):
    docs = manifests("router.config.heartbeat_ttl_s=7", "router.config.max_tokens_limit=4096")
    config = tmp_path / "router.toml"
    config.write_text(find(docs, "ConfigMap", "rel-connex-router")["data"]["router.toml"])
    proc = subprocess.Popen(
        [
            str(BIN_DIR / "connex-router"),
            "serve",
            "--config",
            str(config),
            "--listen",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        proc.wait()
