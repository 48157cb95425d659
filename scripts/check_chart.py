#!/usr/bin/env python3
"""Assertions on the rendered aether-agent chart (the output of `helm template`).

    check_chart.py --surge true|false [--proxy true|false] [--spiffe-dir DIR]
                   [--backoff-base 0.1s] [--backoff-max 1s] [--ads-api-type GRPC] RENDERED.yaml
    check_chart.py --unit deploy/systemd/aether-agent.service

Prints one line per check ("ok   NAME") and stops at the first failure with
"FAIL NAME: detail" and exit status 1. The expectations come from the flags, so one
rendering is checked against the values it was rendered with. Needs PyYAML, which
kubernetes-validate depends on (run it with the project's .venv python).

scripts/test-chart.sh also breaks the chart on purpose and asserts that each check fails
(the mutation stage), so none of these can pass vacuously.
"""

import argparse
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
RBAC_RULES = {
    ("", "pods"): ["get", "list", "watch"],
    ("", "nodes"): ["get", "list", "watch"],
    ("", "services"): ["get", "list", "watch"],
    ("discovery.k8s.io", "endpointslices"): ["get", "list", "watch"],
}


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
    want = {"maxSurge": 1, "maxUnavailable": 0} if args.surge else {"maxSurge": 0, "maxUnavailable": 1}
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
    want_paths = sorted([RUN_DIR, STATE_DIR, CNI_CONF_DIR, CNI_BIN_DIR] + ([args.spiffe_dir] if args.spiffe_dir else []))
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
    else:
        check("no SPIFFE_ENDPOINT_SOCKET without identity.spiffe.socketDir", spiffe is None, f"got {spiffe!r}")

    # The CNI plugin install: copy to a temporary name in the bin folder, then rename.
    inits = {c["name"]: c for c in pod.get("initContainers", [])}
    check("init container install-cni present", "install-cni" in inits, f"init containers {sorted(inits)}")
    init = inits["install-cni"]
    bin_mounts = [m["mountPath"] for m in init.get("volumeMounts", [])
                  if (volumes.get(m["name"], {}).get("hostPath") or {}).get("path") == CNI_BIN_DIR]
    check(f"install-cni mounts the host's {CNI_BIN_DIR}", len(bin_mounts) == 1, f"got {bin_mounts}")
    script = "\n".join(init.get("command", []) + init.get("args", []))
    bin_mount = re.escape(bin_mounts[0])
    tmp_def = re.search(rf'tmp="{bin_mount}/[^"/]+"', script)
    copy = re.search(r'\bcp "[^"]+" "\$tmp"', script)
    rename = re.search(rf'\bmv -f "\$tmp" "{bin_mount}/aether-cni"', script)
    check("install-cni copies to a temp name in the bin folder, then renames it over aether-cni",
          bool(tmp_def and copy and rename and copy.start() < rename.start()), f"script:\n{script}")
    return ds


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
    roles = objects_of(docs, "ClusterRole")
    check("one ClusterRole", len(roles) == 1, f"found {len(roles)}")
    got = {}
    for rule in roles[0].get("rules", []):
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                got[(group, resource)] = sorted(got.get((group, resource), []) + list(rule.get("verbs", [])))
    want = {k: sorted(v) for k, v in RBAC_RULES.items()}
    check("ClusterRole: get/list/watch on pods, nodes, services, endpointslices and nothing else", got == want,
          f"got {got}")
    sa_name = agent_ds["spec"]["template"]["spec"].get("serviceAccountName")
    sas = [d["metadata"]["name"] for d in objects_of(docs, "ServiceAccount")]
    check("agent runs under the chart's ServiceAccount", sa_name in sas, f"{sa_name!r} not in {sas}")
    bindings = objects_of(docs, "ClusterRoleBinding")
    ok = any(b["roleRef"]["name"] == roles[0]["metadata"]["name"]
             and any(s.get("kind") == "ServiceAccount" and s.get("name") == sa_name for s in b.get("subjects", []))
             for b in bindings)
    check("ClusterRoleBinding binds the ClusterRole to that ServiceAccount", ok, f"bindings {bindings}")


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
    check("keeper runs aether-supervisor --keep-sockets on the run folder",
          argv[:2] == ["aether-supervisor", "--keep-sockets"]
          and any(a == "--run-dir" and b == RUN_DIR for a, b in zip(argv, argv[1:])), f"argv {argv}")
    uid = (containers[0].get("securityContext") or {}).get("runAsUser")
    check("keeper runs as uid 0, the supervisors' uid that the handoff checks", uid == 0, f"got {uid!r}")


def check_registrar(docs, agent_ds, args):
    deployments = objects_of(docs, "Deployment", "registrar")
    services = objects_of(docs, "Service", "registrar")
    agent = {c["name"]: c for c in agent_ds["spec"]["template"]["spec"]["containers"]}["agent"]
    env = env_map(agent)
    if not args.registrar:
        check("no registrar objects with registrar.enabled=false", not deployments and not services,
              f"found {len(deployments)} Deployment(s), {len(services)} Service(s)")
        return
    check("registrar Deployment and Service rendered once", len(deployments) == 1 and len(services) == 1,
          f"found {len(deployments)} Deployment(s), {len(services)} Service(s)")
    d, svc = deployments[0], services[0]
    check("registrar replicas >= 2 (an agent resumes on the other)", d["spec"].get("replicas", 1) >= 2,
          f"got {d['spec'].get('replicas')!r}")
    strategy = d["spec"].get("strategy", {}).get("rollingUpdate", {})
    check("registrar rolls with maxUnavailable 0", strategy.get("maxUnavailable") == 0, f"got {strategy}")
    pod = d["spec"]["template"]["spec"]
    check("registrar pod: no service account token", pod.get("automountServiceAccountToken") is False,
          f"got {pod.get('automountServiceAccountToken')!r}")
    check("registrar pod: not hostNetwork", not pod.get("hostNetwork"), f"got {pod.get('hostNetwork')!r}")
    check("registrar pod: runAsNonRoot", (pod.get("securityContext") or {}).get("runAsNonRoot") is True,
          f"got {pod.get('securityContext')}")
    check("registrar pod: no hostPath", not host_paths(pod), f"got {host_paths(pod)}")
    containers = all_containers(pod)
    check("registrar pod: one container", len(containers) == 1, f"got {[c['name'] for c in containers]}")
    for c in containers:
        check_container_hardening("registrar pod", c)
        extra = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add")
        check(f"registrar pod: container {c['name']} adds no capability", not extra, f"got {extra}")
    argv = containers[0].get("command", []) + containers[0].get("args", [])
    check("registrar runs aether-registrar serve with --etcd and --listen",
          argv[:2] == ["aether-registrar", "serve"] and "--etcd" in argv and "--listen" in argv, f"argv {argv}")
    listen = argv[argv.index("--listen") + 1] if "--listen" in argv else ""
    port = svc["spec"]["ports"][0]
    check("registrar Service targets the port the registrar listens on",
          listen.endswith(f":{port.get('targetPort')}"), f"listen {listen!r}, service {port}")
    check("registrar Service selects the registrar pods",
          all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items()),
          f"selector {svc['spec']['selector']}")
    want = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:{port['port']}"
    got = (env.get("AETHER_REGISTRAR") or {}).get("value")
    check("agent AETHER_REGISTRAR is the registrar Service", got == want, f"got {got!r}, want {want!r}")


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
    for key in ("cds_config", "lds_config"):
        got = boot["dynamic_resources"].get(key)
        check(f"bootstrap: {key} over ADS, V3", got == {"ads": {}, "resource_api_version": "V3"}, f"got {got}")
    admin = ((boot.get("admin") or {}).get("address") or {})
    check("bootstrap: admin on 127.0.0.1 or a pipe under /run/aether",
          (admin.get("socket_address") or {}).get("address") == "127.0.0.1"
          or str((admin.get("pipe") or {}).get("path", "")).startswith(RUN_DIR + "/"), f"got {admin}")
    clusters = {c["name"]: c for c in boot.get("static_resources", {}).get("clusters", [])}
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
    check(f"bootstrap: xds_cluster endpoint is the pipe {RUN_DIR}/xds.sock", pipes == [f"{RUN_DIR}/xds.sock"],
          f"got {pipes}")


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
    want_flags = {"--run-dir": RUN_DIR, "--state-dir": STATE_DIR, "--health-dir": "/run/aether-health"}
    check(f"unit ExecStart flags {want_flags}", flags == want_flags, f"got {argv[1:]}")
    bounding = (one("CapabilityBoundingSet") or "").split()
    want_caps = [f"CAP_{c}" for c in AGENT_CAPS]
    check(f"unit CapabilityBoundingSet is the chart's set {want_caps}",
          sorted(bounding) == sorted(want_caps) and len(bounding) == len(set(bounding)), f"got {bounding}")
    ambient = one("AmbientCapabilities")
    check("unit grants no ambient capabilities", not ambient, f"got {ambient!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--surge", type=parse_bool, help="required with RENDERED.yaml")
    parser.add_argument("--proxy", type=parse_bool, default=False)
    parser.add_argument("--keeper", type=parse_bool, default=True)
    parser.add_argument("--registrar", type=parse_bool, default=False,
                        help="the rendering has registrar.enabled=true")
    parser.add_argument("--spiffe-dir", default="")
    parser.add_argument("--backoff-base", default="0.1s")
    parser.add_argument("--backoff-max", default="1s")
    parser.add_argument("--ads-api-type", default="DELTA_GRPC", choices=["GRPC", "DELTA_GRPC"])
    parser.add_argument("--unit", help="check this systemd unit instead of a rendering")
    parser.add_argument("--probe-creds", action="store_true",
                        help="print the agent container's credentials and readiness probe as shell "
                             "assignments (uid, gid, groups, caps, probe) instead of checking")
    parser.add_argument("rendered", nargs="?")
    args = parser.parse_args()

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
        groups = ",".join(str(g) for g in psc.get("supplementalGroups") or [])
        caps = (sc.get("capabilities") or {})
        assert caps.get("drop") == ["ALL"], f"the probe test assumes drop [ALL], got {caps.get('drop')}"
        probe = " ".join(shlex.quote(a) for a in agent["readinessProbe"]["exec"]["command"])
        print(f"uid={uid}\ngid={gid}\ngroups={groups}\ncaps={','.join(c.lower() for c in caps.get('add') or [])}")
        print(f"probe={shlex.quote(probe)}")
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
        # A Service's ports are not a pod's: on the hostNetwork pods a declared port is a hostPort.
        ports = [f"{d.get('kind')}/{d.get('metadata', {}).get('name')}: {p}"
                 for d in docs if d.get("kind") != "Service" for p in find_keys(d, PORT_KEYS)]
        check("no `ports` (or hostPort/containerPort) key in any rendered pod object", not ports, "; ".join(ports))
        agent_ds = check_agent(docs, raw, args)
        check_rbac(docs, agent_ds)
        check_proxy(docs, args)
        check_keeper(docs, args)
        check_registrar(docs, agent_ds, args)
        # Nothing else from the host: every hostPath of the release is one of the expected folders.
        allowed = {RUN_DIR, STATE_DIR, CNI_CONF_DIR, CNI_BIN_DIR} | ({args.spiffe_dir} if args.spiffe_dir else set())
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
