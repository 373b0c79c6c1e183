"""The helm chart renders with a real helm, every manifest is valid against the
Kubernetes schemas (offline, kubernetes-validate), and what it renders is what an
operator needs: router replicas with probes and config, etcd, vLLM pools whose
ConnexConnector registers them. The rendered router config is accepted by the
real connex-router binary."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from connex_harness import ROOT, binary, router_args

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
    [
        (),
        POOLS,
        ("etcd.enabled=false", "router.replicas=1"),
        ("etcd.replicas=3", *POOLS),
        ("router.autoscaling.enabled=true", "metrics.dashboards.enabled=true", *POOLS),
        (
            "etcd.networkPolicy.scraper.podSelector.matchLabels.app=prometheus",
            "vllm.tensorParallelSize=2",
            *POOLS,
        ),
        ("etcd.enabled=false", "etcd.external=https://etcd:2379", "etcd.tls.clientSecret=c"),
        ("responseStore.redis.enabled=true", *POOLS),
    ],
    ids=[
        "defaults",
        "pools",
        "no-etcd",
        "etcd-quorum",
        "autoscaling-dashboards",
        "scraper-tp2",
        "external-etcd",
        "response-store",
    ],
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
    assert "--etcd=https://rel-connex-etcd:2379" in c["args"]
    assert "--etcd-prefix=/connex" in c["args"]
    assert "--admin-token-file=/etc/connex/secrets/admin-token" in c["args"]
    admin = secret_source(router, "admin-token")
    secret = find(docs, "Secret", admin["name"])
    assert secret["data"][admin["items"][0]["key"]]
    config = find(docs, "ConfigMap", "rel-connex-router")["data"]["router.toml"]
    assert 'decode_policy = "power_of_two"' in config
    etcd = find(docs, "StatefulSet", "rel-connex-etcd")
    assert etcd["spec"]["replicas"] == 1
    internal = find(docs, "Service", "rel-connex-router-internal")
    assert internal["spec"]["publishNotReadyAddresses"] is True


def secret_source(router: dict, path: str) -> dict:
    """The projected Secret source that mounts `path` in the router's secrets volume."""
    volumes = router["spec"]["template"]["spec"]["volumes"]
    projected = next(v for v in volumes if v["name"] == "secrets")["projected"]["sources"]
    return next(s["secret"] for s in projected if s["secret"]["items"][0]["path"] == path)


def test_an_existing_secret_is_used_and_none_is_made():
    docs = manifests(
        "router.adminToken.existingSecret=ops-token",
        "router.registerToken.existingSecret=ops-register",
        "router.transferSecret.existingSecret=ops-transfer",
    )
    router = find(docs, "Deployment", "rel-connex-router")
    assert secret_source(router, "admin-token")["name"] == "ops-token"
    assert secret_source(router, "register-token")["name"] == "ops-register"
    assert secret_source(router, "transfer-secret")["name"] == "ops-transfer"
    # Only etcd's certificates are made (etcd.tls: their own test below).
    made = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    assert made == ["rel-connex-etcd-client", "rel-connex-etcd-server"]


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
        assert extra["router"] == "http://rel-connex-router-internal:8001"
        # Kubernetes expands $(VAR) in args from the container's env; the
        # connector puts the host into the URL, bracketed on an IPv6 pod.
        assert (extra["url"], extra["host"]) == ("http://{host}:8100", "$(POD_IP)")
        # The token stays out of argv (ps, vLLM's startup log): the agent
        # reads it from its environment.
        assert "register_token" not in extra
        # GPU pods with the tcp backend: KV moves through host memory.
        assert (extra["backend"], extra["hold"]) == ("tcp", "staged")
        assert extra["hold_budget_bytes"] == 8 << 30
        assert "reg" not in json.dumps(ktc).replace("register", "")
        env = {e["name"] for e in c["env"]}
        assert {"POD_IP", "POD_NAME", "CONNEX_REGISTER_TOKEN"} <= env
        # Decoders serve vLLM's tokens API: the router resumes chats through it.
        assert ("--enable-scale-out" in args) == (pool == "decode")
    assert find(docs, "Deployment", "rel-connex-decode")["spec"]["replicas"] == 4
    off = manifests(*POOLS, "vllm.scaleOut=false")
    assert (
        "--enable-scale-out" not in container(find(off, "Deployment", "rel-connex-decode"))["args"]
    )


def test_a_transfer_secret_reaches_the_routers_and_every_engine():
    docs = manifests(*POOLS, "router.transferSecret.value=kv-s3cret")
    secret = find(docs, "Secret", "rel-connex-transfer")
    assert secret["data"]["transfer-secret"] == "a3YtczNjcmV0"  # base64 of kv-s3cret
    for name in ("rel-connex-prefill", "rel-connex-decode"):
        env = container(find(docs, "Deployment", name))["env"]
        entry = next(e for e in env if e["name"] == "CONNEX_TRANSFER_SECRET")
        ref = entry["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("rel-connex-transfer", "transfer-secret"), name
    router = find(docs, "Deployment", "rel-connex-router")
    assert secret_source(router, "transfer-secret")["name"] == "rel-connex-transfer"
    assert "--transfer-secret-file=/etc/connex/secrets/transfer-secret" in container(router)["args"]


def test_the_register_token_and_transfer_secret_are_generated_by_default():
    docs = manifests(*POOLS)
    for name, key in (
        ("rel-connex-register", "register-token"),
        ("rel-connex-transfer", "transfer-secret"),
    ):
        secret = find(docs, "Secret", name)
        assert len(base64.b64decode(secret["data"][key])) == 32, name
    router = find(docs, "Deployment", "rel-connex-router")
    args = container(router)["args"]
    assert "--register-token-file=/etc/connex/secrets/register-token" in args
    # No secret value in any container's argv or plain env.
    for workload in [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]:
        for c in workload["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                if "TOKEN" in e["name"] or "SECRET" in e["name"]:
                    assert "valueFrom" in e, (workload["metadata"]["name"], e)
    for name in ("rel-connex-prefill", "rel-connex-decode"):
        env = {e["name"]: e for e in container(find(docs, "Deployment", name))["env"]}
        ref = env["CONNEX_REGISTER_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "rel-connex-register"
        assert "CONNEX_TRANSFER_SECRET" in env


def test_two_services_and_a_network_policy_guard_the_internal_listener():
    docs = manifests(*POOLS)
    client = find(docs, "Service", "rel-connex-router")
    assert [(p["port"], p["targetPort"]) for p in client["spec"]["ports"]] == [(8000, "http")]
    internal = find(docs, "Service", "rel-connex-router-internal")
    assert [(p["port"], p["targetPort"]) for p in internal["spec"]["ports"]] == [(8001, "internal")]
    router = container(find(docs, "Deployment", "rel-connex-router"))
    assert "--internal-listen=0.0.0.0:8001" in router["args"]
    assert {p["name"]: p["containerPort"] for p in router["ports"]} == {
        "http": 8000,
        "internal": 8001,
    }
    policy = find(docs, "NetworkPolicy", "rel-connex-router")
    rules = {r["ports"][0]["port"]: r for r in policy["spec"]["ingress"]}
    assert "from" not in rules["http"], "clients reach the client port from anywhere"
    peers = rules["internal"]["from"]
    components = [
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for p in peers
        if "podSelector" in p
    ]
    assert components == ["prefill", "decode"]
    scrapers = [p for p in peers if "namespaceSelector" in p]
    assert scrapers == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert len(peers) == 3, peers
    off = manifests("router.networkPolicy.enabled=false")
    assert "rel-connex-router" not in [
        d["metadata"]["name"] for d in off if d["kind"] == "NetworkPolicy"
    ]


def test_the_router_drains_within_its_termination_grace():
    docs = manifests("router.shutdownGraceS=40", "router.preStopSleepS=7")
    spec = find(docs, "Deployment", "rel-connex-router")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert "--shutdown-grace-s=40" in c["args"]
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 7}}
    assert spec["terminationGracePeriodSeconds"] >= 40 + 7


def test_bad_values_are_refused():
    no_model = render("vllm.prefill.enabled=true", check=False)
    assert no_model.returncode != 0 and "vllm.model is required" in no_model.stderr
    # A router on 0.0.0.0 refuses to register an engine on one of its ports.
    for port in (8000, 8001):
        clash = render(*POOLS, f"vllm.port={port}", check=False)
        assert clash.returncode != 0 and "a port of the routers' listeners" in clash.stderr
    shared = render("etcd.enabled=false", "router.replicas=2", check=False)
    assert shared.returncode != 0 and "needs shared membership" in shared.stderr


@pytest.mark.parametrize(
    "sets",
    [
        ("router.config.heartbeat_ttl_s=7", "router.config.max_tokens_limit=4096"),
        # Static instances (engines without the agent): lists become TOML arrays.
        (
            "router.config.decode={http://10.0.0.2:8200,http://10.0.0.3:8200}",
            "router.config.static_model=m",
        ),
    ],
    ids=["settings", "static_instances"],
)
def test_the_rendered_router_config_is_accepted_by_connex_router(tmp_path: Path, sets):
    docs = manifests(*sets)
    config = tmp_path / "router.toml"
    config.write_text(find(docs, "ConfigMap", "rel-connex-router")["data"]["router.toml"])
    proc = subprocess.Popen(
        [str(binary("connex-router")), *router_args(config=config, admin_token=None)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        # The internal listener's line comes first, then "listening on"; a
        # router that refused its config exits, ending stdout.
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert "internal API on" in lines[0], lines
        assert "listening on" in lines[1], lines
    finally:
        proc.kill()
        proc.wait()


def components(peers: list[dict]) -> list[str]:
    return [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers]


def test_engine_ports_admit_routers_on_vllm_and_hold_ports_and_engines_on_every_port():
    docs = manifests(*POOLS)
    for pool in ("prefill", "decode"):
        policy = find(docs, "NetworkPolicy", f"rel-connex-{pool}")
        selected = policy["spec"]["podSelector"]["matchLabels"]
        assert selected["app.kubernetes.io/component"] == pool
        serving, *hold, transfer = policy["spec"]["ingress"]
        assert serving["ports"] == [{"port": 8100, "protocol": "TCP"}]
        assert components(serving["from"]) == ["router"]
        # The routers call a prefill's hold control listener (stat before a
        # resume, renew, release: router/src/pd/holds/); decoders hold nothing.
        if pool == "prefill":
            assert hold == [
                {
                    "ports": [{"port": 14579, "protocol": "TCP"}],
                    "from": [serving["from"][0]],
                }
            ]
        else:
            assert hold == []
        # No port list: every port, but only from engine pods of the release.
        assert "ports" not in transfer
        assert components(transfer["from"]) == ["prefill", "decode"]
    off = manifests(*POOLS, "vllm.networkPolicy.enabled=false")
    assert not [
        d
        for d in off
        if d["kind"] == "NetworkPolicy"
        and d["metadata"]["name"] != "rel-connex-router"
        and d["metadata"]["name"] != "rel-connex-etcd"
    ]


def test_every_tp_rank_gets_its_hold_port_opened_to_the_routers():
    docs = manifests(*POOLS, "vllm.tensorParallelSize=4", "vllm.connector.kvPort=20000")
    prefill = container(find(docs, "Deployment", "rel-connex-prefill"))
    assert "--tensor-parallel-size=4" in prefill["args"]
    ports = {p["name"]: p["containerPort"] for p in prefill["ports"]}
    assert [ports[n] for n in ("kv-ctrl", "kv-ctrl-1", "kv-ctrl-2", "kv-ctrl-3")] == [
        20000,
        20001,
        20002,
        20003,
    ]
    _, hold, _ = find(docs, "NetworkPolicy", "rel-connex-prefill")["spec"]["ingress"]
    assert hold["ports"] == [{"port": 20000, "endPort": 20003, "protocol": "TCP"}]
    assert components(hold["from"]) == ["router"]
    for version in KUBE_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)
    # A TP size the policy does not know of would leave ranks unreachable.
    refused = render(*POOLS, "vllm.extraArgs={--tensor-parallel-size=2}", check=False)
    assert refused.returncode != 0 and "vllm.tensorParallelSize" in refused.stderr


def test_etcd_admits_only_the_routers_and_only_with_a_client_certificate(tmp_path: Path):
    docs = manifests(*POOLS, "etcd.replicas=3")
    policy = find(docs, "NetworkPolicy", "rel-connex-etcd")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "etcd"
    client, peer = policy["spec"]["ingress"]
    assert (client["ports"], components(client["from"])) == (
        [{"port": "client", "protocol": "TCP"}],
        ["router"],
    )
    assert (peer["ports"], components(peer["from"])) == (
        [{"port": "peer", "protocol": "TCP"}],
        ["etcd"],
    )
    etcd = find(docs, "StatefulSet", "rel-connex-etcd")
    c = container(etcd)
    args = c["args"]
    assert "--listen-client-urls=https://0.0.0.0:2379" in args
    assert "--client-cert-auth=true" in args and "--peer-client-cert-auth=true" in args
    assert "--trusted-ca-file=/etc/etcd/tls/ca.crt" in args
    assert all("http://" not in a for a in args if "cluster=" in a or "peer-urls" in a)
    # Probes have no certificate: they use the plain metrics listener.
    assert "--listen-metrics-urls=http://0.0.0.0:2381" in args
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    volumes = etcd["spec"]["template"]["spec"]["volumes"]
    assert volumes == [
        {"name": "tls", "secret": {"secretName": "rel-connex-etcd-server", "defaultMode": 0o400}}
    ]
    router = find(docs, "Deployment", "rel-connex-router")
    args = container(router)["args"]
    assert "--etcd=https://rel-connex-etcd:2379" in args
    for flag, name in (("ca", "ca.crt"), ("cert", "tls.crt"), ("key", "tls.key")):
        assert f"--etcd-{flag}-file=/etc/connex/etcd/{name}" in args
    mount = next(m for m in container(router)["volumeMounts"] if m["name"] == "etcd-tls")
    assert mount["mountPath"] == "/etc/connex/etcd"
    volume = next(
        v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == "etcd-tls"
    )
    assert volume["secret"]["secretName"] == "rel-connex-etcd-client"
    # The generated certificates: both chain to one CA; etcd's names cover the
    # Service the routers dial and every member's peer name.
    files = {}
    for name in ("rel-connex-etcd-server", "rel-connex-etcd-client"):
        secret = find(docs, "Secret", name)
        assert secret["type"] == "kubernetes.io/tls"
        for key in ("ca.crt", "tls.crt", "tls.key"):
            path = tmp_path / f"{name}-{key}"
            path.write_bytes(base64.b64decode(secret["data"][key]))
            files[name, key] = path
    assert (
        files["rel-connex-etcd-server", "ca.crt"].read_bytes()
        == files["rel-connex-etcd-client", "ca.crt"].read_bytes()
    )
    for name in ("rel-connex-etcd-server", "rel-connex-etcd-client"):
        subprocess.run(
            ["openssl", "verify", "-CAfile", files[name, "ca.crt"], files[name, "tls.crt"]],
            check=True,
            capture_output=True,
        )
    text = subprocess.run(
        [
            "openssl",
            "x509",
            "-noout",
            "-ext",
            "subjectAltName",
            "-in",
            files["rel-connex-etcd-server", "tls.crt"],
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "DNS:rel-connex-etcd," in text and "DNS:*.rel-connex-etcd-peer.llm.svc," in text


def test_etcd_tls_secrets_can_be_named_and_external_etcd_needs_a_client_certificate():
    docs = manifests("etcd.tls.serverSecret=etcd-srv", "etcd.tls.clientSecret=etcd-cli")
    assert not [d for d in docs if d["kind"] == "Secret" and "etcd" in d["metadata"]["name"]]
    router = find(docs, "Deployment", "rel-connex-router")
    volume = next(
        v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == "etcd-tls"
    )
    assert volume["secret"]["secretName"] == "etcd-cli"
    etcd = find(docs, "StatefulSet", "rel-connex-etcd")
    assert etcd["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == "etcd-srv"
    one = render("etcd.tls.serverSecret=etcd-srv", check=False)
    assert one.returncode != 0 and "name both serverSecret and clientSecret" in one.stderr
    external = ("etcd.enabled=false", "etcd.external=https://etcd.ops:2379")
    refused = render(*external, check=False)
    assert refused.returncode != 0 and "etcd.tls.clientSecret" in refused.stderr
    docs = manifests(*external, "etcd.tls.clientSecret=ops-etcd")
    args = container(find(docs, "Deployment", "rel-connex-router"))["args"]
    assert (
        "--etcd=https://etcd.ops:2379" in args
        and "--etcd-cert-file=/etc/connex/etcd/tls.crt" in args
    )
    assert not [
        d
        for d in docs
        if d["kind"] in ("StatefulSet", "NetworkPolicy") and "etcd" in d["metadata"]["name"]
    ]
    plain = manifests("etcd.tls.enabled=false")
    args = container(find(plain, "Deployment", "rel-connex-router"))["args"]
    assert "--etcd=http://rel-connex-etcd:2379" in args
    assert not [a for a in args if a.startswith("--etcd-ca-file")]
    # The NetworkPolicy stays: etcd is still for the routers alone.
    assert find(plain, "NetworkPolicy", "rel-connex-etcd")


def test_decoders_recompute_a_prompt_whose_kv_they_cannot_load():
    docs = manifests(*POOLS)
    for pool, policy in (("prefill", None), ("decode", "recompute")):
        args = container(find(docs, "Deployment", f"rel-connex-{pool}"))["args"]
        ktc = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert ktc.get("kv_load_failure_policy") == policy, pool
    docs = manifests(*POOLS, "vllm.connector.loadFailurePolicy=fail")
    args = container(find(docs, "Deployment", "rel-connex-decode"))["args"]
    assert (
        json.loads(args[args.index("--kv-transfer-config") + 1])["kv_load_failure_policy"] == "fail"
    )


def memory_request(docs: list[dict], pool: str) -> int:
    return int(
        container(find(docs, "Deployment", f"rel-connex-{pool}"))["resources"]["requests"]["memory"]
    )


def test_prefill_memory_requests_cover_the_staged_hold_budget():
    gib = 1 << 30
    docs = manifests(*POOLS)
    assert memory_request(docs, "prefill") == 16 * gib + 8 * gib
    assert memory_request(docs, "decode") == 16 * gib
    docs = manifests(*POOLS, "vllm.hostMemory=20Gi", "vllm.connector.holdBudgetBytes=4294967296")
    assert memory_request(docs, "prefill") == 24 * gib
    # In-place holds keep GPU blocks: no host memory for them.
    docs = manifests(
        *POOLS,
        "vllm.connector.hold=in_place",
        "vllm.image.backends={tcp,ucx}",
        "vllm.connector.backend=ucx",
    )
    assert memory_request(docs, "prefill") == 16 * gib
    # A pool's own request stands when it covers the budget, and is refused otherwise.
    docs = manifests(*POOLS, "vllm.prefill.resources.requests.memory=64Gi")
    assert (
        container(find(docs, "Deployment", "rel-connex-prefill"))["resources"]["requests"]["memory"]
        == "64Gi"
    )
    small = render(*POOLS, "vllm.prefill.resources.requests.memory=4Gi", check=False)
    assert small.returncode != 0 and "below vllm.connector.holdBudgetBytes" in small.stderr
    odd = render(*POOLS, "vllm.prefill.resources.requests.memory=1.5Ti", check=False)
    assert odd.returncode != 0 and "not a memory quantity" in odd.stderr
    uncapped = render(*POOLS, "vllm.connector.holdBudgetBytes=0", check=False)
    assert uncapped.returncode != 0 and "holdBudgetBytes must be above 0" in uncapped.stderr


def test_a_backend_the_image_lacks_is_refused():
    for backend in ("ucx", "mooncake"):
        refused = render(*POOLS, f"vllm.connector.backend={backend}", check=False)
        assert refused.returncode != 0, backend
        assert "vllm.image.backends" in refused.stderr and f"--features {backend}" in refused.stderr
    docs = manifests(*POOLS, "vllm.connector.backend=ucx", "vllm.image.backends={tcp,ucx}")
    args = container(find(docs, "Deployment", "rel-connex-prefill"))["args"]
    assert (
        json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"][
            "backend"
        ]
        == "ucx"
    )


def test_the_router_runs_as_the_images_user_and_can_read_its_secrets():
    dockerfile = (ROOT / "docker" / "router.Dockerfile").read_text()
    user = next(line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER "))
    uid, gid = (int(x) for x in user.split(":"))
    spec = find(manifests(), "Deployment", "rel-connex-router")["spec"]["template"]["spec"]
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": gid,
        # Secret files are 0400: readable by the router through its group.
        "fsGroup": gid,
    }
    assert "runAsUser" not in spec["containers"][0]["securityContext"]


def test_the_router_log_format_reaches_the_router():
    docs = manifests("router.logFormat=json", "router.log=debug")
    env = {
        e["name"]: e.get("value")
        for e in container(find(docs, "Deployment", "rel-connex-router"))["env"]
    }
    assert env["CONNEX_LOG_FORMAT"] == "json"
    assert env["CONNEX_LOG"] == "debug"


def test_the_router_runs_without_transparent_huge_pages():
    # On a node whose THP setting is `always`, huge pages multiply the
    # router's memory per in-flight stream (docs/bench.md, "scale").
    env = {
        e["name"]: e.get("value")
        for e in container(find(manifests(), "Deployment", "rel-connex-router"))["env"]
    }
    assert env["MIMALLOC_ALLOW_THP"] == "0"


def test_router_autoscaling_replaces_the_replica_count():
    docs = manifests("router.autoscaling.enabled=true", "router.autoscaling.maxReplicas=6")
    hpa = find(docs, "HorizontalPodAutoscaler", "rel-connex-router")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "rel-connex-router"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert "replicas" not in find(docs, "Deployment", "rel-connex-router")["spec"]
    assert not [d for d in manifests() if d["kind"] == "HorizontalPodAutoscaler"]
    refused = render("router.autoscaling.enabled=true", "etcd.enabled=false", check=False)
    assert refused.returncode != 0 and "needs shared membership" in refused.stderr


def test_a_service_monitor_scrapes_the_internal_listener():
    docs = manifests(
        "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=kps"
    )
    monitor = find(docs, "ServiceMonitor", "rel-connex-router")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["endpoints"] == [
        {"port": "internal", "path": "/metrics", "interval": "30s"}
    ]
    # It selects the internal Service only.
    selected = [
        d["metadata"]["name"]
        for d in docs
        if d["kind"] == "Service"
        and monitor["spec"]["selector"]["matchLabels"].items() <= d["metadata"]["labels"].items()
    ]
    assert selected == ["rel-connex-router-internal"]
    assert not [d for d in manifests() if d["kind"] == "ServiceMonitor"]


def test_the_dashboards_ship_in_a_configmap_for_grafana():
    docs = manifests("metrics.dashboards.enabled=true")
    config = find(docs, "ConfigMap", "rel-connex-dashboards")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config["data"]["connex-router.json"])
    assert dashboard["uid"] == "connex-router" and dashboard["panels"]


def spread(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})


def test_pods_spread_over_nodes_by_default_and_on_demand():
    docs = manifests(*POOLS)
    for name in ("rel-connex-router", "rel-connex-prefill", "rel-connex-decode"):
        term = spread(find(docs, "Deployment", name))[
            "preferredDuringSchedulingIgnoredDuringExecution"
        ][0]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        component = name.removeprefix("rel-connex-")
        assert (
            term["podAffinityTerm"]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"]
            == component
        )
    docs = manifests(*POOLS, "router.podAntiAffinity=hard", "vllm.podAntiAffinity=none")
    assert "requiredDuringSchedulingIgnoredDuringExecution" in spread(
        find(docs, "Deployment", "rel-connex-router")
    )
    assert spread(find(docs, "Deployment", "rel-connex-decode")) == {}
    bad = render("router.podAntiAffinity=sometimes", check=False)
    assert bad.returncode != 0 and "soft, hard or none" in bad.stderr


def test_extra_env_and_volumes_reach_the_router_and_the_pools(tmp_path: Path):
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "router": {
                    "extraEnv": [{"name": "RUST_BACKTRACE", "value": "1"}],
                    "extraVolumes": [{"name": "tmp", "emptyDir": {}}],
                    "extraVolumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                },
                "vllm": {
                    "extraEnv": [
                        {
                            "name": "HF_TOKEN",
                            "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}},
                        }
                    ],
                    "extraVolumes": [
                        {"name": "models", "persistentVolumeClaim": {"claimName": "cache"}}
                    ],
                    "extraVolumeMounts": [
                        {"name": "models", "mountPath": "/root/.cache/huggingface"}
                    ],
                    "decode": {"extraEnv": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]},
                },
            }
        )
    )
    docs = values_manifests(values, *POOLS)
    router = find(docs, "Deployment", "rel-connex-router")
    assert {"name": "RUST_BACKTRACE", "value": "1"} in container(router)["env"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container(router)["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in router["spec"]["template"]["spec"]["volumes"]
    for pool in ("prefill", "decode"):
        workload = find(docs, "Deployment", f"rel-connex-{pool}")
        env = {e["name"] for e in container(workload)["env"]}
        assert "HF_TOKEN" in env
        assert ("VLLM_LOGGING_LEVEL" in env) == (pool == "decode")
        mounts = container(workload)["volumeMounts"]
        assert {"name": "models", "mountPath": "/root/.cache/huggingface"} in mounts
        volumes = workload["spec"]["template"]["spec"]["volumes"]
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "cache"}} in volumes
    for version in KUBE_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def values_manifests(values: Path, *sets: str) -> list[dict]:
    args = [HELM, "template", "rel", str(CHART), "--namespace", "llm", "--values", str(values)]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_vllm_pools_probe_model_load_and_deregister_before_stopping():
    docs = manifests(
        *POOLS,
        "vllm.probes.startup.failureThreshold=180",
        "vllm.preStop.drainS=45",
        "vllm.decode.resources.requests.memory=64Gi",
    )
    for pool in ("prefill", "decode"):
        workload = find(docs, "Deployment", f"rel-connex-{pool}")
        c = container(workload)
        assert c["startupProbe"]["httpGet"]["path"] == "/health"
        assert c["startupProbe"]["failureThreshold"] == 180
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        # preStop creates the file the agent watches, then waits the drain.
        assert f"touch {env['CONNEX_DEREGISTER_FILE']}" in command[-1]
        assert "sleep 45" in command[-1]
        assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 45
    decode = container(find(docs, "Deployment", "rel-connex-decode"))
    assert decode["resources"]["requests"]["memory"] == "64Gi"
    off = container(
        find(manifests(*POOLS, "vllm.preStop.enabled=false"), "Deployment", "rel-connex-decode")
    )
    assert "lifecycle" not in off
    assert "CONNEX_DEREGISTER_FILE" not in {e["name"] for e in off["env"]}


def test_the_otlp_endpoint_reaches_the_router():
    docs = manifests("router.otlpEndpoint=http://otel:4318")
    env = {
        e["name"]: e.get("value")
        for e in container(find(docs, "Deployment", "rel-connex-router"))["env"]
    }
    assert env["CONNEX_OTLP_ENDPOINT"] == "http://otel:4318"
    env = {
        e["name"] for e in container(find(manifests(), "Deployment", "rel-connex-router"))["env"]
    }
    assert "CONNEX_OTLP_ENDPOINT" not in env


def test_client_keys_and_tenants_come_from_a_secret_the_router_reloads():
    docs = manifests(
        "router.clientAuth.existingSecret=team-keys",
        "router.clientAuth.tenantsKey=tenants.toml",
    )
    router = find(docs, "Deployment", "rel-connex-router")
    c = container(router)
    assert "--api-key-file=/etc/connex/clients/api-key" in c["args"]
    assert "--tenants-file=/etc/connex/clients/tenants.toml" in c["args"]
    volumes = router["spec"]["template"]["spec"]["volumes"]
    volume = next(v for v in volumes if v["name"] == "clients")
    assert volume["secret"]["secretName"] == "team-keys"
    assert {i["path"] for i in volume["secret"]["items"]} == {"api-key", "tenants.toml"}
    # Mounted whole (a subPath mount would never see the Secret's updates).
    mount = next(m for m in c["volumeMounts"] if m["name"] == "clients")
    assert mount["mountPath"] == "/etc/connex/clients" and "subPath" not in mount
    # By default the client routes take no key, and nothing is mounted.
    plain = container(find(manifests(), "Deployment", "rel-connex-router"))
    assert not any(a.startswith(("--api-key", "--tenants-file")) for a in plain["args"])


def test_the_release_redis_is_the_routers_response_store_and_theirs_alone():
    docs = manifests(*POOLS, "responseStore.redis.enabled=true", "responseStore.leaseMs=1500")
    router = find(docs, "Deployment", "rel-connex-router")
    args = container(router)["args"]
    assert "--response-store=redis://rel-connex-redis:6379" in args
    assert "--response-lease-ms=1500" in args
    # The password as a file from the Secret the chart made, never in argv.
    assert "--response-store-password-file=/etc/connex/response-store/password" in args
    assert all("requirepass" not in a for a in args)
    volumes = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    assert volumes["response-store"]["secret"]["secretName"] == "rel-connex-redis"
    secret = find(docs, "Secret", "rel-connex-redis")
    assert len(secret["data"]["password"]) > 20
    redis = find(docs, "StatefulSet", "rel-connex-redis")
    c = container(redis)
    assert c["env"][0]["valueFrom"]["secretKeyRef"] == {
        "name": "rel-connex-redis",
        "key": "password",
    }
    assert "$(REDIS_PASSWORD)" in c["args"] and "noeviction" in c["args"]
    assert c["args"][c["args"].index("--appendonly") + 1] == "yes"
    policy = find(docs, "NetworkPolicy", "rel-connex-redis")
    (ingress,) = policy["spec"]["ingress"]
    assert components(ingress["from"]) == ["router"]
    assert ingress["ports"] == [{"port": "redis", "protocol": "TCP"}]


def test_an_external_response_store_takes_a_url_without_a_password():
    docs = manifests(
        *POOLS,
        "responseStore.external=rediss://redis.example:6380/2",
        "responseStore.password.existingSecret=redis-pw",
    )
    router = find(docs, "Deployment", "rel-connex-router")
    args = container(router)["args"]
    assert "--response-store=rediss://redis.example:6380/2" in args
    volumes = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    assert volumes["response-store"]["secret"]["secretName"] == "redis-pw"
    assert not [d for d in docs if d["metadata"]["name"] == "rel-connex-redis"]
    # Without one, no shared store: each replica keeps its own.
    default = find(manifests(*POOLS), "Deployment", "rel-connex-router")
    assert all("--response-store" not in a for a in container(default)["args"])
    for bad in (
        ["responseStore.external=redis://:secret@redis:6379"],
        ["responseStore.external=http://redis:6379"],
        ["responseStore.external=redis://redis:6379", "responseStore.redis.enabled=true"],
    ):
        failed = render(*POOLS, *bad, check=False)
        assert failed.returncode != 0 and "responseStore" in failed.stderr, bad
