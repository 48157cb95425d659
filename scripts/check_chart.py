#!/usr/bin/env python3
"""Assertions on the rendered aether-agent chart (the output of `helm template`).

    check_chart.py --surge true|false [--proxy true|false] [--spiffe-dir DIR]
                   [--backoff-base 0.1s] [--backoff-max 1s] [--ads-api-type GRPC]
                   [--metrics true|false] [--pod-monitor true|false] [--max-unavailable N]
                   [--registrar true|false] [--registrar-auth tokenReview|none]
                   [--registrar-tls secret|cert-manager|none] [--cert-manager-issuer NAME]
                   [--cert-manager-kind KIND] [--registrar-etcd-tls true|false]
                   [--registrar-network-policy true|false] [--node-cidr CIDR ...]
                   [--operator-source PEER ...] [--metrics-source PEER ...]
                   [--registrar-metrics true|false] [--registrar-pod-monitor true|false]
                   [--discovery true|false] [--discover-namespace NS ...] [--ignore-namespace NS ...]
                   [--lease-duration S] [--taint-guard true|false] [--taint-grace S]
                   RENDERED.yaml
    check_chart.py --unit deploy/systemd/aether-agent.service
    check_chart.py --relay-unit deploy/systemd/aether-xds-relay.service
    check_chart.py --probe-creds RENDERED.yaml     (shell assignments for test-chart.sh)
    check_chart.py --uninstall-creds RENDERED.yaml (likewise, for the uninstall hook)
    check_chart.py --registrar-creds RENDERED.yaml (likewise, for the registrar)

Prints one line per check ("ok   NAME") and stops at the first failure with
"FAIL NAME: detail" and exit status 1. The expectations come from the flags, so one
rendering is checked against the values it was rendered with. Needs PyYAML, which
kubernetes-validate depends on (run it with the project's .venv python).

scripts/test-chart.sh also breaks the chart on purpose and asserts that each check fails
(the mutation stage), so none of these can pass vacuously.
"""

import argparse
import copy
import glob
import json
import os
import re
import shlex
import sys

import yaml

RUN_DIR = "/run/aether"
STATE_DIR = "/var/lib/aether"
CNI_CONF_DIR = "/etc/cni/net.d"
CNI_BIN_DIR = "/opt/cni/bin"
HEALTH_SOCKET = "/tmp/agent-health.sock"
WORKER_USER = "65532:65532"
AGENT_CAPS = ["CHOWN", "SETUID", "SETGID", "SETPCAP", "KILL"]
READINESS = ["agent-ready", "--socket", HEALTH_SOCKET]
LIVENESS = ["agent-ready", "--socket", HEALTH_SOCKET, "--path", "/live"]
PORT_KEYS = {"ports", "hostPort", "containerPort"}
# Exactly what the worker's Kubernetes client uses: its node's pods, its node, and the
# JSON patch that removes the node's startup taint.
RBAC_RULES = {
    ("", "pods"): ["get", "list", "watch"],
    ("", "nodes"): ["get", "list", "watch", "patch"],
}
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
TAINT_KEY = "aether.io/agent-not-ready"
ENVOY_ADMIN_DIR = "/var/run/envoy-admin"
# The xDS relay's folder in the proxy pod (an emptyDir shared with Envoy) and its socket.
RELAY_DIR = "/var/run/aether-relay"
RELAY_SOCKET = f"{RELAY_DIR}/xds.sock"
METRICS_PORT = 15090
MEMORY_LIMIT = "256Mi"
# The registrar is held to a peak RSS of 150 MiB under a connection flood; its limit sits
# above that bound.
REGISTRAR_MEMORY_LIMIT = "256Mi"
HOOK = "helm.sh/hook"
COMPONENT = "app.kubernetes.io/component"
# The registrar's RBAC, by feature: (API group, resource, resourceNames) -> verbs. Exactly
# what its Kubernetes client uses, and only for the features that are on.
REGISTRAR_TOKEN_REVIEW = {("authentication.k8s.io", "tokenreviews", ()): ["create"]}
REGISTRAR_DISCOVERY = {("", "services", ()): ["get", "list", "watch"],
                       ("discovery.k8s.io", "endpointslices", ()): ["get", "list", "watch"]}
REGISTRAR_GUARD_CLUSTER = {("", "nodes", ()): ["get", "list", "watch", "patch"]}
REGISTRAR_GUARD_NAMESPACED = {("", "pods", ()): ["get", "list", "watch"]}
REGISTRAR_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                   "PodDisruptionBudget", "Deployment", "Service", "ValidatingAdmissionPolicy",
                   "ValidatingAdmissionPolicyBinding", "PodMonitor", "Certificate", "NetworkPolicy")


class CheckFailed(Exception):
    pass


def check(name, ok, detail=""):
    if not ok:
        print(f"FAIL {name}: {detail}")
        raise CheckFailed(name)
    print(f"ok   {name}")


def parse_bool(text):
    if text not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"want true or false, got {text!r}")
    return text == "true"


def find_keys(node, keys, path="$"):
    """Yield the path of every mapping key in `keys`, anywhere in node."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}"
            if key in keys:
                yield here
            yield from find_keys(value, keys, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from find_keys(value, keys, f"{path}[{i}]")


def objects_of(docs, kind, component=None):
    found = []
    for doc in docs:
        if doc.get("kind") != kind:
            continue
        labels = doc.get("metadata", {}).get("labels", {}) or {}
        if component is None or labels.get("app.kubernetes.io/component") == component:
            found.append(doc)
    return found


def env_map(container):
    return {e["name"]: e for e in container.get("env", []) or []}


def host_paths(pod_spec):
    # A missing or null path sorts as "" so that it shows up as a mismatch, not a crash.
    return sorted(str((v["hostPath"] or {}).get("path") or "") for v in pod_spec.get("volumes", []) or []
                  if "hostPath" in v)


def all_containers(pod_spec):
    return (pod_spec.get("initContainers") or []) + (pod_spec.get("containers") or [])


def check_agent(docs, raw, args):
    agents = objects_of(docs, "DaemonSet", "agent")
    check("agent DaemonSet rendered once", len(agents) == 1, f"found {len(agents)}")
    ds = agents[0]
    pod = ds["spec"]["template"]["spec"]

    # Update strategy per value.
    want = {"maxSurge": 1, "maxUnavailable": 0} if args.surge else {"maxSurge": 0, "maxUnavailable": args.max_unavailable}
    got = ds["spec"].get("updateStrategy", {})
    check(
        f"update strategy for surge={str(args.surge).lower()} is RollingUpdate {want}",
        got == {"type": "RollingUpdate", "rollingUpdate": want},
        f"got {got}",
    )

    # Pod-level placement and lifecycle.
    check("agent pod: hostNetwork true", pod.get("hostNetwork") is True, f"got {pod.get('hostNetwork')!r}")
    check("agent pod: dnsPolicy ClusterFirstWithHostNet", pod.get("dnsPolicy") == "ClusterFirstWithHostNet",
          f"got {pod.get('dnsPolicy')!r}")
    check("agent pod: priorityClassName system-node-critical",
          pod.get("priorityClassName") == "system-node-critical", f"got {pod.get('priorityClassName')!r}")
    check("agent pod: terminationGracePeriodSeconds 30", pod.get("terminationGracePeriodSeconds") == 30,
          f"got {pod.get('terminationGracePeriodSeconds')!r}")
    shared = [k for k in ("hostPID", "hostIPC") if pod.get(k)]
    check("agent pod: no hostPID/hostIPC", not shared, f"got {shared}")

    containers = {c["name"]: c for c in pod.get("containers", [])}
    check("agent container present", "agent" in containers, f"containers: {sorted(containers)}")
    agent = containers["agent"]
    check("agent container runs aether-supervisor", agent.get("command") == ["aether-supervisor"],
          f"got {agent.get('command')}")

    requests = (agent.get("resources") or {}).get("requests") or {}
    check("agent requests: cpu 200m and a memory figure",
          requests.get("cpu") == "200m" and bool(requests.get("memory")), f"got {requests}")
    limits = (agent.get("resources") or {}).get("limits") or {}
    check(f"agent memory limit {MEMORY_LIMIT} (the worker's memory grows with the mesh)",
          limits.get("memory") == MEMORY_LIMIT, f"got limits {limits}")

    # Probes: exec probes that call agent-ready on the pod-private health socket.
    for kind, want_cmd in (("readinessProbe", READINESS), ("livenessProbe", LIVENESS)):
        probe = agent.get(kind) or {}
        handlers = sorted(k for k in ("exec", "httpGet", "tcpSocket", "grpc") if k in probe)
        command = (probe.get("exec") or {}).get("command") or []
        check(f"{kind} is an exec probe only", handlers == ["exec"], f"handlers {handlers}")
        check(f"{kind} command[0] is agent-ready", command[:1] == ["agent-ready"], f"got {command}")
        check(f"{kind} command is {' '.join(want_cmd)}", command == want_cmd, f"got {command}")
    ready_period = agent["readinessProbe"].get("periodSeconds")
    live_period = agent["livenessProbe"].get("periodSeconds")
    check("readinessProbe period 2s", ready_period == 2, f"got {ready_period!r}")
    check("livenessProbe period longer than readiness", isinstance(live_period, int) and live_period > 2,
          f"got {live_period!r}")

    # Capabilities and the rest of the securityContext, for every container of the pod.
    sc = agent.get("securityContext") or {}
    caps = sc.get("capabilities") or {}
    check("agent capabilities drop == [ALL]", caps.get("drop") == ["ALL"], f"got {caps.get('drop')}")
    add = caps.get("add") or []
    check(f"agent capabilities add == exactly {AGENT_CAPS}",
          sorted(add) == sorted(AGENT_CAPS) and len(add) == len(set(add)), f"got {add}")
    check("agent runs as root (uid 0) to drop the worker's privileges", sc.get("runAsUser") == 0,
          f"got runAsUser {sc.get('runAsUser')!r}")
    for c in all_containers(pod):
        check_container_hardening("agent pod", c)
        if c["name"] != "agent":
            extra = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add")
            check(f"agent pod: container {c['name']} adds no capability", not extra, f"got {extra}")

    # Every added capability carries a comment saying why (a '# CAP: ...' line above it).
    lines = raw.splitlines()
    for cap in AGENT_CAPS:
        idx = [i for i, line in enumerate(lines) if line.strip() == f"- {cap}"]
        ok = bool(idx)
        detail = f"no '- {cap}' line"
        for i in idx:
            j = i - 1
            while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith(f"# {cap}:"):
                j -= 1
            if not (j >= 0 and lines[j].strip().startswith(f"# {cap}:")):
                ok, detail = False, f"line {i + 1} '- {cap}' has no '# {cap}: why' comment above it"
        check(f"capability {cap} has a comment saying why", ok, detail)

    # Volumes: the exact hostPath list, and /tmp as an emptyDir.
    want_paths = sorted([RUN_DIR, STATE_DIR, CNI_CONF_DIR, CNI_BIN_DIR] + ([args.spiffe_dir] if args.spiffe_dir else [])
                        + ([args.spire_admin_dir] if args.spire_admin_dir else []))
    check(f"agent hostPath list is exactly {want_paths}", host_paths(pod) == want_paths, f"got {host_paths(pod)}")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for path in (RUN_DIR, STATE_DIR):
        types = [v["hostPath"].get("type") for v in volumes.values() if v.get("hostPath", {}).get("path") == path]
        check(f"hostPath {path} is DirectoryOrCreate", types == ["DirectoryOrCreate"], f"got {types}")
    mounts = {m["mountPath"]: m for m in agent.get("volumeMounts", [])}
    tmp = mounts.get("/tmp")
    check("agent /tmp is an emptyDir (pod-private health socket)",
          tmp is not None and "emptyDir" in volumes.get(tmp["name"], {}), f"mount {tmp}")

    # Environment: downward API and the contract's folders.
    env = env_map(agent)
    for name, field in (("NODE_NAME", "spec.nodeName"), ("POD_NAME", "metadata.name")):
        got = ((env.get(name) or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        check(f"env {name} from fieldRef {field}", got == field, f"got {env.get(name)}")
    for name, value in (("AETHER_RUN_DIR", RUN_DIR), ("AETHER_STATE_DIR", STATE_DIR),
                        ("AETHER_HEALTH_DIR", "/tmp"), ("AETHER_WORKER_USER", WORKER_USER)):
        check(f"env {name}={value}", (env.get(name) or {}).get("value") == value, f"got {env.get(name)}")
    for name, path in (("AETHER_RUN_DIR", RUN_DIR), ("AETHER_STATE_DIR", STATE_DIR)):
        mount = mounts.get(path)
        host = (volumes.get(mount["name"], {}).get("hostPath") or {}).get("path") if mount else None
        check(f"{name} is the host's {path}, mounted at the same path", host == path, f"mount {mount}")
    conf = (env.get("AETHER_CNI_CONF_DIR") or {}).get("value")
    conf_mount = mounts.get(conf) if conf else None
    conf_host = (volumes.get(conf_mount["name"], {}).get("hostPath") or {}).get("path") if conf_mount else None
    check(f"env AETHER_CNI_CONF_DIR is the mount of the host's {CNI_CONF_DIR}", conf_host == CNI_CONF_DIR,
          f"AETHER_CNI_CONF_DIR={conf!r}, mount {conf_mount}")
    spiffe = (env.get("SPIFFE_ENDPOINT_SOCKET") or {}).get("value")
    if args.spiffe_dir:
        check(f"env SPIFFE_ENDPOINT_SOCKET under unix://{args.spiffe_dir}/",
              bool(spiffe) and spiffe.startswith(f"unix://{args.spiffe_dir}/"), f"got {spiffe!r}")
        m = mounts.get(args.spiffe_dir)
        check("SPIFFE socket folder mounted read-only at its host path", bool(m) and m.get("readOnly") is True,
              f"got {m}")
        for name, want in (("AETHER_TRUST_DOMAIN", args.trust_domain), ("AETHER_MTLS", args.mtls)):
            check(f"env {name}={want}", (env.get(name) or {}).get("value") == want, f"got {env.get(name)}")
    else:
        check("no SPIFFE_ENDPOINT_SOCKET without identity.spiffe.socketDir", spiffe is None, f"got {spiffe!r}")
        check("no AETHER_TRUST_DOMAIN without identity", "AETHER_TRUST_DOMAIN" not in env, f"got {env.get('AETHER_TRUST_DOMAIN')}")
        check("no AETHER_MTLS with identity.mtls off", "AETHER_MTLS" not in env, f"got {env.get('AETHER_MTLS')}")
    broker = (env.get("AETHER_SPIFFE_BROKER_ENDPOINT") or {}).get("value")
    if args.spire_admin_dir:
        check(f"env AETHER_SPIFFE_BROKER_ENDPOINT under unix://{args.spire_admin_dir}/",
              bool(broker) and broker.startswith(f"unix://{args.spire_admin_dir}/"), f"got {broker!r}")
        m = mounts.get(args.spire_admin_dir)
        check("SPIRE admin socket folder mounted read-only at its host path", bool(m) and m.get("readOnly") is True,
              f"got {m}")
    else:
        check("no AETHER_SPIFFE_BROKER_ENDPOINT without identity.spiffe.adminSocketDir", broker is None, f"got {broker!r}")

    for name, want in (("AETHER_LOG_FORMAT", args.log_format),):
        check(f"env {name}={want}", (env.get(name) or {}).get("value") == want, f"got {env.get(name)}")
    check("env RUST_LOG set (the log level)", bool((env.get("RUST_LOG") or {}).get("value")), f"got {env.get('RUST_LOG')}")
    check_metrics(ds, agent, env, args)
    check_token(pod, agent)

    # A roll never uninstalls: no container of the agent's pod has a lifecycle hook, and
    # nothing in it runs the uninstall (that is the post-delete hook's alone).
    hooks = [c["name"] for c in all_containers(pod) if c.get("lifecycle")]
    argv = [a for c in all_containers(pod) for a in (c.get("command") or []) + (c.get("args") or [])]
    check("agent pod: no lifecycle hook and no `aether-cni uninstall` (a roll never uninstalls)",
          not hooks and not runs_uninstall(argv), f"hooks on {hooks}, argv {argv}")

    # The CNI plugin install: `aether-cni install <bin mount>` copies the plugin's own
    # executable to a temporary name carrying POD_NAME in the bin folder, then renames it
    # (cni-plugin/src/install.rs). The image has no shell.
    inits = {c["name"]: c for c in pod.get("initContainers", [])}
    check("init container install-cni present", "install-cni" in inits, f"init containers {sorted(inits)}")
    init = inits["install-cni"]
    bin_mounts = [m["mountPath"] for m in init.get("volumeMounts", [])
                  if (volumes.get(m["name"], {}).get("hostPath") or {}).get("path") == CNI_BIN_DIR]
    check(f"install-cni mounts the host's {CNI_BIN_DIR}", len(bin_mounts) == 1, f"got {bin_mounts}")
    argv = init.get("command", []) + init.get("args", [])
    check("install-cni needs no shell: its command is aether-cni itself",
          bool(argv) and argv[0].startswith("/") and argv[0].endswith("/aether-cni"), f"got {argv}")
    check(f"install-cni runs `aether-cni install {bin_mounts[0]}`", argv[1:] == ["install", bin_mounts[0]],
          f"got {argv}")
    got = ((env_map(init).get("POD_NAME") or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
    check("install-cni env POD_NAME from fieldRef metadata.name (the temporary name's instance)",
          got == "metadata.name", f"got {env_map(init).get('POD_NAME')}")
    return ds


def check_metrics(ds, agent, env, args):
    """Metrics bound on the node's IP with the Prometheus annotations when enabled, else on
    the node's loopback with none."""
    annotations = ds["spec"]["template"]["metadata"].get("annotations") or {}
    addr = (env.get("AETHER_METRICS_ADDR") or {}).get("value")
    if args.metrics:
        want = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT), "prometheus.io/path": "/metrics"}
        got = {k: annotations.get(k) for k in want}
        check("metrics enabled: prometheus.io annotations name the metrics port", got == want, f"got {got}")
        host_ip = ((env.get("HOST_IP") or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        check(f"metrics enabled: AETHER_METRICS_ADDR is $(HOST_IP):{METRICS_PORT}, HOST_IP from status.hostIP",
              addr == f"$(HOST_IP):{METRICS_PORT}" and host_ip == "status.hostIP",
              f"AETHER_METRICS_ADDR={addr!r}, HOST_IP from {host_ip!r}")
        names = list(env)
        check("metrics enabled: HOST_IP is defined before AETHER_METRICS_ADDR (for $(HOST_IP))",
              "HOST_IP" in names and names.index("HOST_IP") < names.index("AETHER_METRICS_ADDR"), f"env order {names}")
    else:
        scrape = sorted(k for k in annotations if k.startswith("prometheus.io/"))
        check("metrics disabled: no prometheus.io annotations", not scrape, f"got {scrape}")
        check(f"metrics disabled: AETHER_METRICS_ADDR on the node's loopback 127.0.0.1:{METRICS_PORT}",
              addr == f"127.0.0.1:{METRICS_PORT}", f"got {addr!r}")


def check_token(pod, agent):
    """The agent's API token: a projected volume in the agent container only, readable by
    the worker through the worker's group (fsGroup), no automounted token anywhere."""
    check("agent pod: automountServiceAccountToken false (the token is mounted by hand)",
          pod.get("automountServiceAccountToken") is False, f"got {pod.get('automountServiceAccountToken')!r}")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    token_vols = [n for n, v in volumes.items()
                  if any("serviceAccountToken" in src for src in (v.get("projected") or {}).get("sources", []))]
    check("agent pod: one projected service-account token volume", len(token_vols) == 1, f"got {token_vols}")
    vol = volumes[token_vols[0]]["projected"]
    sources = vol.get("sources", [])
    sat = next(src["serviceAccountToken"] for src in sources if "serviceAccountToken" in src)
    check("service-account token: the API server's audience (none named), path token, rotated",
          sat.get("path") == "token" and "audience" not in sat and 600 <= sat.get("expirationSeconds", 3600) <= 86400,
          f"got {sat}")
    ca = [src for src in sources if (src.get("configMap") or {}).get("name") == "kube-root-ca.crt"]
    ns = [src for src in sources if "downwardAPI" in src]
    check("service-account volume also holds ca.crt and namespace (what in-cluster clients read)",
          len(ca) == 1 and len(ns) == 1, f"sources {sources}")
    mounts = [(c["name"], m) for c in all_containers(pod) for m in c.get("volumeMounts", []) if m["name"] == token_vols[0]]
    check(f"service-account token mounted in the agent container only, read-only, at {TOKEN_PATH}",
          len(mounts) == 1 and mounts[0][0] == agent["name"] and mounts[0][1].get("mountPath") == TOKEN_PATH
          and mounts[0][1].get("readOnly") is True, f"mounts {mounts}")
    worker_gid = int(WORKER_USER.split(":")[1])
    fs_group = (pod.get("securityContext") or {}).get("fsGroup")
    check(f"service-account token readable by the worker: fsGroup {worker_gid} (its gid), defaultMode 0440",
          fs_group == worker_gid and vol.get("defaultMode") == 0o440,
          f"fsGroup {fs_group!r}, defaultMode {vol.get('defaultMode')!r}")


def check_container_hardening(where, c):
    sc = c.get("securityContext") or {}
    name = c["name"]
    check(f"{where}: {name} readOnlyRootFilesystem true", sc.get("readOnlyRootFilesystem") is True,
          f"got {sc.get('readOnlyRootFilesystem')!r}")
    check(f"{where}: {name} allowPrivilegeEscalation false", sc.get("allowPrivilegeEscalation") is False,
          f"got {sc.get('allowPrivilegeEscalation')!r}")
    check(f"{where}: {name} seccompProfile RuntimeDefault",
          (sc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", f"got {sc.get('seccompProfile')}")
    check(f"{where}: {name} not privileged", sc.get("privileged") in (None, False), f"got {sc.get('privileged')!r}")
    check(f"{where}: {name} capabilities drop == [ALL]",
          (sc.get("capabilities") or {}).get("drop") == ["ALL"], f"got {sc.get('capabilities')}")


def check_rbac(docs, agent_ds):
    # The agent's: the registrar's carry the component label registrar.
    roles = [r for r in objects_of(docs, "ClusterRole") if COMPONENT not in (r["metadata"].get("labels") or {})]
    check("one ClusterRole for the agent", len(roles) == 1, f"found {len(roles)}")
    got = {}
    for rule in roles[0].get("rules", []):
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                got[(group, resource)] = sorted(got.get((group, resource), []) + list(rule.get("verbs", [])))
    for rule in roles[0].get("rules", []):
        check("ClusterRole: no wildcard and no resourceNames",
              "*" not in rule.get("verbs", []) + rule.get("resources", []) + rule.get("apiGroups", []),
              f"rule {rule}")
    want = {k: sorted(v) for k, v in RBAC_RULES.items()}
    check("ClusterRole: exactly get/list/watch pods and get/list/watch/patch nodes", got == want, f"got {got}")
    sa_name = agent_ds["spec"]["template"]["spec"].get("serviceAccountName")
    sas = [d["metadata"]["name"] for d in objects_of(docs, "ServiceAccount")]
    check("agent runs under the chart's ServiceAccount", sa_name in sas, f"{sa_name!r} not in {sas}")
    bindings = objects_of(docs, "ClusterRoleBinding")
    ok = any(b["roleRef"]["name"] == roles[0]["metadata"]["name"]
             and any(s.get("kind") == "ServiceAccount" and s.get("name") == sa_name for s in b.get("subjects", []))
             for b in bindings)
    check("ClusterRoleBinding binds the ClusterRole to that ServiceAccount", ok, f"bindings {bindings}")


# --- The node-patch ValidatingAdmissionPolicies, evaluated -----------------------------------
#
# Two policies: the agent's (its own node's startup taint may go or come back) and, with the
# taint guard, the registrar's (the startup taint may be added to any node, never removed).
# Each policy's CEL is evaluated here with cel-python on sample requests, as the API server
# would: matchConditions first (a request that fails one is not the policy's), then the
# variables, then every validation; an error or false denies (failurePolicy Fail). The
# expressions use standard CEL only (has(), filter, size, in), which cel-python and the API
# server's cel-go read alike; what this cannot show is the API server's typing of the
# objects, so the live check stays with a real cluster.

NODE = {
    "apiVersion": "v1", "kind": "Node",
    "metadata": {"name": "node-a", "labels": {"kubernetes.io/hostname": "node-a"}, "annotations": {"a": "1"},
                 "resourceVersion": "41"},
    "spec": {"podCIDR": "10.0.1.0/24", "podCIDRs": ["10.0.1.0/24"], "providerID": "kind://node-a",
             "taints": [{"key": TAINT_KEY, "effect": "NoSchedule"},
                        {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]},
    "status": {"phase": "Running"},
}


KUBE_VERSION = "1.34.0"


def node_spec_fields(version=None):
    """NodeSpec's fields in the Kubernetes schemas kubernetes-validate ships, for `version`
    (the one the chart is validated against) or the newest."""
    import kubernetes_validate
    base = os.path.join(os.path.dirname(kubernetes_validate.__file__), "kubernetes-json-schema")
    dirs = sorted(glob.glob(os.path.join(base, "v*-local-strict")),
                  key=lambda p: [int(x) for x in re.findall(r"\d+", os.path.basename(p))])
    path = os.path.join(base, f"v{version}-local-strict") if version else dirs[-1]
    with open(os.path.join(path, "_definitions.json"), encoding="utf-8") as f:
        defs = json.load(f)["$defs"]
    return sorted(defs["io.k8s.api.core.v1.NodeSpec"]["properties"])


def evaluate_policy(policy, request, old, new):
    """(allowed, why) for one request, as the API server evaluates a ValidatingAdmissionPolicy."""
    import celpy
    env = celpy.Environment()

    def run(expr, variables):
        act = {"request": celpy.json_to_cel(request), "object": celpy.json_to_cel(new),
               "oldObject": celpy.json_to_cel(old), "variables": celpy.celtypes.MapType(variables)}
        result = env.program(env.compile(expr)).evaluate(act)
        if isinstance(result, celpy.CELEvalError):
            raise result
        return result

    spec = policy["spec"]
    for cond in spec.get("matchConditions", []):
        try:
            matched = run(cond["expression"], {}) == celpy.celtypes.BoolType(True)
        except Exception as e:  # noqa: BLE001 - an error in a match condition denies (failurePolicy Fail)
            return False, f"match condition {cond['name']}: {e}"
        if not matched:
            return True, f"not matched ({cond['name']})"
    variables = {}
    for var in spec.get("variables", []):
        try:
            variables[celpy.celtypes.StringType(var["name"])] = run(var["expression"], variables)
        except Exception:  # noqa: BLE001 - lazily an error: only a validation that reads it fails
            pass
    for v in spec.get("validations", []):
        try:
            ok = run(v["expression"], variables)
        except Exception as e:  # noqa: BLE001
            return False, f"error: {e} ({v.get('message')})"
        if ok != celpy.celtypes.BoolType(True):
            return False, v.get("message", v["expression"])
    return True, "allowed"


def changed_node(base, f):
    new = copy.deepcopy(base)
    f(new)
    return new


def policy_cases(sa_user):
    """(name, request, oldObject, object, allowed) for the agent's node writes and others'."""
    def req(op="UPDATE", user=sa_user, node="node-a", extra=True, sub=None):
        r = {"operation": op, "userInfo": {"username": user}}
        if extra:
            r["userInfo"]["extra"] = {"authentication.kubernetes.io/pod-name": ["aether-x"]}
            if node is not None:
                r["userInfo"]["extra"]["authentication.kubernetes.io/node-name"] = [node]
        if sub is not None:
            r["subResource"] = sub
        return r

    def changed(f):
        return changed_node(NODE, f)

    untaint = changed(lambda n: n["spec"]["taints"].pop(0))
    cases = [
        ("the agent removes its taint from its own node", req(), NODE, untaint, True),
        ("the same with an empty subresource", req(sub=""), NODE, untaint, True),
        ("the agent puts its taint back", req(), untaint, NODE, True),
        ("a patch that changes nothing", req(), NODE, copy.deepcopy(NODE), True),
        ("the server's own metadata moves (resourceVersion, managedFields)", req(), NODE,
         changed(lambda n: n["metadata"].update(resourceVersion="42", managedFields=[{"manager": "aether"}])), True),
        ("the last taint goes (no taints left)", req(), changed(lambda n: n["spec"].update(taints=[n["spec"]["taints"][0]])),
         changed(lambda n: n["spec"].pop("taints")), True),
        ("another node than the token's", req(node="node-b"), NODE, untaint, False),
        ("a token that names no node", req(node=None), NODE, untaint, False),
        ("a token with no extra at all", req(extra=False), NODE, untaint, False),
        ("another taint removed", req(), NODE, changed(lambda n: n["spec"]["taints"].pop(1)), False),
        ("another taint added", req(), NODE,
         changed(lambda n: n["spec"]["taints"].append({"key": "evil", "effect": "NoExecute"})), False),
        ("its key with NoExecute (evicts the node's pods)", req(), NODE,
         changed(lambda n: n["spec"]["taints"].append({"key": TAINT_KEY, "effect": "NoExecute"})), False),
        ("its taint turned into NoExecute", req(), NODE,
         changed(lambda n: n["spec"]["taints"][0].update(effect="NoExecute")), False),
        ("a label changed", req(), NODE, changed(lambda n: n["metadata"]["labels"].update(role="x")), False),
        ("the labels removed", req(), NODE, changed(lambda n: n["metadata"].pop("labels")), False),
        ("an annotation changed", req(), NODE, changed(lambda n: n["metadata"]["annotations"].update(a="2")), False),
        ("a finalizer added", req(), NODE, changed(lambda n: n["metadata"].update(finalizers=["x/y"])), False),
        ("an owner reference added", req(), NODE,
         changed(lambda n: n["metadata"].update(ownerReferences=[{"kind": "X", "name": "y"}])), False),
        ("a status update through nodes/status", req(sub="status"), NODE,
         changed(lambda n: n["status"].update(phase="Terminated")), False),
        ("a delete", req(op="DELETE"), NODE, None, False),
        ("a create", req(op="CREATE"), None, NODE, False),
        ("the kubelet cordons its node (not the agent: not matched)", req(user="system:node:node-a"), NODE,
         changed(lambda n: n["spec"].update(unschedulable=True)), True),
        ("a same-named service account of another namespace (not matched)",
         req(user=re.sub(r":[^:]+:([^:]+)$", r":elsewhere:\1", sa_user)), NODE,
         changed(lambda n: n["metadata"]["labels"].update(role="x")), True),
    ]
    return cases + spec_field_cases(req(), NODE)


def spec_field_cases(request, base):
    """A change, and a removal where `base` has it, of every NodeSpec field but taints: each
    denied, whichever policy matches `request`."""
    cases = []
    samples = {"string": "changed", "boolean": True, "array": ["changed"]}
    for field in node_spec_fields(KUBE_VERSION):
        if field == "taints":
            continue
        kind = next((t for t in (NODE_SPEC_TYPES.get(field) or ["object"]) if t != "null"), "object")
        value = samples.get(kind, {"changed": "yes"})
        cases.append((f"spec.{field} changed", request, base,
                      changed_node(base, lambda n, f=field, v=value: n["spec"].update({f: v})), False))
        if field in base["spec"]:
            cases.append((f"spec.{field} removed", request, base, changed_node(base, lambda n, f=field: n["spec"].pop(f)),
                          False))
    return cases


def registrar_policy_cases(sa_user, agent_user, node_selector):
    """(name, request, oldObject, object, allowed) for the registrar's node writes and others'.
    Its token is bound to its own pod's node (node-r), which the policy does not look at; the
    nodes it may patch are those the agent runs on, whose labels match `node_selector`."""
    def req(op="UPDATE", user=sa_user, sub=None):
        r = {"operation": op, "userInfo": {"username": user, "extra": {
            "authentication.kubernetes.io/pod-name": ["registrar-x"],
            "authentication.kubernetes.io/node-name": ["node-r"]}}}
        if sub is not None:
            r["subResource"] = sub
        return r

    startup = {"key": TAINT_KEY, "effect": "NoSchedule"}
    # node-a, one the agent runs on, without the startup taint: what the guard finds on a node
    # that lost its agent.
    covered = changed_node(NODE, lambda n: n["metadata"]["labels"].update(node_selector))
    bare = changed_node(covered, lambda n: n["spec"]["taints"].pop(0))
    no_taints = changed_node(covered, lambda n: n["spec"].pop("taints"))

    def add_taint(n):
        n["spec"]["taints"].append(startup)

    # A node the agent does not run on: without its nodeSelector's labels, or with another
    # value of one. Every node is the agent's when its nodeSelector is empty.
    unlabelled = changed_node(bare, lambda n: [n["metadata"]["labels"].pop(k) for k in node_selector])
    no_labels = changed_node(bare, lambda n: n["metadata"].pop("labels"))
    cases = [
        ("the guard taints a node without the agent's nodeSelector labels", req(), unlabelled,
         changed_node(unlabelled, add_taint), not node_selector),
        ("the guard taints a node with no labels at all", req(), no_labels, changed_node(no_labels, add_taint),
         not node_selector),
    ]
    for key in sorted(node_selector):
        other = changed_node(bare, lambda n, k=key: n["metadata"]["labels"].update({k: node_selector[k] + "-other"}))
        cases.append((f"the guard taints a node whose {key} is not {node_selector[key]}", req(), other,
                      changed_node(other, add_taint), False))
    cases += [
        ("the guard adds the taint (appended to the node's taints)", req(), bare,
         changed_node(bare, lambda n: n["spec"]["taints"].append(startup)), True),
        ("the guard adds the taint to a node with no taints", req(), no_taints,
         changed_node(no_taints, lambda n: n["spec"].update(taints=[startup])), True),
        ("the same with an empty subresource", req(sub=""), bare,
         changed_node(bare, lambda n: n["spec"]["taints"].append(startup)), True),
        ("the guard taints another node than its pod's", req(), changed_node(bare, lambda n: n["metadata"].update(name="node-b")),
         changed_node(bare, lambda n: (n["metadata"].update(name="node-b"), n["spec"]["taints"].append(startup))), True),
        ("a patch that changes nothing", req(), covered, copy.deepcopy(covered), True),
        ("the server's own metadata moves (resourceVersion, managedFields)", req(), bare,
         changed_node(bare, lambda n: n["metadata"].update(resourceVersion="42", managedFields=[{"manager": "x"}])), True),
        ("the taint removed", req(), covered, bare, False),
        ("the last taint, the startup one, removed", req(), changed_node(no_taints, lambda n: n["spec"].update(taints=[startup])),
         no_taints, False),
        ("the taint turned into NoExecute", req(), covered,
         changed_node(covered, lambda n: n["spec"]["taints"][0].update(effect="NoExecute")), False),
        ("its key added with NoExecute (evicts the node's pods)", req(), bare,
         changed_node(bare, lambda n: n["spec"]["taints"].append({"key": TAINT_KEY, "effect": "NoExecute"})), False),
        ("another taint added", req(), bare,
         changed_node(bare, lambda n: n["spec"]["taints"].append({"key": "evil", "effect": "NoSchedule"})), False),
        ("the taint added and another removed", req(), bare,
         changed_node(bare, lambda n: n["spec"].update(taints=[startup])), False),
        ("a label changed", req(), bare, changed_node(bare, lambda n: n["metadata"]["labels"].update(role="x")), False),
        ("the taint added with a label", req(), bare,
         changed_node(bare, lambda n: (n["spec"]["taints"].append(startup), n["metadata"]["labels"].update(role="x"))), False),
        ("an annotation changed", req(), bare, changed_node(bare, lambda n: n["metadata"]["annotations"].update(a="2")), False),
        ("a finalizer added", req(), bare, changed_node(bare, lambda n: n["metadata"].update(finalizers=["x/y"])), False),
        ("an owner reference added", req(), bare,
         changed_node(bare, lambda n: n["metadata"].update(ownerReferences=[{"kind": "X", "name": "y"}])), False),
        ("cordoned", req(), bare, changed_node(bare, lambda n: n["spec"].update(unschedulable=True)), False),
        ("a status update through nodes/status", req(sub="status"), bare,
         changed_node(bare, lambda n: n["status"].update(phase="Terminated")), False),
        ("a delete", req(op="DELETE"), bare, None, False),
        ("a create", req(op="CREATE"), None, NODE, False),
        ("the agent removes its taint (not the registrar: not matched)", req(user=agent_user), covered, bare, True),
        ("the kubelet cordons its node (not matched)", req(user="system:node:node-a"), bare,
         changed_node(bare, lambda n: n["spec"].update(unschedulable=True)), True),
        ("a same-named service account of another namespace (not matched)",
         req(user=re.sub(r":[^:]+:([^:]+)$", r":elsewhere:\1", sa_user)), covered, bare, True),
    ]
    return cases + spec_field_cases(req(), bare)


NODE_SPEC_TYPES = {"externalID": ["string"], "podCIDR": ["string"], "podCIDRs": ["array"], "providerID": ["string"],
                   "unschedulable": ["boolean"], "configSource": ["object"]}


def check_policy(what, whose, summary, policy, binding, sa_user, cases):
    """One node policy and its binding: denying, failing closed, seeing every node write,
    matching `sa_user` only, and deciding each of `cases` as the API server would."""
    check(f"{what}: the binding names the policy and denies",
          binding["spec"].get("policyName") == policy["metadata"]["name"]
          and binding["spec"].get("validationActions") == ["Deny"] and not binding["spec"].get("matchResources"),
          f"binding spec {binding['spec']}")
    check(f"{what}: failurePolicy Fail", policy["spec"].get("failurePolicy") == "Fail",
          f"got {policy['spec'].get('failurePolicy')!r}")
    rules = (policy["spec"].get("matchConstraints") or {}).get("resourceRules") or []
    covered = {(g, r, op) for rule in rules for g in rule.get("apiGroups", []) for r in rule.get("resources", [])
               for op in rule.get("operations", [])}
    want = {("", r, op) for r in ("nodes", "nodes/status") for op in ("CREATE", "UPDATE", "DELETE")}
    check(f"{what}: matches create, update and delete of nodes and nodes/status", want <= covered,
          f"missing {sorted(want - covered)}")
    conds = [c["expression"] for c in policy["spec"].get("matchConditions", [])]
    check(f"{what}: bound to {whose} service account ({sa_user}) by a match condition",
          any(f"'{sa_user}'" in c and "request.userInfo.username" in c for c in conds), f"match conditions {conds}")
    failed = []
    for name, request, old, new, allowed in cases:
        got, why = evaluate_policy(policy, request, old, new)
        if got != allowed:
            failed.append(f"{name}: {'allowed' if got else 'denied'} ({why}), want {'allowed' if allowed else 'denied'}")
    check(f"{what}, evaluated on {len(cases)} requests: {summary}", not failed, "; ".join(failed))
    denied_fields = sorted({n.split()[0].split(".")[1] for n, _, _, _, a in cases if n.startswith("spec.") and not a})
    want_fields = sorted(set(node_spec_fields(KUBE_VERSION)) - {"taints"})
    check(f"{what}: every NodeSpec field of Kubernetes {KUBE_VERSION} but taints is guarded "
          f"({', '.join(want_fields)})", denied_fields == want_fields, f"got {denied_fields}")


def agent_user(agent_ds):
    return (f"system:serviceaccount:{agent_ds['metadata']['namespace']}:"
            f"{agent_ds['spec']['template']['spec']['serviceAccountName']}")


def check_node_policy(docs, agent_ds):
    # The agent's: the registrar's carries the component label registrar.
    policies = [p for p in objects_of(docs, "ValidatingAdmissionPolicy") if COMPONENT not in (p["metadata"].get("labels") or {})]
    bindings = [b for b in objects_of(docs, "ValidatingAdmissionPolicyBinding")
                if COMPONENT not in (b["metadata"].get("labels") or {})]
    check("node policy: one ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1) and its binding",
          len(policies) == 1 and len(bindings) == 1
          and all(d.get("apiVersion") == "admissionregistration.k8s.io/v1" for d in policies + bindings),
          f"found {len(policies)} policies, {len(bindings)} bindings")
    sa_user = agent_user(agent_ds)
    check_policy("node policy", "the agent's", "the agent may change only its taint on its own node",
                 policies[0], bindings[0], sa_user, policy_cases(sa_user))
    newer = sorted(set(node_spec_fields()) - set(node_spec_fields(KUBE_VERSION)))
    if newer:
        # Not guarded: a field an older API server does not know is left out of the policy.
        print(f"note NodeSpec fields newer than Kubernetes {KUBE_VERSION}, not compared by the policy: {newer}")


def check_registrar_node_policy(docs, d, agent_ds, args):
    """With the taint guard, the registrar's node policy: it may add the startup taint to any
    node and change nothing else. Without the guard, none (the registrar patches no node)."""
    policies = objects_of(docs, "ValidatingAdmissionPolicy", "registrar")
    bindings = objects_of(docs, "ValidatingAdmissionPolicyBinding", "registrar")
    if not args.taint_guard:
        check("registrar node policy: none without the taint guard", not policies and not bindings,
              f"found {len(policies)} policies, {len(bindings)} bindings")
        return
    check("registrar node policy: one ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1) and its binding",
          len(policies) == 1 and len(bindings) == 1
          and all(x.get("apiVersion") == "admissionregistration.k8s.io/v1" for x in policies + bindings),
          f"found {len(policies)} policies, {len(bindings)} bindings")
    pod = d["spec"]["template"]["spec"]
    sa_user = f"system:serviceaccount:{d['metadata']['namespace']}:{pod.get('serviceAccountName')}"
    node_selector = {k: str(v) for k, v in (agent_ds["spec"]["template"]["spec"].get("nodeSelector") or {}).items()}
    check_policy("registrar node policy", "the registrar's",
                 "the registrar may add the startup taint to any node the agent runs on, and change nothing else",
                 policies[0], bindings[0], sa_user,
                 registrar_policy_cases(sa_user, agent_user(agent_ds), node_selector))


def runs_uninstall(argv):
    """Whether a command line is `aether-cni uninstall`, however it is spelled."""
    return any(a.endswith("aether-cni") and b == "uninstall" for a, b in zip(argv, argv[1:]))


def check_uninstall(docs, args):
    """The post-delete hook: a DaemonSet that runs `aether-cni uninstall` on every node the
    agent ran on, and a Job that waits for it; nothing else runs it."""
    hooks = [d for d in docs if (d.get("metadata", {}).get("annotations") or {}).get(HOOK)]
    ds = [d for d in objects_of(docs, "DaemonSet", "cni-uninstall")]
    runs = [d for d in docs if d.get("kind") in ("DaemonSet", "Deployment", "Job")
            and any(runs_uninstall((c.get("command") or []) + (c.get("args") or []))
                    for c in all_containers(d["spec"]["template"]["spec"]))]
    if not args.uninstall:
        check("no uninstall hook with cni.uninstall.enabled=false", not ds and not runs, f"found {len(ds)}, {len(runs)}")
        return
    check("uninstall: one DaemonSet runs `aether-cni uninstall`, and only it", len(ds) == 1 and runs == ds,
          f"DaemonSets {len(ds)}, runners {[d['metadata']['name'] for d in runs]}")
    check("uninstall: every hook object is post-delete only (never install, upgrade or rollback)",
          hooks and all(d["metadata"]["annotations"][HOOK] == "post-delete" for d in hooks),
          f"hooks {[(d['kind'], d['metadata']['annotations'][HOOK]) for d in hooks]}")
    check("uninstall: the DaemonSet is a post-delete hook, deleted on success and on failure",
          ds[0] in hooks and {"hook-succeeded", "hook-failed"} <= set(
              ds[0]["metadata"]["annotations"].get("helm.sh/hook-delete-policy", "").split(",")),
          f"annotations {ds[0]['metadata'].get('annotations')}")
    agent = objects_of(docs, "DaemonSet", "agent")[0]["spec"]["template"]["spec"]
    pod = ds[0]["spec"]["template"]["spec"]
    check("uninstall: the DaemonSet runs where the agent ran (its nodeSelector and tolerations)",
          pod.get("nodeSelector") == agent.get("nodeSelector") and pod.get("tolerations") == agent.get("tolerations"),
          f"nodeSelector {pod.get('nodeSelector')}, tolerations {pod.get('tolerations')}")
    check("uninstall pod: no service account token", pod.get("automountServiceAccountToken") is False,
          f"got {pod.get('automountServiceAccountToken')!r}")
    inits = pod.get("initContainers") or []
    check("uninstall: the removal is the init container (the pod is Ready only once it is done)",
          len(inits) == 1 and runs_uninstall(inits[0].get("command", []) + inits[0].get("args", [])), f"init {inits}")
    init = inits[0]
    argv = init.get("command", []) + init.get("args", [])
    flags = dict(zip(argv, argv[1:]))
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: (volumes[m["name"]].get("hostPath") or {}).get("path") for m in init.get("volumeMounts", [])}
    check(f"uninstall waits for the node lock: --run-dir {RUN_DIR} is the host's {RUN_DIR}",
          flags.get("--run-dir") == RUN_DIR and mounts.get(RUN_DIR) == RUN_DIR, f"argv {argv}, mounts {mounts}")
    for flag, host in (("--cni-conf-dir", CNI_CONF_DIR), ("--cni-bin-dir", CNI_BIN_DIR)):
        check(f"uninstall {flag} is the host's {host}", mounts.get(flags.get(flag)) == host, f"argv {argv}, mounts {mounts}")
    for c in all_containers(pod):
        check_container_hardening("uninstall pod", c)
        extra = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add")
        check(f"uninstall pod: container {c['name']} adds no capability", not extra, f"got {extra}")
    jobs = [d for d in objects_of(docs, "Job") if d in hooks]
    check("uninstall: a Job waits for that DaemonSet (kubectl rollout status) after it is created",
          len(jobs) == 1 and int(jobs[0]["metadata"]["annotations"].get("helm.sh/hook-weight", "0"))
          > int(ds[0]["metadata"]["annotations"].get("helm.sh/hook-weight", "0"))
          and f"daemonset/{ds[0]['metadata']['name']}" in jobs[0]["spec"]["template"]["spec"]["containers"][0]["command"],
          f"jobs {[j['spec']['template']['spec']['containers'][0].get('command') for j in jobs]}")
    roles = [d for d in objects_of(docs, "Role") if d in hooks]
    rules = [r for role in roles for r in role.get("rules", [])]
    check("uninstall: the Job's Role reads that one DaemonSet and nothing else",
          rules == [{"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": [ds[0]["metadata"]["name"]],
                     "verbs": ["get", "list", "watch"]}], f"rules {rules}")


# A subset of the Prometheus Operator's PodMonitor CRD (monitoring.coreos.com/v1, as in
# its monitoring.coreos.com_podmonitors.yaml of v0.91): the fields the chart writes, with
# their types and enums, closed to any other key so that a typo fails. kubernetes-validate
# has no schema for custom resources and would only warn.
PODMONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["selector"], "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array"}}},
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "podMetricsEndpoints": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "properties": {
                        "path": {"type": "string"},
                        "port": {"type": "string"},
                        "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": {"type": "string",
                                     "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                        "relabelings": {"type": "array", "items": {
                            "type": "object", "additionalProperties": False, "properties": {
                                "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod",
                                                    "HashMod", "labelmap", "LabelMap", "labeldrop", "LabelDrop",
                                                    "labelkeep", "LabelKeep", "lowercase", "Lowercase", "uppercase",
                                                    "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual"]},
                                "modulus": {"type": "integer"},
                                "regex": {"type": "string"},
                                "replacement": {"type": "string"},
                                "separator": {"type": "string"},
                                "sourceLabels": {"type": "array", "items": {"type": "string"}},
                                "targetLabel": {"type": "string"}}}}}}},
            },
        },
    },
}


# A subset of cert-manager's Certificate CRD (cert-manager.io/v1, as in its
# cert-manager.crds.yaml of v1.19): the fields the chart writes, and a few it may, with their
# types and enums, closed to any other key so that a typo fails. kubernetes-validate has no
# schema for custom resources and would only warn; test-chart.sh lets that warning through
# for this kind alone, and this schema stands in for it.
CERT_USAGES = ["signing", "digital signature", "content commitment", "key encipherment", "key agreement",
               "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
               "server auth", "client auth", "code signing", "email protection", "s/mime", "ipsec end system",
               "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]
CERTIFICATE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object", "required": ["issuerRef", "secretName"], "additionalProperties": False,
            "properties": {
                "secretName": {"type": "string", "minLength": 1},
                "commonName": {"type": "string"},
                "dnsNames": {"type": "array", "items": {"type": "string", "minLength": 1}},
                "ipAddresses": {"type": "array", "items": {"type": "string"}},
                "duration": {"type": "string"},
                "renewBefore": {"type": "string"},
                "usages": {"type": "array", "items": {"enum": CERT_USAGES}},
                "privateKey": {"type": "object", "additionalProperties": False, "properties": {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "encoding": {"enum": ["PKCS1", "PKCS8"]},
                    "rotationPolicy": {"enum": ["Never", "Always"]},
                    "size": {"type": "integer"}}},
                "issuerRef": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "kind": {"type": "string"},
                    "group": {"type": "string"}}},
                "secretTemplate": {"type": "object", "additionalProperties": False, "properties": {
                    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
            },
        },
    },
}


def relabel(rules, labels):
    """Prometheus's relabeling of one target (keep, drop, replace), for the PodMonitor check."""
    labels = dict(labels)
    for r in rules:
        value = r.get("separator", ";").join(labels.get(s, "") for s in r.get("sourceLabels", []))
        regex = re.compile("^(?:" + r.get("regex", "(.*)") + ")$")
        m = regex.match(value)
        action = r.get("action", "replace").lower()
        if action == "keep" and not m:
            return None
        if action == "drop" and m:
            return None
        if action == "replace" and m:
            out = re.sub(r"\$\{?(\d+)\}?", lambda g: m.group(int(g.group(1))) or "", r.get("replacement", "$1"))
            labels[r["targetLabel"]] = out
    return labels


def pod_monitor_of(docs, where, component, enabled, value, owner):
    """The PodMonitor of `component`'s pods, checked against the CRD's fields and its
    selector against the pods of `owner` (their workload) and its namespace; None, checked
    absent, unless `enabled` (the chart value `value`)."""
    monitors = objects_of(docs, "PodMonitor", component)
    if not enabled:
        check(f"no {where} unless {value}", not monitors, f"found {len(monitors)}")
        return None
    check(f"{where} rendered once", len(monitors) == 1, f"found {len(monitors)}")
    pm = monitors[0]
    import jsonschema
    errors = sorted(f"{'.'.join(str(p) for p in e.path)}: {e.message}"
                    for e in jsonschema.Draft202012Validator(PODMONITOR_SCHEMA).iter_errors(pm))
    check(f"{where} validates against the CRD's fields (monitoring.coreos.com/v1)", not errors, "; ".join(errors))
    labels = owner["spec"]["template"]["metadata"]["labels"]
    selector = pm["spec"]["selector"].get("matchLabels") or {}
    check(f"{where} selects the {component}'s pods only, in the release's namespace",
          selector.get("app.kubernetes.io/component") == component
          and all(labels.get(k) == v for k, v in selector.items())
          and pm["spec"].get("namespaceSelector", {}).get("matchNames") == [owner["metadata"]["namespace"]],
          f"selector {selector}, pod labels {labels}")
    return pm


def check_relay_pod_monitor(docs, args):
    proxies = objects_of(docs, "DaemonSet", "proxy")
    pm = pod_monitor_of(docs, "relay PodMonitor", "proxy", args.relay_pod_monitor,
                        "proxy.relay.metrics.podMonitor.enabled", proxies[0] if proxies else None)
    if pm is None:
        return
    endpoints = pm["spec"].get("podMetricsEndpoints") or []
    rules = (endpoints[0].get("relabelings") if len(endpoints) == 1 else None) or []
    got = {}
    # The relay is a native sidecar: an init container in the pod's spec, kept; Envoy dropped.
    for ip in ("10.0.0.7", "fd00::7"):
        for container, init in (("xds-relay", "true"), ("envoy", "false")):
            target = relabel(rules, {"__address__": ip, "__meta_kubernetes_pod_ip": ip,
                                     "__meta_kubernetes_pod_container_name": container,
                                     "__meta_kubernetes_pod_container_init": init})
            got[(ip, container)] = target and target["__address__"]
    port = args.relay_metrics_port
    want = {("10.0.0.7", "xds-relay"): f"10.0.0.7:{port}", ("10.0.0.7", "envoy"): None,
            ("fd00::7", "xds-relay"): f"[fd00::7]:{port}", ("fd00::7", "envoy"): None}
    check(f"relay PodMonitor: /metrics, the relay container's target is <pod IP>:{port} (IPv6 bracketed), "
          "Envoy's dropped", len(endpoints) == 1 and endpoints[0].get("path") == "/metrics" and got == want,
          f"got {got}, endpoints {endpoints}")


def check_pod_monitor(docs, agent_ds, args):
    check_relay_pod_monitor(docs, args)
    pm = pod_monitor_of(docs, "PodMonitor", "agent", args.pod_monitor, "agent.metrics.podMonitor.enabled", agent_ds)
    if pm is None:
        return
    endpoints = pm["spec"].get("podMetricsEndpoints") or []
    check("PodMetricsEndpoint: /metrics, no port or portNumber (the pod declares none: they would match nothing)",
          len(endpoints) == 1 and endpoints[0].get("path") == "/metrics"
          and "port" not in endpoints[0] and "portNumber" not in endpoints[0], f"got {endpoints}")
    rules = endpoints[0].get("relabelings") or []
    # Prometheus's pod discovery, for a hostNetwork pod with no declared port: one target
    # per container, the pod IP (the node's) as its address.
    got = {}
    for ip in ("10.0.0.7", "fd00::7"):
        for container, init in (("agent", "false"), ("install-cni", "true")):
            target = relabel(rules, {"__address__": ip, "__meta_kubernetes_pod_ip": ip,
                                     "__meta_kubernetes_pod_container_name": container,
                                     "__meta_kubernetes_pod_container_init": init})
            got[(ip, container)] = target and target["__address__"]
    want = {("10.0.0.7", "agent"): f"10.0.0.7:{METRICS_PORT}", ("10.0.0.7", "install-cni"): None,
            ("fd00::7", "agent"): f"[fd00::7]:{METRICS_PORT}", ("fd00::7", "install-cni"): None}
    check(f"PodMonitor relabeling: the agent container's target is <pod IP>:{METRICS_PORT} (IPv6 bracketed), "
          "init containers dropped", got == want, f"got {got}")


def check_registrar_probes(c, argv):
    """The kubelet's probes of the registrar: GET /ready and GET /live on a declared port
    that --health-addr binds (on every address of the pod: the kubelet probes its IP)."""
    declared = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
    bound = flag_values(argv, "--health-addr")
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/live")):
        get = (c.get(probe) or {}).get("httpGet") or {}
        port = declared.get(get.get("port"), get.get("port"))
        check(f"registrar {probe}: GET {path} on the port --health-addr binds",
              get.get("path") == path and port is not None and bound == [f"0.0.0.0:{port}"] and get.get("scheme", "HTTP") == "HTTP",
              f"{probe} {c.get(probe)}, declared ports {declared}, --health-addr {bound}")
    ready = c.get("readinessProbe") or {}
    check("registrar readinessProbe: every 5 s at most, answered within its timeout (the etcd check takes 1 s)",
          ready.get("periodSeconds", 10) <= 5 and ready.get("timeoutSeconds", 1) >= 2, f"got {ready}")


def check_registrar_pod_monitor(docs, d, argv, args):
    """The registrar's PodMonitor scrapes the port its pods declare as `metrics`, which
    must be the one --metrics-addr binds: Prometheus's pod discovery makes one target per
    declared port, and the endpoint keeps the one of that name."""
    pm = pod_monitor_of(docs, "registrar PodMonitor", "registrar", args.registrar_pod_monitor,
                        "registrar.metrics.podMonitor.enabled", d)
    if pm is None:
        return
    endpoints = pm["spec"].get("podMetricsEndpoints") or []
    container = all_containers(d["spec"]["template"]["spec"])[0]
    declared = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
    bound = flag_values(argv, "--metrics-addr")
    want = declared.get(endpoints[0].get("port")) if len(endpoints) == 1 else None
    check("registrar PodMonitor scrapes /metrics on the declared port that --metrics-addr binds",
          len(endpoints) == 1 and endpoints[0].get("path") == "/metrics" and want is not None
          and bound == [f"0.0.0.0:{want}"], f"endpoints {endpoints}, declared ports {declared}, --metrics-addr {bound}")


def check_keeper(docs, args):
    keepers = objects_of(docs, "DaemonSet", "keeper")
    if not args.keeper:
        check("no keeper DaemonSet with keeper.enabled=false", not keepers, f"found {len(keepers)}")
        return
    check("keeper DaemonSet rendered once", len(keepers) == 1, f"found {len(keepers)}")
    pod = keepers[0]["spec"]["template"]["spec"]
    check(f"keeper hostPath list is exactly [{RUN_DIR}]", host_paths(pod) == [RUN_DIR], f"got {host_paths(pod)}")
    check("keeper pod: no service account token", pod.get("automountServiceAccountToken") is False,
          f"got {pod.get('automountServiceAccountToken')!r}")
    containers = all_containers(pod)
    check("keeper pod: one container", len(containers) == 1, f"got {[c['name'] for c in containers]}")
    for c in containers:
        check_container_hardening("keeper pod", c)
        extra = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add")
        check(f"keeper pod: container {c['name']} adds no capability", not extra, f"got {extra}")
    argv = containers[0].get("command", []) + containers[0].get("args", [])
    check("keeper runs aether-keeper on the run folder",
          argv[:1] == ["aether-keeper"]
          and any(a == "--run-dir" and b == RUN_DIR for a, b in zip(argv, argv[1:])), f"argv {argv}")
    uid = (containers[0].get("securityContext") or {}).get("runAsUser")
    check("keeper runs as uid 0, the supervisors' uid that the handoff checks", uid == 0, f"got {uid!r}")


def rules_of(role):
    """A Role's or ClusterRole's rules as {(API group, resource, resourceNames): sorted verbs}."""
    got = {}
    for rule in role.get("rules", []) or []:
        names = tuple(sorted(rule.get("resourceNames") or []))
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                key = (group, resource, names)
                got[key] = sorted(set(got.get(key, [])) | set(rule.get("verbs", [])))
    return got


def flag_values(argv, flag):
    """Every value given to `flag` in argv (flag, value pairs)."""
    return [b for a, b in zip(argv, argv[1:]) if a == flag]


def check_registrar(docs, agent_ds, args):
    deployments = objects_of(docs, "Deployment", "registrar")
    services = objects_of(docs, "Service", "registrar")
    agent = {c["name"]: c for c in agent_ds["spec"]["template"]["spec"]["containers"]}["agent"]
    env = env_map(agent)
    if not args.registrar:
        found = [f"{d['kind']}/{d['metadata']['name']}" for kind in REGISTRAR_KINDS for d in objects_of(docs, kind, "registrar")]
        check("no registrar objects (nor its RBAC or PodDisruptionBudget) with registrar.enabled=false", not found,
              f"found {found}")
        roles = [f"{d['kind']}/{d['metadata']['name']}" for kind in ("ClusterRole", "Role") for d in objects_of(docs, kind)
                 if d["metadata"]["name"] != agent_ds["metadata"]["name"]
                 and not (d["metadata"].get("annotations") or {}).get(HOOK)]
        check("no role but the agent's ClusterRole (and the uninstall hook's) with registrar.enabled=false", not roles,
              f"found {roles}")
        return
    check("registrar Deployment and Service rendered once", len(deployments) == 1 and len(services) == 1,
          f"found {len(deployments)} Deployment(s), {len(services)} Service(s)")
    d, svc = deployments[0], services[0]
    check("registrar replicas >= 2 (an agent resumes on the other)", d["spec"].get("replicas", 1) >= 2,
          f"got {d['spec'].get('replicas')!r}")
    strategy = d["spec"].get("strategy", {}).get("rollingUpdate", {})
    check("registrar rolls with maxUnavailable 0", strategy.get("maxUnavailable") == 0, f"got {strategy}")
    svc_port = svc["spec"]["ports"][0]["port"]
    want = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:{svc_port}"
    got = (env.get("AETHER_REGISTRAR") or {}).get("value")
    check("agent AETHER_REGISTRAR is the registrar Service", got == want, f"got {got!r}, want {want!r}")
    pod = d["spec"]["template"]["spec"]
    argv = all_containers(pod)[0].get("command", []) + all_containers(pod)[0].get("args", [])
    agent_sa = agent_ds["spec"]["template"]["spec"].get("serviceAccountName")
    check_registrar_kubernetes(docs, d, agent_ds, argv, args)
    check("registrar is --token-review exactly when registrar.auth=tokenReview",
          ("--token-review" in argv) == (args.registrar_auth == "tokenReview"), f"auth {args.registrar_auth}, argv {argv}")
    if "--token-review" in argv:
        # The agents' tokens are checked for the audience aether-registrar and speak for
        # their own node.
        want_sa = f"{agent_ds['metadata']['namespace']}/{agent_sa}"
        check("registrar takes the agents' service account as --agent-service-account",
              any(a == "--agent-service-account" and b == want_sa for a, b in zip(argv, argv[1:])), f"argv {argv}")
        check("registrar is not --insecure-listen with --token-review", "--insecure-listen" not in argv, f"argv {argv}")
        token_file = (env.get("AETHER_REGISTRAR_TOKEN_FILE") or {}).get("value", "")
        sources = [src.get("serviceAccountToken") for v in agent_ds["spec"]["template"]["spec"].get("volumes", [])
                   for src in (v.get("projected") or {}).get("sources", []) if src.get("serviceAccountToken")]
        check("agent gets a projected token for the audience aether-registrar at AETHER_REGISTRAR_TOKEN_FILE",
              any(t.get("audience") == "aether-registrar" and token_file.endswith("/" + t.get("path", "")) for t in sources),
              f"file {token_file!r}, tokens {sources}")
    check_registrar_tls(docs, agent_ds, pod, argv, args)
    check_registrar_etcd(pod, argv, args)
    check_registrar_network_policy(docs, d, argv, args)
    check_registrar_pod_monitor(docs, d, argv, args)
    metrics_addr = flag_values(argv, "--metrics-addr")
    annotations = d["spec"]["template"]["metadata"].get("annotations") or {}
    if args.registrar_metrics:
        port = annotations.get("prometheus.io/port")
        check("registrar metrics: --metrics-addr on every address of the pod at the annotated port",
              metrics_addr == [f"0.0.0.0:{port}"] and annotations.get("prometheus.io/scrape") == "true"
              and annotations.get("prometheus.io/path") == "/metrics", f"--metrics-addr {metrics_addr}, annotations {annotations}")
    else:
        ports = [p.get("name") for p in all_containers(pod)[0].get("ports") or []]
        check("registrar metrics off unless registrar.metrics.enabled: no --metrics-addr, annotation or metrics port",
              not metrics_addr and "prometheus.io/scrape" not in annotations and "metrics" not in ports,
              f"--metrics-addr {metrics_addr}, annotations {annotations}, ports {ports}")
    check_registrar_probes(all_containers(pod)[0], argv)
    resources = all_containers(pod)[0].get("resources") or {}
    limit, request = (resources.get(k, {}).get("memory") for k in ("limits", "requests"))
    check(f"registrar memory limit {REGISTRAR_MEMORY_LIMIT} (held to a peak RSS of 150 MiB under a flood) and a "
          "memory request", limit == REGISTRAR_MEMORY_LIMIT and bool(request), f"got {resources}")
    check_secrets_readable("registrar pod", pod)
    check("registrar pod: not hostNetwork", not pod.get("hostNetwork"), f"got {pod.get('hostNetwork')!r}")
    check("registrar pod: runAsNonRoot", (pod.get("securityContext") or {}).get("runAsNonRoot") is True,
          f"got {pod.get('securityContext')}")
    # The one host folder a registrar may mount: the SPIRE agent's Workload API socket
    # folder, with SPIFFE as its TLS source (checked read-only in check_registrar_spiffe).
    allowed = [args.spiffe_dir] if args.registrar_tls == "spiffe" else []
    check("registrar pod: no hostPath but the Workload API folder with SPIFFE TLS",
          host_paths(pod) == allowed, f"got {host_paths(pod)}, allowed {allowed}")
    containers = all_containers(pod)
    check("registrar pod: one container", len(containers) == 1, f"got {[c['name'] for c in containers]}")
    for c in containers:
        check_container_hardening("registrar pod", c)
        extra = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add")
        check(f"registrar pod: container {c['name']} adds no capability", not extra, f"got {extra}")
    check("registrar runs aether-registrar serve with --etcd and --listen",
          argv[:2] == ["aether-registrar", "serve"] and "--etcd" in argv and "--listen" in argv, f"argv {argv}")
    listen = argv[argv.index("--listen") + 1] if "--listen" in argv else ""
    port = svc["spec"]["ports"][0]
    check("registrar Service targets the port the registrar listens on",
          listen.endswith(f":{port.get('targetPort')}"), f"listen {listen!r}, service {port}")
    check("registrar Service selects the registrar pods",
          all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items()),
          f"selector {svc['spec']['selector']}")


def secret_files(pod, container):
    """(mount path/file, secret name, key, mode) of every secret file `container` mounts."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    out = []
    for m in container.get("volumeMounts", []):
        secret = (volumes.get(m["name"]) or {}).get("secret")
        if not secret:
            continue
        mode = secret.get("defaultMode", 0o644)
        for item in secret.get("items") or [{"key": "*", "path": "*"}]:
            out.append((f"{m['mountPath']}/{item['path']}", secret["secretName"], item["key"], item.get("mode", mode)))
    return out


def check_secrets_readable(where, pod):
    """The kubelet writes a Secret volume's files as root, group fsGroup when the pod sets
    one, with the volume's mode: a container that runs as another uid reads them only
    through that group or the mode's other bits."""
    psc = pod.get("securityContext") or {}
    for c in all_containers(pod):
        sc = c.get("securityContext") or {}
        uid = sc.get("runAsUser", psc.get("runAsUser", 0))
        groups = {sc.get("runAsGroup", psc.get("runAsGroup", 0))} | set(psc.get("supplementalGroups") or [])
        if "fsGroup" in psc:
            groups.add(psc["fsGroup"])
        group = psc.get("fsGroup", 0)
        for path, _, _, mode in secret_files(pod, c):
            readable = uid == 0 or mode & 0o004 or (group in groups and mode & 0o040)
            check(f"{where}: {path} readable by uid {uid} (mode {mode:04o}, group {group})", readable,
                  f"groups {sorted(groups)}")


def secret_at(pod, container, path):
    """(secret name, key) of the Secret file `container` mounts at `path`; a volume without
    items projects every key of its Secret under its own name. None when nothing is there."""
    for mount_path, name, key, _ in secret_files(pod, container):
        if mount_path == path:
            return name, key
        if key == "*" and mount_path == os.path.dirname(path) + "/*":
            return name, os.path.basename(path)
    return None


def check_registrar_tls(docs, agent_ds, pod, argv, args):
    """The registrar serves TLS from registrar.tls.secretName, or from the Secret its
    cert-manager Certificate writes, and the agents check it against that Secret's ca.crt,
    the only key in their pods. Plain TCP only where the values acknowledged it
    (registrar.insecureTransport, --registrar-tls none)."""
    agent_pod = agent_ds["spec"]["template"]["spec"]
    agent = {c["name"]: c for c in agent_pod["containers"]}["agent"]
    ca = (env_map(agent).get("AETHER_REGISTRAR_CA") or {}).get("value")
    certs = objects_of(docs, "Certificate", "registrar")
    if args.registrar_tls != "cert-manager":
        check("no registrar Certificate unless registrar.tls.certManager.issuerRef.name", not certs,
              f"found {[c['metadata']['name'] for c in certs]}")
    if args.registrar_tls == "none":
        check("registrar serves plain TCP and agents get no CA with no TLS source (registrar.insecureTransport)",
              "--tls-cert" not in argv and ca is None, f"argv {argv}, AETHER_REGISTRAR_CA {ca!r}")
        return
    if args.registrar_tls == "spiffe":
        check_registrar_spiffe(agent, pod, argv, args, ca)
        return
    registrar = all_containers(pod)[0]
    files = {path: (name, key) for path, name, key, _ in secret_files(pod, registrar)}
    cert, key = (flag_values(argv, f) for f in ("--tls-cert", "--tls-key"))
    check("registrar --tls-cert and --tls-key are the TLS Secret's tls.crt and tls.key",
          len(cert) == 1 and len(key) == 1 and files.get(cert[0], ("", ""))[1] == "tls.crt"
          and files.get(key[0], ("", ""))[1] == "tls.key" and files[cert[0]][0] == files[key[0]][0],
          f"--tls-cert {cert}, --tls-key {key}, mounted {files}")
    agent_files = {path: (name, k, mode) for path, name, k, mode in secret_files(agent_pod, agent)}
    secret = files.get(cert[0], ("",))[0] if cert else ""
    check("agent AETHER_REGISTRAR_CA is the same Secret's ca.crt, world-readable for the worker",
          agent_files.get(ca, ("", "", 0))[:2] == (secret, "ca.crt") and agent_files[ca][2] & 0o004,
          f"AETHER_REGISTRAR_CA {ca!r}, mounted {agent_files}")
    leaked = [p for p, (name, k, _) in agent_files.items() if name == secret and k != "ca.crt"]
    check("the agents mount no key of the registrar's TLS Secret but ca.crt", not leaked, f"mounted {leaked}")
    if args.registrar_tls != "cert-manager":
        return
    check("registrar Certificate rendered once (registrar.tls.certManager)", len(certs) == 1, f"found {len(certs)}")
    c = certs[0]
    import jsonschema
    errors = sorted(f"{'.'.join(str(p) for p in e.path)}: {e.message}"
                    for e in jsonschema.Draft202012Validator(CERTIFICATE_SCHEMA).iter_errors(c))
    check("registrar Certificate validates against the CRD's fields (cert-manager.io/v1)", not errors, "; ".join(errors))
    spec = c["spec"]
    check("registrar Certificate writes the Secret the registrar mounts and the agents take ca.crt from, in the "
          "release namespace", spec.get("secretName") == secret
          and c["metadata"].get("namespace") == agent_ds["metadata"]["namespace"],
          f"secretName {spec.get('secretName')!r}, mounted {secret!r}, namespace {c['metadata'].get('namespace')!r}")
    # The agents check the certificate against the host they dial, the Service's name.
    dialed = [a.rsplit(":", 1)[0] for a in ((env_map(agent).get("AETHER_REGISTRAR") or {}).get("value") or "").split(",")]
    names = spec.get("dnsNames") or []
    check("registrar Certificate names every host the agents dial (the Service's <name>.<namespace>.svc)",
          bool(dialed) and all(h in names for h in dialed) and all(h.endswith(".svc") for h in dialed),
          f"dnsNames {names}, agents dial {dialed}")
    ref = spec.get("issuerRef") or {}
    want_ref = {"name": args.cert_manager_issuer, "kind": args.cert_manager_kind, "group": "cert-manager.io"}
    check("registrar Certificate: for server auth, from the issuer the values name",
          "server auth" in (spec.get("usages") or []) and ref == want_ref, f"usages {spec.get('usages')}, issuerRef {ref}")


def check_registrar_spiffe(agent, pod, argv, args, ca):
    """SPIFFE: the registrar's SVID and bundle from the Workload API socket of a read-only
    hostPath folder, its callers' SVIDs checked by the agents' IDs; the agents present
    theirs and check the registrar's SPIFFE ID, with no CA file and no --tls-cert."""
    registrar = all_containers(pod)[0]
    endpoint = flag_values(argv, "--spiffe-endpoint")
    folder = endpoint[0].removeprefix("unix://").rsplit("/", 1)[0] if len(endpoint) == 1 else None
    mounts = {m["mountPath"]: m for m in registrar.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    m = mounts.get(folder) or {}
    host = (volumes.get(m.get("name"), {}).get("hostPath") or {}).get("path")
    check("registrar --spiffe-endpoint is a socket in a read-only hostPath folder (the node's SPIRE agent)",
          bool(folder) and m.get("readOnly") is True and host == folder,
          f"--spiffe-endpoint {endpoint}, mounts {list(mounts)}, hostPath {host!r}")
    check("registrar with SPIFFE: --trust-domain, no --tls-cert, no --insecure-listen",
          len(flag_values(argv, "--trust-domain")) == 1 and "--tls-cert" not in argv and "--insecure-listen" not in argv,
          f"argv {argv}")
    check("registrar takes the agents' SPIFFE IDs (--agent-spiffe-id)",
          flag_values(argv, "--agent-spiffe-id") == args.agent_spiffe_id,
          f"got {flag_values(argv, '--agent-spiffe-id')}, want {args.agent_spiffe_id}")
    got = (env_map(agent).get("AETHER_REGISTRAR_SPIFFE_ID") or {}).get("value")
    check("agents check the registrar's SPIFFE ID (AETHER_REGISTRAR_SPIFFE_ID) and get no CA file",
          got == args.registrar_spiffe_id and ca is None, f"AETHER_REGISTRAR_SPIFFE_ID {got!r}, CA {ca!r}")


def check_registrar_etcd(pod, argv, args):
    """TLS to etcd: https:// URLs only, with the etcd Secret's ca.crt, tls.crt and tls.key;
    without it (registrar.insecureTransport) no TLS flag at all."""
    registrar = all_containers(pod)[0]
    urls = [u for v in flag_values(argv, "--etcd") for u in v.split(",")]
    flags = {f: flag_values(argv, f) for f in ("--etcd-ca", "--etcd-cert", "--etcd-key")}
    if not args.registrar_etcd_tls:
        check("registrar: no etcd client TLS flags without registrar.etcd.tls.secretName",
              not any(flags.values()), f"got {flags}")
        return
    got = {f: [secret_at(pod, registrar, v) for v in vals] for f, vals in flags.items()}
    secrets = {s[0] for vals in got.values() for s in vals if s}
    want_keys = {"--etcd-ca": "ca.crt", "--etcd-cert": "tls.crt", "--etcd-key": "tls.key"}
    check("registrar reaches etcd over TLS: every --etcd URL https://, --etcd-ca/--etcd-cert/--etcd-key the etcd "
          "Secret's ca.crt, tls.crt and tls.key",
          bool(urls) and all(u.startswith("https://") for u in urls) and len(secrets) == 1
          and all(len(got[f]) == 1 and got[f][0] and got[f][0][1] == k for f, k in want_keys.items()),
          f"--etcd {urls}, flags {flags}, mounted {got}")


def parse_peer(text):
    """A NetworkPolicyPeer from the test's shorthand: `namespace:k=v,...`, `pod:k=v,...`,
    `cidr:ADDR/LEN`, or several of them joined by `+` (one peer with each selector)."""
    peer = {}
    for part in text.split("+"):
        kind, _, spec = part.partition(":")
        if kind == "cidr":
            peer["ipBlock"] = {"cidr": spec}
        else:
            labels = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
            peer[{"namespace": "namespaceSelector", "pod": "podSelector"}[kind]] = {"matchLabels": labels}
    return peer


def check_registrar_network_policy(docs, d, argv, args):
    """registrar.networkPolicy: ingress to the registrar's pods on the gRPC port from the
    node CIDRs and the operator sources, on the metrics port from the metrics sources, and
    on no other port. Checked as rendered: whether it holds is the CNI's."""
    policies = objects_of(docs, "NetworkPolicy", "registrar")
    if not args.registrar_network_policy:
        check("no registrar NetworkPolicy unless registrar.networkPolicy.enabled", not policies, f"found {len(policies)}")
        return
    check("registrar NetworkPolicy rendered once (networking.k8s.io/v1)",
          len(policies) == 1 and policies[0].get("apiVersion") == "networking.k8s.io/v1",
          f"found {[p.get('apiVersion') for p in policies]}")
    spec = policies[0]["spec"]
    selector = spec.get("podSelector") or {}
    check("registrar NetworkPolicy selects the registrar's pods (the Deployment's selector), in their namespace",
          selector == {"matchLabels": d["spec"]["selector"]["matchLabels"]}
          and policies[0]["metadata"].get("namespace") == d["metadata"]["namespace"], f"podSelector {selector}")
    check("registrar NetworkPolicy restricts ingress only", spec.get("policyTypes") == ["Ingress"],
          f"policyTypes {spec.get('policyTypes')}")
    rules = spec.get("ingress") or []
    # A rule without ports admits every port, one without `from` every source.
    check("every rule of the registrar NetworkPolicy names its ports and its sources",
          bool(rules) and all(r.get("ports") and r.get("from") for r in rules), f"ingress {rules}")
    admitted = {}
    for r in rules:
        for port in r["ports"]:
            key = (port.get("protocol", "TCP"), port.get("port"), port.get("endPort"))
            admitted.setdefault(key, []).extend(json.dumps(p, sort_keys=True) for p in r["from"])
    grpc = int(flag_values(argv, "--listen")[0].rsplit(":", 1)[1])
    want = {("TCP", grpc, None): [{"ipBlock": {"cidr": c}} for c in args.node_cidr]
            + [parse_peer(p) for p in args.operator_source]}
    if args.registrar_metrics:
        metrics = int(flag_values(argv, "--metrics-addr")[0].rsplit(":", 1)[1])
        want[("TCP", metrics, None)] = [parse_peer(p) for p in args.metrics_source]
    want = {k: sorted(json.dumps(p, sort_keys=True) for p in v) for k, v in want.items()}
    got = {k: sorted(v) for k, v in admitted.items()}
    check("registrar NetworkPolicy admits the gRPC port (--listen) from exactly the node CIDRs and the operator "
          "sources, the metrics port (--metrics-addr) from exactly the metrics sources, and no other port",
          got == want, f"got {got}, want {want}")


def check_registrar_kubernetes(docs, d, agent_ds, argv, args):
    """The registrar's Kubernetes side: its flags as the values say, its token and RBAC
    exactly for the features that are on (TokenReview, discovery, the Lease, the taint
    guard), and the PodDisruptionBudget."""
    pod = d["spec"]["template"]["spec"]
    ns = d["metadata"]["namespace"]
    lease = args.discovery or args.taint_guard
    kube_api = lease or args.registrar_auth == "tokenReview"
    # Flags, from the values the rendering was made with.
    want = {
        "--discovery": ["on" if args.discovery else "off"],
        "--discover-namespace": args.discover_namespace if args.discovery else [],
        "--ignore-namespace": args.ignore_namespace if args.discovery else [],
        "--lease-name": [d["metadata"]["name"]] if lease else [],
        "--lease-duration": [str(args.lease_duration)] if lease else [],
        "--taint-grace": [str(args.taint_grace)] if args.taint_guard else [],
        "--agent-namespace": [agent_ds["metadata"]["namespace"]] if args.taint_guard else [],
    }
    got = {flag: flag_values(argv, flag) for flag in want}
    check(f"registrar flags match the values (discovery {args.discovery}, taint guard {args.taint_guard})",
          got == want and ("--taint-guard" in argv) == args.taint_guard,
          f"got {got}, --taint-guard {'--taint-guard' in argv}; want {want}")
    for flag in ("--leader-id", "--lease-namespace"):
        check(f"registrar {flag} comes from the downward API (env), not a flag", flag not in argv, f"argv {argv}")
    env = env_map(all_containers(pod)[0])
    for name, field in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace")):
        got_field = ((env.get(name) or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        check(f"registrar env {name} from fieldRef {field}" + ("" if lease else " (none without a Lease)"),
              got_field == field if lease else name not in env, f"got {env.get(name)}")
    if args.taint_guard:
        selector = flag_values(argv, "--agent-selector")
        terms = dict(t.split("=", 1) for t in selector[0].split(",")) if len(selector) == 1 and "=" in selector[0] else {}
        ds_selector = agent_ds["spec"]["selector"]["matchLabels"]
        check("registrar --agent-selector is the agent DaemonSet's selector (name, instance, component=agent)",
              terms == ds_selector and terms.get("app.kubernetes.io/component") == "agent"
              and "app.kubernetes.io/instance" in terms, f"got {selector}, DaemonSet selector {ds_selector}")
        # The guard covers exactly the nodes the agent runs on: its DaemonSet's nodeSelector as
        # a label selector (k=v terms, keys sorted; "" when it has none: every node).
        node_selector = flag_values(argv, "--guard-node-selector")
        terms = [t.split("=", 1) for t in node_selector[0].split(",")] if node_selector and node_selector[0] else []
        ds_node_selector = {k: str(v) for k, v in (agent_ds["spec"]["template"]["spec"].get("nodeSelector") or {}).items()}
        keys = [t[0] for t in terms]
        check("registrar --guard-node-selector is the agent DaemonSet's nodeSelector (k=v terms, keys sorted)",
              len(node_selector) == 1 and all(len(t) == 2 for t in terms) and dict(terms) == ds_node_selector
              and keys == sorted(keys) and len(keys) == len(set(keys)),
              f"got {node_selector}, DaemonSet nodeSelector {ds_node_selector}")
    else:
        check("registrar: no --agent-selector without the taint guard", "--agent-selector" not in argv, f"argv {argv}")
        check("registrar: no --guard-node-selector without the taint guard", "--guard-node-selector" not in argv,
              f"argv {argv}")

    check_registrar_node_policy(docs, d, agent_ds, args)

    # Its token: a service account of its own when it calls the Kubernetes API, else none.
    sa = pod.get("serviceAccountName")
    sas = [x["metadata"]["name"] for x in objects_of(docs, "ServiceAccount", "registrar")]
    if not kube_api:
        check("registrar pod: no service account token (it calls no Kubernetes API)",
              pod.get("automountServiceAccountToken") is False and not sa and not sas,
              f"automount {pod.get('automountServiceAccountToken')!r}, serviceAccountName {sa!r}, accounts {sas}")
        roles = [f"{x['kind']}/{x['metadata']['name']}" for kind in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
                 for x in objects_of(docs, kind, "registrar")]
        check("registrar RBAC: none (it calls no Kubernetes API)", not roles, f"found {roles}")
    else:
        agent_sa = agent_ds["spec"]["template"]["spec"].get("serviceAccountName")
        check("registrar pod: its own service account, not the agents', with its token mounted",
              sa and sa != agent_sa and sas == [sa] and pod.get("automountServiceAccountToken") is True,
              f"serviceAccountName {sa!r}, accounts {sas}, automount {pod.get('automountServiceAccountToken')!r}")
        want_cluster = {**(REGISTRAR_TOKEN_REVIEW if args.registrar_auth == "tokenReview" else {}),
                        **(REGISTRAR_DISCOVERY if args.discovery else {}),
                        **(REGISTRAR_GUARD_CLUSTER if args.taint_guard else {})}
        want_role = {}
        if lease:
            want_role[("coordination.k8s.io", "leases", (d["metadata"]["name"],))] = ["get", "update"]
            want_role[("coordination.k8s.io", "leases", ())] = ["create"]
        if args.taint_guard:
            want_role.update(REGISTRAR_GUARD_NAMESPACED)
        want_cluster = {k: sorted(v) for k, v in want_cluster.items()}
        want_role = {k: sorted(v) for k, v in want_role.items()}
        for kind, want_rules in (("ClusterRole", want_cluster), ("Role", want_role)):
            roles = objects_of(docs, kind, "registrar")
            check(f"registrar RBAC: {'one' if want_rules else 'no'} {kind}", len(roles) == (1 if want_rules else 0),
                  f"found {len(roles)}")
            if not roles:
                continue
            role = roles[0]
            for rule in role.get("rules", []):
                check(f"registrar RBAC: no wildcard in the {kind}",
                      "*" not in rule.get("verbs", []) + rule.get("resources", []) + rule.get("apiGroups", [])
                      + (rule.get("resourceNames") or []), f"rule {rule}")
            got_rules = rules_of(role)
            check(f"registrar RBAC: {kind} grants exactly {sorted(want_rules.items())}", got_rules == want_rules,
                  f"got {sorted(got_rules.items())}")
            if kind == "Role":
                check("registrar RBAC: the Role is in the release namespace (the Lease's and the agents')",
                      role["metadata"].get("namespace") == ns == agent_ds["metadata"]["namespace"],
                      f"Role in {role['metadata'].get('namespace')!r}, registrar in {ns!r}")
        # Bound to its service account, and that account bound to nothing else.
        bound = sorted((b["kind"], b["roleRef"]["kind"], b["roleRef"]["name"], b["metadata"].get("namespace", ""))
                       for kind in ("ClusterRoleBinding", "RoleBinding") for b in objects_of(docs, kind)
                       if any(x.get("kind") == "ServiceAccount" and x.get("name") == sa and x.get("namespace") == ns
                              for x in b.get("subjects", []) or []))
        want_bound = sorted([("ClusterRoleBinding", "ClusterRole", x["metadata"]["name"], "")
                             for x in objects_of(docs, "ClusterRole", "registrar")]
                            + [("RoleBinding", "Role", x["metadata"]["name"], ns) for x in objects_of(docs, "Role", "registrar")])
        check("registrar service account bound to its own ClusterRole and Role only", bound == want_bound,
              f"got {bound}, want {want_bound}")

    # The PodDisruptionBudget: one replica at a time, over exactly the registrar's pods.
    pdbs = objects_of(docs, "PodDisruptionBudget", "registrar")
    check("registrar PodDisruptionBudget rendered once (policy/v1)",
          len(pdbs) == 1 and pdbs[0].get("apiVersion") == "policy/v1", f"found {[p.get('apiVersion') for p in pdbs]}")
    spec = pdbs[0]["spec"]
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    labels = d["spec"]["template"]["metadata"]["labels"]
    agent_labels = agent_ds["spec"]["template"]["metadata"]["labels"]
    check("registrar PodDisruptionBudget selects the registrar pods (the Deployment's selector), in its namespace",
          selector == d["spec"]["selector"]["matchLabels"] and all(labels.get(k) == v for k, v in selector.items())
          and not (spec.get("selector") or {}).get("matchExpressions")
          and not all(agent_labels.get(k) == v for k, v in selector.items())
          and pdbs[0]["metadata"].get("namespace") == ns, f"selector {spec.get('selector')}, pod labels {labels}")
    budget = {k: spec[k] for k in ("maxUnavailable", "minAvailable") if k in spec}
    check("registrar PodDisruptionBudget: maxUnavailable 1 or minAvailable 1",
          budget in ({"maxUnavailable": 1}, {"minAvailable": 1}), f"got {budget}")


def check_proxy(docs, args):
    proxies = objects_of(docs, "DaemonSet", "proxy")
    maps = objects_of(docs, "ConfigMap", "proxy")
    if not args.proxy:
        check("no proxy objects with proxy.enabled=false", not proxies and not maps,
              f"found {len(proxies)} DaemonSet(s), {len(maps)} ConfigMap(s)")
        return
    check("proxy DaemonSet and bootstrap ConfigMap rendered once", len(proxies) == 1 and len(maps) == 1,
          f"found {len(proxies)} DaemonSet(s), {len(maps)} ConfigMap(s)")
    pod = proxies[0]["spec"]["template"]["spec"]
    check("proxy pod: hostNetwork true", pod.get("hostNetwork") is True, f"got {pod.get('hostNetwork')!r}")
    check("proxy pod: no service account token", pod.get("automountServiceAccountToken") is False,
          f"got {pod.get('automountServiceAccountToken')!r}")
    check(f"proxy hostPath list is exactly [{RUN_DIR}]", host_paths(pod) == [RUN_DIR], f"got {host_paths(pod)}")
    for c in all_containers(pod):
        check_container_hardening("proxy pod", c)
        extra = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add")
        check(f"proxy pod: container {c['name']} adds no capability", not extra, f"got {extra}")
    envoy = pod["containers"][0]
    node = ((env_map(envoy).get("NODE_NAME") or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
    check("proxy env NODE_NAME from fieldRef spec.nodeName", node == "spec.nodeName", f"got {node!r}")
    argv = envoy.get("command", []) + envoy.get("args", [])
    check("proxy node id is the node name (--service-node $(NODE_NAME))",
          any(a == "--service-node" and b == "$(NODE_NAME)" for a, b in zip(argv, argv[1:])), f"argv {argv}")
    cm_name = maps[0]["metadata"]["name"]
    cm_vols = [v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v]
    check("proxy mounts the bootstrap ConfigMap", cm_vols == [cm_name], f"got {cm_vols}, want [{cm_name}]")
    config_path = next((b for a, b in zip(argv, argv[1:]) if a in ("-c", "--config-path")), None)
    mounts = {m["name"]: m["mountPath"] for m in envoy.get("volumeMounts", [])}
    cm_mount = next((mounts[v["name"]] for v in pod["volumes"] if "configMap" in v), None)
    keys = list(maps[0].get("data", {}))
    check("envoy --config-path is the ConfigMap's key",
          config_path is not None and cm_mount is not None and len(keys) == 1
          and config_path == f"{cm_mount.rstrip('/')}/{keys[0]}",
          f"config path {config_path!r}, mount {cm_mount!r}, keys {keys}")

    boot = yaml.safe_load(maps[0]["data"][keys[0]])
    ads = boot["dynamic_resources"]["ads_config"]
    check(f"bootstrap: ADS api_type {args.ads_api_type}, transport V3, node on first message only",
          ads.get("api_type") == args.ads_api_type and ads.get("transport_api_version") == "V3"
          and ads.get("set_node_on_first_message_only") is True, f"got {ads}")
    services = ads.get("grpc_services") or []
    grpc = (services[0] if len(services) == 1 else {}).get("envoy_grpc") or {}
    backoff = (grpc.get("retry_policy") or {}).get("retry_back_off") or {}
    check("bootstrap: ADS over envoy_grpc cluster xds_cluster", grpc.get("cluster_name") == "xds_cluster",
          f"got {services}")
    want_backoff = {"base_interval": args.backoff_base, "max_interval": args.backoff_max}
    check(f"bootstrap backoff retry_back_off == {want_backoff}", backoff == want_backoff, f"got {backoff}")
    # The mesh's per-cluster and per-virtual-host stats: excluded unless proxy.meshStats.
    excluded = {"stats_matcher": {"exclusion_list": {"patterns": [{"prefix": "cluster.outbound|"}, {"prefix": "vhost."}]}}}
    want_stats = None if args.mesh_stats else excluded
    check(f"bootstrap: mesh stats {'kept (no stats_config)' if args.mesh_stats else 'excluded (cluster.outbound|, vhost.)'}",
          boot.get("stats_config") == want_stats, f"got {boot.get('stats_config')}")
    for key in ("cds_config", "lds_config"):
        got = boot["dynamic_resources"].get(key)
        check(f"bootstrap: {key} over ADS, V3", got == {"ads": {}, "resource_api_version": "V3"}, f"got {got}")
    # Envoy's admin interface: a unix socket in the pod's own emptyDir, mode 0600, never TCP.
    admin = ((boot.get("admin") or {}).get("address") or {})
    admin_path = str((admin.get("pipe") or {}).get("path", ""))
    check(f"bootstrap: admin on a unix socket under {ENVOY_ADMIN_DIR}, mode 0600, not on TCP",
          "socket_address" not in admin and admin_path.startswith(ENVOY_ADMIN_DIR + "/")
          and (admin.get("pipe") or {}).get("mode") == 0o600, f"got {admin}")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    admin_mounts = [m for m in envoy.get("volumeMounts", []) if m["mountPath"] == ENVOY_ADMIN_DIR]
    check(f"proxy: {ENVOY_ADMIN_DIR} is a pod-private emptyDir",
          len(admin_mounts) == 1 and "emptyDir" in volumes.get(admin_mounts[0]["name"], {}), f"mounts {admin_mounts}")
    # The kubelet's probe cannot reach a unix socket: one loopback listener forwards GET
    # /ready, and nothing else, to the admin socket.
    listeners = boot.get("static_resources", {}).get("listeners") or []
    names = [x.get("name") for x in listeners]
    want = ["proxy_ready"] + (["proxy_stats"] if args.proxy_stats else [])
    check(f"bootstrap: static listeners {want} (readiness{', stats' if args.proxy_stats else ''})", names == want,
          f"got {names}")
    lst = listeners[0]
    sock = (lst.get("address") or {}).get("socket_address") or {}
    port = sock.get("port_value")
    hcm = lst["filter_chains"][0]["filters"][0]["typed_config"]
    routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh.get("routes", [])]
    forward = [r for r in routes if "route" in r]
    rest = [r for r in routes if "direct_response" in r]
    ok = (len(forward) == 1 and forward[0]["match"] == {"path": "/ready", "headers": [
        {"name": ":method", "string_match": {"exact": "GET"}}]} and forward[0]["route"].get("cluster") == "envoy_admin"
        and len(rest) == 1 and rest[0]["match"] == {"prefix": "/"} and rest[0]["direct_response"].get("status") == 404
        and routes[-1] is rest[0])
    check("readiness listener: on 127.0.0.1, forwards GET /ready only to the admin socket, 404 to the rest",
          sock.get("address") == "127.0.0.1" and ok, f"address {sock}, routes {routes}")
    probe = (envoy.get("readinessProbe") or {}).get("httpGet") or {}
    check("proxy readinessProbe: GET 127.0.0.1:<readiness listener>/ready",
          probe.get("host") == "127.0.0.1" and probe.get("port") == port and probe.get("path") == "/ready",
          f"probe {probe}, listener port {port}")
    clusters = {c["name"]: c for c in boot.get("static_resources", {}).get("clusters", [])}
    admin_pipes = [ep["endpoint"]["address"].get("pipe", {}).get("path")
                   for group in (clusters.get("envoy_admin", {}).get("load_assignment") or {}).get("endpoints", [])
                   for ep in group.get("lb_endpoints", [])]
    check("bootstrap: cluster envoy_admin is the admin socket", admin_pipes == [admin_path], f"got {admin_pipes}")
    if args.proxy_stats:
        # Prometheus' scrape of Envoy: GET /stats/prometheus, and nothing else, from the admin
        # socket (the admin interface also serves POST /quitquitquit and /config_dump).
        stats = listeners[1]
        sock = (stats.get("address") or {}).get("socket_address") or {}
        hcm = stats["filter_chains"][0]["filters"][0]["typed_config"]
        routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh.get("routes", [])]
        forward = [r for r in routes if "route" in r]
        rest = [r for r in routes if "direct_response" in r]
        ok = (len(forward) == 1 and forward[0]["match"] == {"path": "/stats/prometheus", "headers": [
            {"name": ":method", "string_match": {"exact": "GET"}}]}
            and forward[0]["route"].get("cluster") == "envoy_admin"
            and len(rest) == 1 and rest[0]["match"] == {"prefix": "/"} and rest[0]["direct_response"].get("status") == 404
            and routes[-1] is rest[0] and len(routes) == 2)
        check(f"stats listener: on {args.stats_host}:{args.stats_port}, forwards GET /stats/prometheus only to the "
              "admin socket, 404 to the rest",
              sock.get("address") == args.stats_host and sock.get("port_value") == args.stats_port and ok,
              f"address {sock}, routes {routes}")
    annotations = proxies[0]["spec"]["template"]["metadata"].get("annotations") or {}
    scrape = {k: v for k, v in annotations.items() if k.startswith("prometheus.io/")}
    want_scrape = ({"prometheus.io/scrape": "true", "prometheus.io/port": str(args.stats_port),
                    "prometheus.io/path": "/stats/prometheus"} if args.proxy_stats else {})
    check("proxy prometheus.io annotations name the stats listener (none without proxy.stats)", scrape == want_scrape,
          f"got {scrape}")

    xds = clusters.get("xds_cluster", {})
    check("bootstrap: xds_cluster STATIC, connect_timeout 1s",
          xds.get("type") == "STATIC" and xds.get("connect_timeout") == "1s", f"got {xds}")
    http = (xds.get("typed_extension_protocol_options") or {}).get(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions") or {}
    check("bootstrap: xds_cluster speaks HTTP/2",
          http.get("@type") == "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
          and (http.get("explicit_http_config") or {}).get("http2_protocol_options") == {}, f"got {http}")
    pipes = [ep["endpoint"]["address"].get("pipe", {}).get("path")
             for group in (xds.get("load_assignment") or {}).get("endpoints", [])
             for ep in group.get("lb_endpoints", [])]
    want_pipe = RELAY_SOCKET if args.relay else f"{RUN_DIR}/xds.sock"
    check(f"bootstrap: xds_cluster endpoint is the pipe {want_pipe}"
          f"{' (the relay' + chr(39) + 's socket)' if args.relay else ''}", pipes == [want_pipe], f"got {pipes}")
    check_relay(docs, proxies[0], envoy, args)


def relay_container(pod):
    """The relay container of a proxy pod spec (None without one)."""
    return next((c for c in all_containers(pod) if c["name"] == "xds-relay"), None)


def check_relay(docs, ds, envoy, args):
    """The xDS relay (proxy.relay): a native sidecar of the proxy pod between Envoy and the
    node's xds.sock, as its own user with no capability, its socket in the pod's own folder."""
    pod = ds["spec"]["template"]["spec"]
    relay = relay_container(pod)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    envoy_mounts = {m["mountPath"]: m for m in envoy.get("volumeMounts", [])}
    if not args.relay:
        check("no relay container, relay volume or relay socket without proxy.relay.enabled",
              relay is None and RELAY_DIR not in envoy_mounts, f"relay {relay and relay['name']}, mounts {list(envoy_mounts)}")
        run = envoy_mounts.get(RUN_DIR)
        check(f"envoy mounts {RUN_DIR} read-only (it dials xds.sock) without the relay",
              run is not None and run.get("readOnly") is True and "hostPath" in volumes.get(run["name"], {}), f"got {run}")
        return
    inits = pod.get("initContainers") or []
    check("relay: the proxy pod's first init container, xds-relay, a native sidecar (restartPolicy Always)",
          bool(inits) and inits[0]["name"] == "xds-relay" and inits[0].get("restartPolicy") == "Always"
          and relay_container({"containers": pod.get("containers")}) is None,
          f"init containers {[(c['name'], c.get('restartPolicy')) for c in inits]}")
    images = {c["name"]: c.get("image") for c in all_containers(pod)}
    agent_image = [c.get("image") for d in objects_of(docs, "DaemonSet", "agent")
                   for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "agent"]
    check("relay: runs the agent's image (which ships aether-xds-relay)",
          agent_image and images["xds-relay"] == agent_image[0], f"relay {images['xds-relay']}, agent {agent_image}")
    sc, psc = relay.get("securityContext") or {}, pod.get("securityContext") or {}
    uid, gid = sc.get("runAsUser", psc.get("runAsUser")), sc.get("runAsGroup", psc.get("runAsGroup"))
    envoy_sc = envoy.get("securityContext") or {}
    envoy_uid = envoy_sc.get("runAsUser", psc.get("runAsUser"))
    envoy_gid = envoy_sc.get("runAsGroup", psc.get("runAsGroup"))
    check(f"relay: its own user (uid {uid}, gid {gid}): not root, not Envoy's ({envoy_uid}:{envoy_gid}), runAsNonRoot",
          isinstance(uid, int) and uid not in (0, envoy_uid) and isinstance(gid, int) and gid not in (0, envoy_gid)
          and sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, f"got {sc}")
    groups = psc.get("supplementalGroups") or []
    worker_gid = int(WORKER_USER.split(":")[1])
    check(f"relay: the pod's groups hold the worker's ({worker_gid}: xds.sock) and the relay's ({gid}: its socket, "
          "for Envoy)", worker_gid in groups and gid in groups, f"got {groups}")
    argv = relay.get("command", []) + relay.get("args", [])
    flags = dict(zip(argv[1::2], argv[2::2]))
    want_metrics = "off"
    if args.relay_metrics:
        want_metrics = f"$(HOST_IP):{args.relay_metrics_port}"
    want = {"--listen": f"unix://{RELAY_SOCKET}", "--upstream": f"unix://{RUN_DIR}/xds.sock",
            "--upstream-grace": args.relay_grace, "--log-format": "json", "--metrics-addr": want_metrics}
    check(f"relay: argv aether-xds-relay {' '.join(f'{k} {v}' for k, v in want.items())}",
          argv[:1] == ["aether-xds-relay"] and flags == want and len(argv) == 1 + 2 * len(want), f"got {argv}")
    host_ip = ((env_map(relay).get("HOST_IP") or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
    check("relay: HOST_IP from status.hostIP with metrics on (and no env without)",
          host_ip == "status.hostIP" if args.relay_metrics else not relay.get("env"), f"got {relay.get('env')}")
    if args.relay_metrics:
        taken = {METRICS_PORT: "agent.metrics.port", args.stats_port: "proxy.stats.port"}
        check(f"relay: metrics port {args.relay_metrics_port} is none of the node's other ports ({taken})",
              args.relay_metrics_port not in taken, f"got {args.relay_metrics_port}")
    mounts = {m["mountPath"]: m for m in relay.get("volumeMounts", [])}
    run, own = mounts.get(RUN_DIR), mounts.get(RELAY_DIR)
    check(f"relay: mounts exactly {RUN_DIR} (the node's, read-only) and {RELAY_DIR} (an emptyDir)",
          set(mounts) == {RUN_DIR, RELAY_DIR} and run.get("readOnly") is True
          and (volumes.get(run["name"], {}).get("hostPath") or {}).get("path") == RUN_DIR
          and "emptyDir" in volumes.get(own["name"], {}), f"got {mounts}")
    shared = envoy_mounts.get(RELAY_DIR)
    check(f"envoy: mounts the relay's folder {RELAY_DIR} (the same emptyDir), and not {RUN_DIR}",
          shared is not None and shared["name"] == own["name"] and RUN_DIR not in envoy_mounts,
          f"envoy mounts {list(envoy_mounts)}")


def check_monitoring(docs, agent_ds, args):
    """The Grafana dashboard ConfigMap and the PrometheusRule: off by default; on, the
    chart's own files, the dashboard under the sidecar's label and the rules naming the
    release's agent DaemonSet."""
    chart = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "charts", "aether-agent")
    dashboards = [d for d in objects_of(docs, "ConfigMap")
                  if "grafana_dashboard" in ((d.get("metadata") or {}).get("labels") or {})]
    if not args.dashboards:
        check("no dashboard ConfigMap unless dashboards.enabled", not dashboards, f"found {len(dashboards)}")
    else:
        check("dashboard ConfigMap rendered once", len(dashboards) == 1, f"found {len(dashboards)}")
        cm = dashboards[0]
        label = cm["metadata"]["labels"]["grafana_dashboard"]
        check('dashboard ConfigMap: label grafana_dashboard: "1" (a string), the sidecar\'s default', label == "1",
              f"got {label!r}")
        with open(os.path.join(chart, "dashboards", "aether-agent.json"), encoding="utf-8") as f:
            want = json.load(f)
        data = cm.get("data") or {}
        got = {k: json.loads(v) for k, v in data.items()}
        check("dashboard ConfigMap: one key, aether-agent.json, the chart's dashboard as it is",
              list(got) == ["aether-agent.json"] and got["aether-agent.json"] == want, f"keys {list(got)}")
    rules = objects_of(docs, "PrometheusRule")
    if not args.alerts:
        check("no PrometheusRule unless alerts.enabled", not rules, f"found {len(rules)}")
        return
    check("PrometheusRule rendered once, in the release's namespace",
          len(rules) == 1 and rules[0]["metadata"].get("namespace") == agent_ds["metadata"].get("namespace"),
          f"found {len(rules)}")
    with open(os.path.join(chart, "alerts", "aether-agent.rules.yaml"), encoding="utf-8") as f:
        text = f.read()
    name = agent_ds["metadata"]["name"]
    registrar = f"{name}-registrar"[:63].rstrip("-")
    want = yaml.safe_load(text.replace('created_by_name="aether-agent"', f'created_by_name="{name}"').replace(
        'created_by_name=~"aether-agent-registrar-[a-z0-9]+"', f'created_by_name=~"{registrar}-[a-z0-9]+"'))["groups"]
    got = rules[0].get("spec", {}).get("groups")
    check(f"PrometheusRule: the chart's rules file, its agent DaemonSet named {name}", got == want,
          f"got {json.dumps(got)[:300]}")
    stalled = [r for g in got or [] for r in g.get("rules", []) if r.get("alert") == "AetherAgentRollStalled"]
    check(f"PrometheusRule: AetherAgentRollStalled watches the pods of DaemonSet {name}",
          len(stalled) == 1 and f'created_by_name="{name}"' in stalled[0]["expr"], f"got {stalled}")
    not_ready = [r for g in got or [] for r in g.get("rules", []) if r.get("alert") == "AetherRegistrarNotReady"]
    check(f"PrometheusRule: AetherRegistrarNotReady watches the pods of Deployment {registrar}'s ReplicaSets",
          len(not_ready) == 1 and f'created_by_name=~"{registrar}-[a-z0-9]+"' in not_ready[0]["expr"], f"got {not_ready}")


def check_unit(path):
    """The systemd unit: the contract's folders, Type=notify, and the chart's capability set."""
    settings = {}
    section = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            key, _, value = line.partition("=")
            settings.setdefault((section, key.strip()), []).append(value.strip())
    print(f"== {path}")

    def one(key, section="Service"):
        values = settings.get((section, key), [])
        return values[-1] if values else None

    for key, want in (("Type", "notify"), ("NotifyAccess", "main"), ("Restart", "on-failure"),
                      ("RestartSec", "1"), ("KillMode", "mixed"), ("TimeoutStopSec", "30"),
                      ("RuntimeDirectoryPreserve", "yes"), ("StateDirectory", "aether"),
                      ("NoNewPrivileges", "yes"), ("FileDescriptorStoreMax", "2")):
        check(f"unit {key}={want}", one(key) == want, f"got {one(key)!r}")
    runtime = sorted((one("RuntimeDirectory") or "").split())
    check("unit RuntimeDirectory=aether aether-health", runtime == ["aether", "aether-health"], f"got {runtime}")
    argv = (one("ExecStart") or "").split()
    check("unit ExecStart runs /usr/local/bin/aether-supervisor", argv[:1] == ["/usr/local/bin/aether-supervisor"],
          f"got {argv}")
    flags = dict(zip(argv[1::2], argv[2::2]))
    want_flags = {"--run-dir": RUN_DIR, "--state-dir": f"{STATE_DIR}/worker", "--health-dir": "/run/aether-health/worker"}
    check(f"unit ExecStart flags {want_flags}", flags == want_flags, f"got {argv[1:]}")
    # systemd re-owns a StateDirectory=/RuntimeDirectory= tree to the unit's user (root) at a
    # start whose top folder is not root's: the worker's folders are subfolders of root-owned
    # 0755 ones, which the supervisor never hands over.
    for key, base, flag in (("StateDirectory", "/var/lib", "--state-dir"), ("RuntimeDirectory", "/run", "--health-dir")):
        tops = [f"{base}/{d}" for d in (one(key) or "").split()]
        inside = [t for t in tops if flags.get(flag, "").startswith(t + "/")]
        check(f"unit {flag} is a subfolder of a {key}= folder", len(inside) == 1, f"got {flags.get(flag)!r} in {tops}")
        check(f"unit {key}Mode=0755 (root's, left to root)", one(f"{key}Mode") == "0755", f"got {one(f'{key}Mode')!r}")
    watchdog = one("WatchdogSec") or ""
    check("unit WatchdogSec= is a whole number of seconds above the 5 s heartbeat deadline",
          watchdog.isdigit() and int(watchdog) > 5, f"got {watchdog!r}")
    for key in ("LimitNOFILE", "MemoryMax", "TasksMax"):
        check(f"unit sets {key}=", bool(one(key)), "missing")
    check("unit SystemCallFilter= is @system-service (and seccomp for the worker's own filter)",
          sorted((one("SystemCallFilter") or "").split()) == ["@system-service", "seccomp"],
          f"got {one('SystemCallFilter')!r}")
    families = (one("RestrictAddressFamilies") or "").split()
    check("unit RestrictAddressFamilies= is AF_UNIX AF_INET AF_INET6 and AF_NETLINK (sock_diag)",
          sorted(families) == ["AF_INET", "AF_INET6", "AF_NETLINK", "AF_UNIX"], f"got {families}")
    # --cni-conf-dir needs its folder writable under ProtectSystem=strict: the unit documents
    # the two lines together, and a unit that sets the folder must list it.
    env = " ".join(settings.get(("Service", "Environment"), []) + argv)
    conf = re.search(r"(?:AETHER_CNI_CONF_DIR=|--cni-conf-dir[= ])(\S+)", env)
    writable = " ".join(settings.get(("Service", "ReadWritePaths"), [])).split()
    check("unit ReadWritePaths= covers the CNI conf dir it sets",
          conf is None or conf.group(1) in [w.lstrip("-") for w in writable], f"got {writable} for {conf and conf.group(1)}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    check("unit documents AETHER_CNI_CONF_DIR with its ReadWritePaths=",
          re.search(r"^#?Environment=AETHER_CNI_CONF_DIR=/etc/cni/net.d\n#?ReadWritePaths=/etc/cni/net.d$", text, re.M),
          "missing")
    bounding = (one("CapabilityBoundingSet") or "").split()
    want_caps = [f"CAP_{c}" for c in AGENT_CAPS]
    check(f"unit CapabilityBoundingSet is the chart's set {want_caps}",
          sorted(bounding) == sorted(want_caps) and len(bounding) == len(set(bounding)), f"got {bounding}")
    ambient = one("AmbientCapabilities")
    check("unit grants no ambient capabilities", not ambient, f"got {ambient!r}")


def unit_settings(path):
    """A unit file's settings: (section, key) -> every value, in order."""
    settings, section = {}, None
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            key, _, value = line.partition("=")
            settings.setdefault((section, key.strip()), []).append(value.strip())
    return settings


# The relay unit's sandbox: each setting as the unit must have it.
RELAY_UNIT_SANDBOX = {
    "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
    "PrivateDevices": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes", "ProtectControlGroups": "yes", "ProtectClock": "yes", "ProtectHostname": "yes",
    "RestrictNamespaces": "yes", "RestrictRealtime": "yes", "RestrictSUIDSGID": "yes", "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes", "SystemCallArchitectures": "native", "SystemCallFilter": "@system-service seccomp",
    "RuntimeDirectory": "aether-relay", "RuntimeDirectoryMode": "0750", "RuntimeDirectoryPreserve": "yes",
}


def check_relay_unit(path):
    """The xDS relay's systemd unit: its own user, the worker's group for xds.sock, no
    capability, the sandbox of the agent's unit and more, and its socket in its runtime folder."""
    settings = unit_settings(path)
    print(f"== {path}")

    def one(key, section="Service"):
        values = settings.get((section, key), [])
        return values[-1] if values else None

    worker_uid, worker_gid = (int(x) for x in WORKER_USER.split(":"))
    user, group = one("User") or "", one("Group") or ""
    check(f"relay unit User= and Group= are its own: numeric, not root, not the worker's ({WORKER_USER})",
          user.isdigit() and group.isdigit() and int(user) not in (0, worker_uid) and int(group) not in (0, worker_gid),
          f"got User={user!r} Group={group!r}")
    supplementary = (one("SupplementaryGroups") or "").split()
    check(f"relay unit SupplementaryGroups= is the worker's group {worker_gid} only (xds.sock)",
          supplementary == [str(worker_gid)], f"got {supplementary}")
    for key in ("CapabilityBoundingSet", "AmbientCapabilities"):
        values = settings.get(("Service", key))
        check(f"relay unit {key}= is empty (no capability)", values is not None and values[-1] == "", f"got {values}")
    for key, want in RELAY_UNIT_SANDBOX.items():
        check(f"relay unit {key}={want}", one(key) == want, f"got {one(key)!r}")
    families = sorted((one("RestrictAddressFamilies") or "").split())
    check("relay unit RestrictAddressFamilies= is AF_UNIX AF_INET AF_INET6",
          families == ["AF_INET", "AF_INET6", "AF_UNIX"], f"got {families}")
    argv = (one("ExecStart") or "").split()
    flags = dict(zip(argv[1::2], argv[2::2]))
    want = {"--listen": "unix:///run/aether-relay/xds.sock", "--upstream": f"unix://{RUN_DIR}/xds.sock"}
    check(f"relay unit ExecStart runs /usr/local/bin/aether-xds-relay {want} (metrics off, the default)",
          argv[:1] == ["/usr/local/bin/aether-xds-relay"] and flags == want and len(argv) == 5, f"got {argv}")
    for key in ("LimitNOFILE", "TasksMax"):
        check(f"relay unit sets {key}=", bool(one(key)), "missing")


def main():
    global KUBE_VERSION  # noqa: PLW0603 - one run checks one version
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--surge", type=parse_bool, help="required with RENDERED.yaml")
    parser.add_argument("--proxy", type=parse_bool, default=False)
    parser.add_argument("--keeper", type=parse_bool, default=True)
    parser.add_argument("--registrar", type=parse_bool, default=False,
                        help="the rendering has registrar.enabled=true")
    parser.add_argument("--registrar-auth", default="tokenReview", choices=["tokenReview", "none"],
                        help="registrar.auth")
    parser.add_argument("--registrar-spiffe-id", default="",
                        help="with --registrar-tls spiffe: the SPIFFE ID the agents must check")
    parser.add_argument("--agent-spiffe-id", action="append", default=[],
                        help="with --registrar-tls spiffe: an --agent-spiffe-id the registrar must take")
    parser.add_argument("--registrar-tls", default="secret", choices=["secret", "cert-manager", "none", "spiffe"],
                        help="the registrar's TLS source: registrar.tls.secretName, registrar.tls.certManager, or "
                             "none (registrar.insecureTransport)")
    parser.add_argument("--cert-manager-issuer", default="", help="registrar.tls.certManager.issuerRef.name")
    parser.add_argument("--cert-manager-kind", default="Issuer", help="registrar.tls.certManager.issuerRef.kind")
    parser.add_argument("--registrar-etcd-tls", type=parse_bool, default=True,
                        help="registrar.etcd.tls.secretName is set (false: registrar.insecureTransport)")
    parser.add_argument("--registrar-network-policy", type=parse_bool, default=False,
                        help="registrar.networkPolicy.enabled")
    parser.add_argument("--node-cidr", action="append", default=[],
                        help="an entry of registrar.networkPolicy.nodeCIDRs (repeatable)")
    parser.add_argument("--operator-source", action="append", default=[],
                        help="an entry of registrar.networkPolicy.operatorSources, as namespace:k=v, pod:k=v or "
                             "cidr:ADDR/LEN, joined by + (repeatable)")
    parser.add_argument("--metrics-source", action="append", default=[],
                        help="an entry of registrar.networkPolicy.metricsSources, as --operator-source")
    parser.add_argument("--registrar-metrics", type=parse_bool, default=False, help="registrar.metrics.enabled")
    parser.add_argument("--registrar-pod-monitor", type=parse_bool, default=False,
                        help="registrar.metrics.podMonitor.enabled")
    parser.add_argument("--discovery", type=parse_bool, default=True, help="registrar.discovery.enabled")
    parser.add_argument("--discover-namespace", action="append", default=[],
                        help="an entry of registrar.discovery.namespaces, in order (repeatable)")
    parser.add_argument("--ignore-namespace", action="append", default=[],
                        help="an entry of registrar.discovery.ignoreNamespaces, in order (repeatable)")
    parser.add_argument("--lease-duration", type=int, default=15, help="registrar.leaderElection.leaseDuration")
    parser.add_argument("--taint-guard", type=parse_bool, default=True, help="registrar.taintGuard.enabled")
    parser.add_argument("--taint-grace", type=int, default=30, help="registrar.taintGuard.grace")
    parser.add_argument("--spiffe-dir", default="")
    parser.add_argument("--spire-admin-dir", default="")
    parser.add_argument("--trust-domain", default="")
    parser.add_argument("--mtls", default="permissive")
    parser.add_argument("--backoff-base", default="0.1s")
    parser.add_argument("--backoff-max", default="1s")
    parser.add_argument("--ads-api-type", default="DELTA_GRPC", choices=["GRPC", "DELTA_GRPC"])
    parser.add_argument("--metrics", type=parse_bool, default=False, help="agent.metrics.enabled")
    parser.add_argument("--pod-monitor", type=parse_bool, default=False, help="agent.metrics.podMonitor.enabled")
    parser.add_argument("--proxy-stats", type=parse_bool, default=False, help="proxy.stats.enabled")
    parser.add_argument("--relay", type=parse_bool, default=False, help="proxy.relay.enabled")
    parser.add_argument("--relay-grace", default="30s", help="proxy.relay.upstreamGrace")
    parser.add_argument("--relay-metrics", type=parse_bool, default=False, help="proxy.relay.metrics.enabled")
    parser.add_argument("--relay-metrics-port", type=int, default=15092, help="proxy.relay.metrics.port")
    parser.add_argument("--relay-pod-monitor", type=parse_bool, default=False,
                        help="proxy.relay.metrics.podMonitor.enabled")
    parser.add_argument("--relay-creds", action="store_true",
                        help="print the relay container's credentials and argv as shell assignments (uid, gid, "
                             "groups, caps, seccomp, ro_root, nnp, argv) instead of checking")
    parser.add_argument("--mesh-stats", type=parse_bool, default=False, help="proxy.meshStats")
    parser.add_argument("--stats-host", default="0.0.0.0", help="proxy.stats.host")
    parser.add_argument("--stats-port", type=int, default=15091, help="proxy.stats.port")
    parser.add_argument("--dashboards", type=parse_bool, default=False, help="dashboards.enabled")
    parser.add_argument("--alerts", type=parse_bool, default=False, help="alerts.enabled")
    parser.add_argument("--uninstall", type=parse_bool, default=True, help="cni.uninstall.enabled")
    parser.add_argument("--max-unavailable", type=int, default=1, help="agent.updateStrategy.maxUnavailable")
    parser.add_argument("--log-format", default="json", choices=["json", "text"])
    parser.add_argument("--kubernetes-version", default="1.34.0",
                        help="the Kubernetes version whose NodeSpec the node policy must guard")
    parser.add_argument("--unit", help="check this systemd unit instead of a rendering")
    parser.add_argument("--relay-unit", help="check this systemd unit of the xDS relay instead of a rendering")
    parser.add_argument("--uninstall-creds", action="store_true",
                        help="print the uninstall hook's init container (credentials, argv, host mounts) as "
                             "shell assignments instead of checking")
    parser.add_argument("--probe-creds", action="store_true",
                        help="print the agent container's credentials and readiness probe as shell "
                             "assignments (uid, gid, groups, caps, probe) instead of checking")
    parser.add_argument("--registrar-creds", action="store_true",
                        help="print the registrar container's credentials, argv and Secret files as shell "
                             "assignments (uid, gid, groups, caps, argv, secrets) instead of checking")
    parser.add_argument("rendered", nargs="?")
    args = parser.parse_args()

    KUBE_VERSION = args.kubernetes_version
    if args.relay_unit:
        try:
            check_relay_unit(args.relay_unit)
        except CheckFailed:
            return 1
        print("all checks passed")
        return 0
    if args.unit:
        try:
            check_unit(args.unit)
        except CheckFailed:
            return 1
        print("all checks passed")
        return 0
    if args.probe_creds:
        with open(args.rendered, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        pod = objects_of(docs, "DaemonSet", "agent")[0]["spec"]["template"]["spec"]
        agent = {c["name"]: c for c in pod["containers"]}["agent"]
        sc, psc = agent.get("securityContext") or {}, pod.get("securityContext") or {}
        uid = sc.get("runAsUser", psc.get("runAsUser", 0))
        gid = sc.get("runAsGroup", psc.get("runAsGroup", uid))
        # fsGroup joins every container's processes too.
        groups = ",".join(str(g) for g in (psc.get("supplementalGroups") or [])
                          + ([psc["fsGroup"]] if "fsGroup" in psc else []))
        caps = (sc.get("capabilities") or {})
        assert caps.get("drop") == ["ALL"], f"the probe test assumes drop [ALL], got {caps.get('drop')}"
        probe = " ".join(shlex.quote(a) for a in agent["readinessProbe"]["exec"]["command"])
        print(f"uid={uid}\ngid={gid}\ngroups={groups}\ncaps={','.join(c.lower() for c in caps.get('add') or [])}")
        print(f"probe={shlex.quote(probe)}")
        return 0
    if args.registrar_creds:
        with open(args.rendered, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        pod = objects_of(docs, "Deployment", "registrar")[0]["spec"]["template"]["spec"]
        c = all_containers(pod)[0]
        sc, psc = c.get("securityContext") or {}, pod.get("securityContext") or {}
        assert (sc.get("capabilities") or {}).get("drop") == ["ALL"], "the registrar test assumes drop [ALL]"
        uid = sc.get("runAsUser", psc.get("runAsUser", 0))
        # The kubelet adds fsGroup to the container's groups, and makes it the group of the
        # Secret volumes' files.
        groups = [str(g) for g in (psc.get("supplementalGroups") or []) + ([psc["fsGroup"]] if "fsGroup" in psc else [])]
        print(f"uid={uid}\ngid={sc.get('runAsGroup', psc.get('runAsGroup', uid))}\ngroups={','.join(groups)}")
        print(f"file_group={psc.get('fsGroup', 0)}")
        print(f"caps={','.join(x.lower() for x in (sc.get('capabilities') or {}).get('add') or [])}")
        print(f"argv={shlex.quote(' '.join(shlex.quote(a) for a in c.get('command', []) + c.get('args', [])))}")
        files = " ".join(f"{path}={key}={mode:o}" for path, _, key, mode in secret_files(pod, c))
        print(f"secrets={shlex.quote(files)}")
        # The probes as the kubelet runs them: a GET of the path on the named port.
        ports = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
        for probe in ("readinessProbe", "livenessProbe"):
            get = (c.get(probe) or {}).get("httpGet") or {}
            name = probe.removesuffix("Probe")
            print(f"{name}_path={shlex.quote(get.get('path', ''))}\n{name}_port={ports.get(get.get('port'), get.get('port', ''))}")
        return 0
    if args.relay_creds:
        with open(args.rendered, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        pod = objects_of(docs, "DaemonSet", "proxy")[0]["spec"]["template"]["spec"]
        c = relay_container(pod)
        sc, psc = c.get("securityContext") or {}, pod.get("securityContext") or {}
        assert (sc.get("capabilities") or {}).get("drop") == ["ALL"], "the relay test assumes drop [ALL]"
        uid = sc.get("runAsUser", psc.get("runAsUser", 0))
        groups = [str(g) for g in (psc.get("supplementalGroups") or []) + ([psc["fsGroup"]] if "fsGroup" in psc else [])]
        print(f"uid={uid}\ngid={sc.get('runAsGroup', psc.get('runAsGroup', uid))}\ngroups={','.join(groups)}")
        print(f"caps={','.join(x.lower() for x in (sc.get('capabilities') or {}).get('add') or [])}")
        print(f"seccomp={(sc.get('seccompProfile') or psc.get('seccompProfile') or {}).get('type', '')}")
        print(f"ro_root={1 if sc.get('readOnlyRootFilesystem') is True else 0}")
        print(f"nnp={1 if sc.get('allowPrivilegeEscalation') is False else 0}")
        print(f"argv={shlex.quote(' '.join(shlex.quote(a) for a in c.get('command', []) + c.get('args', [])))}")
        return 0
    if args.uninstall_creds:
        with open(args.rendered, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        pod = objects_of(docs, "DaemonSet", "cni-uninstall")[0]["spec"]["template"]["spec"]
        init = pod["initContainers"][0]
        sc = init.get("securityContext") or {}
        assert (sc.get("capabilities") or {}).get("drop") == ["ALL"], "the uninstall test assumes drop [ALL]"
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = " ".join(f"{m['mountPath']}={volumes[m['name']]['hostPath']['path']}" for m in init["volumeMounts"])
        print(f"uid={sc.get('runAsUser', 0)}\ngid={sc.get('runAsGroup', 0)}")
        print(f"caps={','.join(c.lower() for c in (sc.get('capabilities') or {}).get('add') or [])}")
        print(f"argv={shlex.quote(' '.join(shlex.quote(a) for a in init['command'] + init.get('args', [])))}")
        print(f"mounts={shlex.quote(mounts)}")
        return 0
    if not args.rendered or args.surge is None:
        parser.error("RENDERED.yaml and --surge are required unless --unit is given")

    with open(args.rendered, encoding="utf-8") as f:
        raw = f.read()
    print(f"== {args.rendered} (surge={str(args.surge).lower()}, proxy={str(args.proxy).lower()}, "
          f"spiffe-dir={args.spiffe_dir or '-'})")
    try:
        docs = [d for d in yaml.safe_load_all(raw) if d]
        check("rendered YAML parses into objects", bool(docs), "no objects")
        # A Service's ports are not a pod's: on the hostNetwork pods a declared port is a
        # hostPort. A pod of its own network namespace (the registrar's) may declare a
        # containerPort, which Prometheus's pod discovery targets, but never a hostPort.
        def host_network(d):
            return bool((((d.get("spec") or {}).get("template") or {}).get("spec") or {}).get("hostNetwork"))
        ports = [f"{d.get('kind')}/{d.get('metadata', {}).get('name')}: {p}"
                 for d in docs if d.get("kind") != "Service"
                 for p in find_keys(d, PORT_KEYS if host_network(d) else ("hostPort",))]
        check("no `ports` (or hostPort/containerPort) key in any hostNetwork pod, no hostPort anywhere", not ports,
              "; ".join(ports))
        # An unquoted on, off, yes or no is a YAML boolean, which the API server refuses in
        # a command.
        argv_types = [f"{d.get('kind')}/{d['metadata'].get('name')} {c['name']}: {a!r}"
                      for d in docs if isinstance((d.get("spec") or {}).get("template"), dict)
                      for c in all_containers(d["spec"]["template"].get("spec") or {})
                      for a in (c.get("command") or []) + (c.get("args") or []) if not isinstance(a, str)]
        check("every command and args item of every container is a string", not argv_types, "; ".join(argv_types))
        agent_ds = check_agent(docs, raw, args)
        check_rbac(docs, agent_ds)
        check_node_policy(docs, agent_ds)
        check_uninstall(docs, args)
        check_pod_monitor(docs, agent_ds, args)
        check_proxy(docs, args)
        check_monitoring(docs, agent_ds, args)
        check_keeper(docs, args)
        check_registrar(docs, agent_ds, args)
        # Nothing else from the host: every hostPath of the release is one of the expected folders.
        allowed = ({RUN_DIR, STATE_DIR, CNI_CONF_DIR, CNI_BIN_DIR} | ({args.spiffe_dir} if args.spiffe_dir else set())
                   | ({args.spire_admin_dir} if args.spire_admin_dir else set()))
        stray = sorted({p for d in docs if d.get("kind") == "DaemonSet"
                        for p in host_paths(d["spec"]["template"]["spec"])} - allowed)
        check("no hostPath outside the expected folders in any object", not stray, f"got {stray}")
    except CheckFailed:
        return 1
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        # A missing or mistyped field is a failure too, not a crash with a traceback.
        print(f"FAIL structure: {type(e).__name__}: {e}")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
