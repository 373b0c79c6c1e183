"""The chart's NetworkPolicies as packet filters between the container tier's hosts.

There is no Kubernetes here. Each container plays a pod: it has the labels the
chart gives that pod's component (``Pod.labels``) and the container ports its
workload declares (``Pod.ports``, for named ports). This module reads the
NetworkPolicies ``helm template`` rendered and writes, for every pod some policy
selects, iptables rules into that container's network namespace (entered with
``nsenter`` from the host: the images carry no iptables). A pod no policy selects
admits everything, as in Kubernetes.

What is translated is what the chart uses, and nothing else:

- ``policyTypes: [Ingress]``: a selected pod accepts a new inbound connection
  only when a rule of a policy that selects it admits it, and drops the rest
  (replies to its own connections, and loopback, pass);
- ``podSelector.matchLabels`` (the pod's own and each peer's): peers are the
  tier's pods, all in the release's namespace;
- a peer that is a ``namespaceSelector`` matches no host (the tier has one
  namespace: the chart uses it for the metrics scrapers, which are not here);
- ``ports`` by number or by name (looked up in the selected pod's ports), with
  ``endPort``; a rule without ``ports`` admits every port, without ``from``
  every source.

The tier's Docker bridge gateway plays the node: it is admitted, as CNIs admit
the kubelet's probes. The test's client reaches the routers through ports
published on 127.0.0.1 (forwarded from the gateway) and reads the mock
engines' counters from there.

Anything else in a policy (egress, ``matchExpressions``, ``ipBlock``, a
protocol other than TCP) raises ``Untranslatable``: a chart change that needs
more must extend this module, never be tested as something it is not.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field

CHAIN = "INPUT"


class Untranslatable(ValueError):
    """A policy uses something this module does not translate."""


@dataclass
class Pod:
    container: str
    labels: dict[str, str]
    ip: str
    ports: dict[str, int] = field(default_factory=dict)

    def matches(self, selector: dict) -> bool:
        extra = set(selector) - {"matchLabels"}
        if extra:
            raise Untranslatable(f"selector keys {sorted(extra)}")
        wanted = selector.get("matchLabels", {})
        return all(self.labels.get(k) == v for k, v in wanted.items())


def selects(policy: dict, pod: Pod) -> bool:
    spec = policy["spec"]
    if spec.get("policyTypes", ["Ingress"]) != ["Ingress"] or "egress" in spec:
        raise Untranslatable(f"{policy['metadata']['name']}: only Ingress policies")
    return pod.matches(spec["podSelector"])


def sources(peers: list[dict] | None, pods: Iterable[Pod]) -> list[str] | None:
    """The addresses a rule's ``from`` admits; None: everyone."""
    if peers is None:
        return None
    out = []
    for peer in peers:
        if set(peer) - {"podSelector", "namespaceSelector"}:
            raise Untranslatable(f"peer {peer}")
        if "namespaceSelector" in peer:
            continue  # another namespace: no host of the tier
        out += [p.ip for p in pods if p.matches(peer["podSelector"])]
    return sorted(set(out))


def port_ranges(ports: list[dict] | None, pod: Pod) -> list[str] | None:
    """iptables ``--dport`` values of a rule's ``ports``; None: every port."""
    if ports is None:
        return None
    out = []
    for entry in ports:
        if entry.get("protocol", "TCP") != "TCP":
            raise Untranslatable(f"protocol {entry['protocol']}")
        port = entry["port"]
        if isinstance(port, str):
            if port not in pod.ports:
                continue  # Kubernetes: a named port the pod lacks admits nothing
            port = pod.ports[port]
        end = entry.get("endPort")
        out.append(f"{port}:{end}" if end else str(port))
    return out


def rules(pod: Pod, policies: list[dict], pods: list[Pod], node: str) -> list[list[str]] | None:
    """The iptables rules (argument lists for ``-A INPUT``) of ``pod``'s
    ingress; None when no policy selects it."""
    mine = [p for p in policies if selects(p, pod)]
    if not mine:
        return None
    out = [
        ["-i", "lo", "-j", "ACCEPT"],
        ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ["-s", node, "-j", "ACCEPT"],
    ]
    for policy in mine:
        for rule in policy["spec"].get("ingress", []):
            srcs = sources(rule.get("from"), pods)
            dports = port_ranges(rule.get("ports"), pod)
            for src in srcs if srcs is not None else [None]:
                for dport in dports if dports is not None else [None]:
                    args = ["-p", "tcp"]
                    if src is not None:
                        args += ["-s", src]
                    if dport is not None:
                        args += ["--dport", dport]
                    out.append([*args, "-j", "ACCEPT"])
    out.append(["-j", "DROP"])
    return out


def apply(policies: list[dict], pods: list[Pod], node: str, pid_of) -> dict[str, list]:
    """Replaces every pod's inbound filter with the policies' (``pid_of(container)``
    gives a process in its network namespace); returns the rules per container."""
    applied = {}
    for pod in pods:
        ns = ["nsenter", "-t", str(pid_of(pod.container)), "-n", "iptables"]
        subprocess.run([*ns, "-F", CHAIN], check=True)
        subprocess.run([*ns, "-P", CHAIN, "ACCEPT"], check=True)
        pod_rules = rules(pod, policies, pods, node) or []
        for args in pod_rules:
            subprocess.run([*ns, "-A", CHAIN, *args], check=True)
        applied[pod.container] = pod_rules
    return applied
