"""The chart's defaults under the chart's own NetworkPolicies, in real containers.

``helm template`` renders the chart (default values, both vLLM pools enabled);
each container plays one of its pods, with that pod's labels and ports: the
etcd member (run with the rendered arguments and the rendered TLS
certificates), two routers (the rendered arguments, config file, secrets and
etcd client certificate), a prefill and three decoders (mock engines on the
pools' ports: vLLM's and the hold control port), and an intruder, a pod of
the namespace that is none of the release's. ``netpol`` turns the rendered
NetworkPolicies into packet filters in each container. Then:

- a decoder killed mid-stream: the stream resumes on another decoder, which
  pulls the prompt's KV from the prefill's hold; the prefill computed the
  prompt once (its counters), so the router reached the hold's control port;
- the same under the pre-fix policy (routers admitted on vLLM's port only):
  the router finds the hold unreachable and prefills again. The test tells the
  two apart, so it would have caught the bug;
- the intruder reaches neither etcd nor the hold port nor the routers'
  internal listener; a decoder does not reach etcd; a client without the
  release's certificate is refused by etcd itself.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import ssl
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import netpol
import pytest
import yaml
from harness import (
    ENGINE_IMAGE,
    ETCD_IMAGE,
    ROOT,
    ROUTER_IMAGE,
    UNREACHABLE,
    Cluster,
    RouterHandle,
    build_images,
    docker,
    published_port,
    require_docker,
    stream_completion,
    wait_for,
    wait_sees,
)

HELM = os.environ.get("HELM", str(ROOT / ".venv" / "bin" / "helm"))
RELEASE, NAMESPACE = "rel", "llm"
FULL = f"{RELEASE}-connex"
POOLS = ("vllm.prefill.enabled=true", "vllm.decode.enabled=true", "vllm.model=mock")
DECODERS = ("d1", "d2", "d3")
MAX_TOKENS = 120  # 25 ms a token: about 3 s a stream


def render() -> list[dict]:
    args = [HELM, "template", RELEASE, str(ROOT / "helm" / "connex"), "--namespace", NAMESPACE]
    for value in POOLS:
        args += ["--set", value]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def pod_spec(workload: dict) -> tuple[dict[str, str], dict, dict[str, int]]:
    """A workload's pod labels, its first container, and that container's named ports."""
    template = workload["spec"]["template"]
    c = template["spec"]["containers"][0]
    return template["metadata"]["labels"], c, {p["name"]: p["containerPort"] for p in c["ports"]}


def secret_files(docs: list[dict], name: str, into: Path) -> Path:
    """Writes a rendered Secret's keys as files (readable by the images' users)."""
    into.mkdir(parents=True, exist_ok=True)
    into.chmod(0o755)
    for key, value in find(docs, "Secret", name)["data"].items():
        path = into / key
        path.write_bytes(base64.b64decode(value))
        path.chmod(0o644)
    return into


@pytest.fixture(scope="module", autouse=True)
def images():
    require_docker()
    build_images()


@pytest.fixture(scope="module")
def chart():
    """The chart's pods as containers, its policies not applied yet."""
    docs = render()
    c = Cluster()
    files = Path(tempfile.mkdtemp(prefix="connex-chart-"))
    files.chmod(0o755)
    try:
        c.pods, c.killed = [], set()
        c.net = c.network("pods")
        c.node = docker("network", "inspect", "-f", "{{(index .IPAM.Config 0).Gateway}}", c.net)
        # etcd: the rendered arguments and server certificate.
        etcd = find(docs, "StatefulSet", f"{FULL}-etcd")
        labels, spec, ports = pod_spec(etcd)
        member = f"{FULL}-etcd-0"
        args = [a.replace("$(POD_NAME)", member) for a in spec["args"]]
        tls = secret_files(docs, f"{FULL}-etcd-server", files / "etcd-tls")
        name = c.run(
            "etcd",
            ETCD_IMAGE,
            [c.net],
            *args,
            aliases=(f"{FULL}-etcd", f"{member}.{FULL}-etcd-peer.{NAMESPACE}.svc"),
            labels=labels,
            volumes=(f"{tls}:/etc/etcd/tls:ro",),
        )
        c.etcd = netpol.Pod(name, labels, c.address(name, c.net), ports)
        c.pods.append(c.etcd)
        # Routers: the rendered arguments, config, secrets and client certificate.
        router = find(docs, "Deployment", f"{FULL}-router")
        labels, spec, ports = pod_spec(router)
        (files / "router.toml").write_text(
            find(docs, "ConfigMap", f"{FULL}-router")["data"]["router.toml"]
        )
        (files / "router.toml").chmod(0o644)
        secrets = files / "secrets"
        # Each Secret's key is the file name the router's projected volume gives it.
        for kind in ("admin", "register", "transfer"):
            secret_files(docs, f"{FULL}-{kind}", secrets)
        c.register_token = (secrets / "register-token").read_text()
        c.transfer_secret = (secrets / "transfer-secret").read_text()
        client_tls = secret_files(docs, f"{FULL}-etcd-client", files / "etcd-client")
        c.client_tls = client_tls
        c.routers, c.router_pods = [], []
        for i in (1, 2):
            name = c.run(
                f"r{i}",
                ROUTER_IMAGE,
                [c.net],
                *spec["args"],
                publish=(ports["http"], ports["internal"]),
                aliases=(f"{FULL}-router-internal",),
                labels=labels,
                volumes=(
                    f"{files / 'router.toml'}:/etc/connex/router.toml:ro",
                    f"{secrets}:/etc/connex/secrets:ro",
                    f"{client_tls}:/etc/connex/etcd:ro",
                ),
            )
            handle = RouterHandle(
                name=name,
                url=f"http://127.0.0.1:{published_port(name, ports['http'])}",
                internal=f"http://127.0.0.1:{published_port(name, ports['internal'])}",
                admin_token=(secrets / "admin-token").read_text(),
            )
            c.routers.append(handle)
            c.router_pods.append(netpol.Pod(name, labels, c.address(name, c.net), ports))
        c.pods += c.router_pods
        # Engines: mock engines on the pools' ports, registering as the agent does.
        c.engines = {}
        for engine, pool in (("p1", "prefill"), *((d, "decode") for d in DECODERS)):
            labels, spec, ports = pod_spec(find(docs, "Deployment", f"{FULL}-{pool}"))
            ktc = json.loads(spec["args"][spec["args"].index("--kv-transfer-config") + 1])
            register_at = ktc["kv_connector_extra_config"]["router"]
            script = (
                "exec connex-mock-engine "
                f'--listen "$(hostname -i | cut -d" " -f1):{ports["http"]}" '
                f"--kv-port {ktc['kv_port']} --id {engine} --role {pool} --model mock "
                f"--router {register_at} "
                f"--register-token {c.register_token} --transfer-secret {c.transfer_secret} "
                "--decode-us-per-token 25000"
            )
            name = c.run(
                engine, ENGINE_IMAGE, [c.net], "-c", script, labels=labels, entrypoint="/bin/sh"
            )
            pod = netpol.Pod(name, labels, c.address(name, c.net), ports)
            c.engines[engine] = pod
            c.pods.append(pod)
        # A pod of the namespace that is none of the release's.
        name = c.run(
            "intruder", ENGINE_IMAGE, [c.net], "infinity", labels={}, entrypoint="/bin/sleep"
        )
        c.intruder = netpol.Pod(name, {"app": "other"}, c.address(name, c.net))
        c.pods.append(c.intruder)
        c.policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        yield c
    except BaseException:
        print(c.log_tail())
        raise
    finally:
        c.close()
        subprocess.run(["rm", "-rf", str(files)], check=False)


def enforce(c: Cluster, policies: list[dict]) -> None:
    gone = {c.engines[name].container for name in c.killed}
    netpol.apply(policies, [p for p in c.pods if p.container not in gone], c.node, c.pid)
    for router in c.routers:
        wait_sees(router, set(c.engines) - c.killed, timeout_s=60)


def reaches(source: netpol.Pod, target: netpol.Pod, port: int) -> bool:
    """Whether `source` opens a TCP connection to `target`:`port` within 2 s."""
    done = subprocess.run(
        ["docker", "exec", source.container, "timeout", "2", "bash", "-c",
         f"exec 3<>/dev/tcp/{target.ip}/{port}"],
        capture_output=True,
    )  # fmt: skip
    return done.returncode == 0


def mock_stats(pod: netpol.Pod) -> dict:
    with urllib.request.urlopen(f"http://{pod.ip}:{pod.ports['http']}/mock/stats", timeout=5) as r:
        return json.load(r)


def decoder_kill_resume(c: Cluster, prompt: str) -> tuple[int, dict]:
    """Streams `prompt` and kills its decoder after 20 tokens; checks the text
    is what an unbroken stream gives. Returns how many prefills the prompt
    cost and the resumed request's record on the decoder that finished it."""
    router = c.routers[0]
    expected, finish, _, errors = stream_completion(router, prompt, MAX_TOKENS)
    assert finish == "length" and not errors
    prefill = c.engines["p1"]
    before = len(mock_stats(prefill)["requests"])
    alive = sorted(set(DECODERS) - c.killed)
    seen = {name: len(mock_stats(c.engines[name])["requests"]) for name in alive}
    killed = []

    def kill_the_decoder(count, _headers):
        if count < 20 or killed:
            return
        for name in alive:
            records = mock_stats(c.engines[name])["requests"][seen[name] :]
            if any(r["outcome"] == "running" for r in records):
                killed.append(name)
                docker("kill", c.engines[name].container)
                return

    text, finish, _, errors = stream_completion(
        router, prompt, MAX_TOKENS, on_token=kill_the_decoder
    )
    assert killed, "no decoder was found serving the stream"
    c.killed.add(killed[0])
    assert (errors, finish) == ([], "length")
    assert text == expected, "the resumed stream differs from an unbroken one"
    prefills = len(mock_stats(prefill)["requests"]) - before
    resumed = [
        r
        for name in alive
        if name != killed[0]
        for r in mock_stats(c.engines[name])["requests"][seen[name] :]
        if (r["body"].get("kv_transfer_params") or {}).get("resume_epoch")
    ]
    assert len(resumed) == 1, resumed
    for router in c.routers:
        wait_for(
            lambda r=router: killed[0] not in r.instance_ids(),
            30,
            f"{router.name} to drop {killed[0]}",
            tolerate=UNREACHABLE,
        )
    return prefills, resumed[0]


def without_router_hold_rule(policies: list[dict], kv_port: int) -> list[dict]:
    """The policies as the chart rendered them before the fix: on prefills the
    routers were admitted on vLLM's port only."""
    old = copy.deepcopy(policies)
    for policy in old:
        ingress = policy["spec"]["ingress"]
        policy["spec"]["ingress"] = [
            r for r in ingress if not any(p.get("port") == kv_port for p in r.get("ports", []))
        ]
    return old


def test_a_resume_under_the_charts_policies_pulls_from_the_hold(chart):
    c = chart
    kv_port = c.engines["p1"].ports["kv-ctrl"]
    # Before the fix: the hold's control port is closed to the routers; the
    # resume finds the hold unreachable and prefills again.
    enforce(c, without_router_hold_rule(c.policies, kv_port))
    prefills, _ = decoder_kill_resume(c, "chart policy, before the fix")
    assert prefills == 2, "the pre-fix policy should make the resume re-prefill"
    # The chart's policies: the resume pulls from the hold; one prefill.
    enforce(c, c.policies)
    prefills, resumed = decoder_kill_resume(c, "chart policy, as rendered")
    assert prefills == 1, "the resume re-prefilled: the router could not reach the hold"
    assert resumed.get("pulled_bytes", 0) > 0, resumed


def test_only_routers_reach_etcd_and_the_hold_port(chart):
    c = chart
    enforce(c, c.policies)
    router, etcd, prefill = c.router_pods[0], c.etcd, c.engines["p1"]
    decoder = c.engines[next(d for d in DECODERS if d not in c.killed)]
    kv, http, internal = prefill.ports["kv-ctrl"], prefill.ports["http"], router.ports["internal"]
    assert reaches(router, etcd, etcd.ports["client"])
    assert reaches(router, prefill, kv)
    assert reaches(decoder, prefill, kv), "decoders pull through the hold port"
    assert reaches(c.intruder, router, router.ports["http"]), "the client port is open"
    assert not reaches(decoder, etcd, etcd.ports["client"]), "an engine reached etcd"
    for target, port in (
        (etcd, etcd.ports["client"]),
        (prefill, kv),
        (prefill, http),
        (router, internal),
    ):
        assert not reaches(c.intruder, target, port), (
            f"the intruder reached {target.container}:{port}"
        )
    # etcd itself wants the release's client certificate (the host, as the node,
    # passes the filter): without it the TLS handshake is refused.
    tls = ssl.create_default_context(cafile=str(c.client_tls / "ca.crt"))
    tls.check_hostname = False
    url = f"https://{etcd.ip}:{etcd.ports['client']}/version"
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
        urllib.request.urlopen(url, context=tls, timeout=5).read()
    tls.load_cert_chain(str(c.client_tls / "tls.crt"), str(c.client_tls / "tls.key"))
    with urllib.request.urlopen(url, context=tls, timeout=5) as reply:
        assert "etcdserver" in json.load(reply)
