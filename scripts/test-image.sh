#!/usr/bin/env bash
# The image as the chart runs it (issue 18): builds aether/agent:<version>
# (scripts/build-image.sh, which prints the image size and the build time), renders the
# chart, and runs the image's binaries with buildah (chroot isolation) under exactly what
# the rendered chart declares for each container: its uid and gid, `capabilities: drop
# [ALL]` plus its `add` list, no_new_privs (allowPrivilegeEscalation: false), the host
# network (hostNetwork: true), its command and env, and its host folders mounted from
# local folders. The agent container's credentials and probe come from check_chart.py
# --probe-creds, as in scripts/test-chart.sh's probe stage, so the two test the same
# declaration from two sides (that one runs the binaries under setpriv on the host).
#
#   1. the image's files are exactly the binaries of AETHER_IMAGE_BINS (scripts/lib.sh) and
#      the libraries ldd lists for them: no shell
#   2. /proc/self/status read inside the container under the agent container's
#      credentials: uid 0, CapEff = CapPrm = CapBnd = the chart's capabilities, no
#      inheritable or ambient ones, NoNewPrivs 1 (and buildah's defaults read differently)
#   3. the install-cni init container: `aether-cni install` from the image, with its own
#      credentials (no capability), puts the image's plugin into the bin folder
#   4. aether-supervisor started as the chart starts it, which must become the node's
#      owner: checked from the host through the mounted folders (xds.sock and cni.sock
#      accept, /ready on the health socket says owner, aether-cni chained into the
#      conflist, /metrics answers), and its own /proc status shows the chart's credentials
#   4b. aether-keeper started as the chart's keeper DaemonSet starts it, beside that
#      owner: it fetches the owner's sockets and binds keeper.sock, as uid 0 with no
#      capability and no_new_privs
#   4c. aether-xds-relay from the image: `--help` names its flags, and started as the
#      chart's proxy pod starts it (proxy.relay.enabled: its argv, its uid and gid, no
#      capability, no_new_privs, the node's run folder and the pod's relay folder mounted)
#      it binds its socket in the relay folder, 0660 and its own, and is not dumpable
#   5. the readiness probe inside the container, with the probe's exact argv and the agent
#      container's credentials: /ready, exit 0; without CAP_SETUID and CAP_SETGID it
#      fails; once the agent is stopped (SIGTERM) it exits non-zero
#
# Not reproduced: the relay's supplementary groups (buildah run cannot add groups:
# scripts/test-chart.sh runs the relay under crun with them, beside Envoy and an agent), the projected API token (no API server here, so the agent runs without
# Kubernetes), readOnlyRootFilesystem (buildah run has no read-only root), the pod's
# supplementary fsGroup (buildah run cannot add groups; the group reads only the token)
# and the RuntimeDefault seccomp profile (buildah applies its own default profile).
#
# Needs root (CI runs as root): skips loudly otherwise. Cleans up every process and
# buildah container it started. The last line is "image-tests: N passed, M failed".
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root="$AETHER_ROOT"
target="${CARGO_TARGET_DIR:-$root/target}"
img_dir="$AETHER_IMAGE_DIR"
BINS=("${AETHER_IMAGE_BINS[@]}")
# The pod and node names the downward API would give.
POD_NAME=aether-agent-image-test
NODE_NAME=image-test-node

if [[ $(id -u) -ne 0 ]]; then
  echo "!!! SKIPPED scripts/test-image.sh: it needs root (buildah's vfs storage and chroot isolation; CI runs as root) !!!"
  exit 0
fi

passed=0
containers=()
pids=()
finish() {
  local rc=$?
  set +e
  # Every process this script started, by pid (the agent's supervisor first: its buildah
  # run returns once it has exited), then every buildah container, then the folders.
  for pid in "${agent_sup:-}" "${pids[@]}"; do
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null
  done
  for pid in "${agent_sup:-}" "${pids[@]}"; do
    [[ -z "$pid" ]] && continue
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null || true
  done
  for c in "${containers[@]}"; do bah rm "$c" >/dev/null 2>&1 || echo "image-tests: could not remove buildah container $c" >&2; done
  [[ -n "${work:-}" ]] && rm -rf "$work"
  if ((rc == 0)); then echo "image-tests: $passed passed, 0 failed"; else echo "image-tests: $passed passed, 1 failed"; fi
}
trap finish EXIT
pass() { passed=$((passed + 1)); echo "PASS $*"; }
fail() { echo "FAIL $*"; exit 1; }
step() { echo; echo "== $*"; }
bah() { buildah --root "$img_dir/storage" --runroot "$img_dir/runroot" --storage-driver vfs "$@"; }
export BUILDAH_ISOLATION=chroot
# Polls a command until it succeeds, up to $1 seconds.
wait_until() {
  local secs="$1"; shift
  local end=$((SECONDS + secs))
  until "$@"; do ((SECONDS < end)) || return 1; sleep 0.1; done
}

step "install tools (helm, PyYAML in .venv)"
"$root/scripts/install-tools.sh" >/dev/null
helm="$AETHER_TOOLS/bin/helm"
py="$AETHER_VENV/bin/python"
check="$root/scripts/check_chart.py"

work="$(mktemp -d /tmp/aether-image-test.XXXXXX)"
# The worker (uid 65532) must reach its folders, as on a node's /run and /var/lib.
chmod 0711 "$work"

step "build the image (scripts/build-image.sh)"
"$root/scripts/build-image.sh" | tee "$work/build.log"
image="$(sed -n 's/^image: \([^ ]*\) .*/\1/p' "$work/build.log")"
[[ -n "$image" ]] || fail "scripts/build-image.sh printed no image name"
pass "built $image"
chart="$work/chart.yaml"
"$helm" template aether "$root/charts/aether-agent" --namespace aether-system >"$chart"
if [[ "$(sed -n 's/^ *image: //p' "$chart" | sort -u | grep -c "^$image$")" != 1 ]]; then
  fail "the chart's default image is not $image: $(sed -n 's/^ *image: //p' "$chart" | sort -u | tr '\n' ' ')"
fi
pass "the rendered chart's default image is $image"

# The agent container's credentials and probe: the same reader as test-chart.sh's probe stage.
eval "$("$py" "$check" --probe-creds "$chart")"
# shellcheck disable=SC2154 # uid, gid, groups, caps, probe come from --probe-creds
agent_uid="$uid" agent_gid="$gid" agent_groups="$groups" agent_caps="$caps"
read -r -a probe_argv <<<"$probe"
# The rest of what the chart declares for the agent and install-cni containers: argv, env
# (the downward API's fields filled in, $(VAR) expanded as the kubelet does), mounts
# (path=host:<folder>, path=emptyDir or path=projected), allowPrivilegeEscalation, and the
# init container's credentials.
eval "$("$py" - "$chart" "$POD_NAME" "$NODE_NAME" <<'PY'
import re, shlex, sys, yaml
rendered, pod_name, node_name = sys.argv[1:]
def pod_of(component):
    ds = [d for d in yaml.safe_load_all(open(rendered)) if d and d.get("kind") == "DaemonSet"
          and d["metadata"]["labels"].get("app.kubernetes.io/component") == component][0]
    return ds["spec"]["template"]["spec"]
fields = {"spec.nodeName": node_name, "metadata.name": pod_name, "status.hostIP": "127.0.0.1",
          "metadata.namespace": "aether-system"}
def emit(prefix, pod, c):
    volumes = {v["name"]: v for v in pod["volumes"]}
    sc = c.get("securityContext") or {}
    caps = sc.get("capabilities") or {}
    assert caps.get("drop") == ["ALL"], f"{c['name']}: the test assumes capabilities drop [ALL], got {caps.get('drop')}"
    env = {}
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
        else:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    mounts = []
    for m in c.get("volumeMounts") or []:
        v = volumes[m["name"]]
        kind = f"host:{v['hostPath']['path']}" if "hostPath" in v else "emptyDir" if "emptyDir" in v else "projected"
        mounts.append(f"{m['mountPath']}={kind}")
    print(f"{prefix}_argv=({' '.join(shlex.quote(a) for a in c.get('command', []) + c.get('args', []))})")
    print(f"{prefix}_env=({' '.join(shlex.quote(f'{k}={v}') for k, v in env.items())})")
    print(f"{prefix}_mounts=({' '.join(shlex.quote(m) for m in mounts)})")
    print(f"{prefix}_nnp={1 if sc.get('allowPrivilegeEscalation') is False else 0}")
    print(f"{prefix}_uid={sc.get('runAsUser', 0)} {prefix}_gid={sc.get('runAsGroup', sc.get('runAsUser', 0))}")
    print(f"{prefix}_caps={','.join(x.lower() for x in caps.get('add') or [])}")
pod, keeper = pod_of("agent"), pod_of("keeper")
emit("agent", pod, {c["name"]: c for c in pod["containers"]}["agent"])
emit("init", pod, {c["name"]: c for c in pod["initContainers"]}["install-cni"])
emit("keeper", keeper, {c["name"]: c for c in keeper["containers"]}["keeper"])
PY
)"
# shellcheck disable=SC2154 # agent_* and init_* come from the reader above
[[ "$agent_nnp" == 1 && "$init_nnp" == 1 ]] || fail "the test expects allowPrivilegeEscalation: false on agent and install-cni (got $agent_nnp, $init_nnp)"
echo "agent container: uid $agent_uid gid $agent_gid caps $agent_caps groups '$agent_groups'; argv ${agent_argv[*]}; probe ${probe_argv[*]}"
echo "install-cni: uid $init_uid gid $init_gid caps '${init_caps:-none}'; argv ${init_argv[*]}"

# A node's folders, as the kubelet would make them: hostPath DirectoryOrCreate 0755, the
# /tmp emptyDir 0777 and, with the pod's fsGroup, group-owned by it and setgid.
node="$work/node"
mkdir -p "$node/run" "$node/state" "$node/net.d" "$node/cni-bin" "$node/health"
chmod 0755 "$node" "$node/run" "$node/state" && chmod 0777 "$node/health"
fs_group="${agent_groups##*,}"
[[ -n "$fs_group" ]] && chgrp "$fs_group" "$node/health" && chmod 2777 "$node/health"
primary='{"cniVersion":"1.0.0","name":"pods","plugins":[{"type":"ptp","ipam":{"type":"host-local","subnet":"10.88.0.0/16"}}]}'
echo "$primary" >"$node/net.d/10-ptp.conflist"
# buildah's --volume flags for a container's mounts; the API token is left out (no API server).
for m in "${agent_mounts[@]}" "${init_mounts[@]}" "${keeper_mounts[@]}"; do
  case "$m" in
    */run/aether=host:/run/aether | */var/lib/aether=host:/var/lib/aether | *=host:/etc/cni/net.d | *=host:/opt/cni/bin | /tmp=emptyDir | *=projected) ;;
    *) fail "the chart mounts a volume this test does not map: $m" ;;
  esac
done
volumes_for() {
  local m path kind local_dir
  for m in "$@"; do
    path="${m%%=*}" kind="${m#*=}"
    case "$kind" in
      host:/run/aether) local_dir="$node/run" ;;
      host:/var/lib/aether) local_dir="$node/state" ;;
      host:/etc/cni/net.d) local_dir="$node/net.d" ;;
      host:/opt/cni/bin) local_dir="$node/cni-bin" ;;
      emptyDir) local_dir="$node/health" ;;
      projected) continue ;;
    esac
    printf -- '--volume\n%s:%s\n' "$local_dir" "$path"
  done
}
# buildah's flags for uid, gid and `drop [ALL]` + `add` (lower-case names, comma-separated).
# buildah 1.28 ignores --cap-add once --cap-drop ALL is given, so every capability this
# kernel knows (setpriv --list-caps) outside the chart's list is dropped by name instead;
# step 2 reads back what the process got.
creds_for() {
  local uid="$1" gid="$2" caps="$3" c
  printf -- '--user\n%s:%s\n' "$uid" "$gid"
  for c in $(setpriv --list-caps); do
    if [[ ",$caps," == *",$c,"* ]]; then printf -- '--cap-add\nCAP_%s\n' "${c^^}"; else printf -- '--cap-drop\nCAP_%s\n' "${c^^}"; fi
  done
}
# The capability mask of a comma-separated list: a name's number is its line in setpriv --list-caps.
mask_of() {
  local caps="$1" n=0 mask=0 c
  for c in $(setpriv --list-caps); do
    [[ ",$caps," == *",$c,"* ]] && mask=$((mask | (1 << n)))
    n=$((n + 1))
  done
  printf '%016x' "$mask"
}
# no_new_privs is set on buildah itself, which the container inherits, as runc sets it for
# allowPrivilegeEscalation: false (buildah run has no flag for it).
nnp() { if [[ "$1" == 1 ]]; then echo setpriv --no-new-privs; fi; }
mapfile -t agent_flags < <(creds_for "$agent_uid" "$agent_gid" "$agent_caps"; volumes_for "${agent_mounts[@]}")
mapfile -t init_flags < <(creds_for "$init_uid" "$init_gid" "$init_caps"; volumes_for "${init_mounts[@]}")
mapfile -t keeper_flags < <(creds_for "$keeper_uid" "$keeper_gid" "$keeper_caps"; volumes_for "${keeper_mounts[@]}")
env_flags() { local e; for e in "$@"; do printf -- '--env\n%s\n' "$e"; done; }

container="aether-image-test-$$"
bah from --name "$container" "$image" >/dev/null
containers+=("$container")
# shellcheck disable=SC2046 # nnp expands to a command prefix or to nothing
run_in() { $(nnp "$1") buildah --root "$img_dir/storage" --runroot "$img_dir/runroot" --storage-driver vfs run --network host "${@:2}"; }

step "1. the image's files: the ${#BINS[@]} binaries and the libraries ldd lists, no shell"
mnt="$(bah mount "$container")"
expected="$(
  for b in "${BINS[@]}"; do
    echo "/usr/local/bin/$b"
    ldd "$(image_bin_source "$b")" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'
  done | sort -u
)"
# Mount points buildah run adds to the container (not the image) are left out.
got="$(cd "$mnt" && find . -mindepth 1 \( -type f -o -type l \) -printf '/%P\n' | grep -v -e '^/run/\.containerenv$' -e '^/etc/\(hosts\|hostname\|resolv\.conf\)$' | sort)"
if [[ "$got" != "$expected" ]]; then
  diff <(echo "$expected") <(echo "$got") || true
  fail "the image's files are not exactly the binaries and their libraries (- expected, + in the image)"
fi
for b in "${BINS[@]}"; do
  objcopy --strip-debug "$(image_bin_source "$b")" "$work/$b.stripped"
  cmp -s "$mnt/usr/local/bin/$b" "$work/$b.stripped" || fail "/usr/local/bin/$b in the image is not $(image_bin_source "$b") without its debug sections"
  rm -f "$work/$b.stripped"
done
# The plugin runs on the host, with the host's glibc or none: statically linked, it names
# no program interpreter (scripts/build-cni-plugin.sh).
if readelf -lW "$mnt/usr/local/bin/aether-cni" | grep -q INTERP; then
  fail "/usr/local/bin/aether-cni in the image names a program interpreter: it is not statically linked"
fi
env_path="$(bah inspect --format '{{.OCIv1.Config.Env}}' "$image")"
[[ "$env_path" == *"PATH=/usr/local/bin"* ]] || fail "the image's Env has no PATH=/usr/local/bin: $env_path"
pass "image files: $(wc -l <<<"$got") ($(tr '\n' ' ' <<<"$got")), none of them a shell; PATH=/usr/local/bin; aether-cni statically linked"

step "2. /proc/self/status inside the container under the agent container's credentials"
# No shell and no cat in the image: the host's cat is mounted read-only for this check
# only (it needs no library the image lacks).
cat_bin="$(command -v cat)"
cat_libs="$(ldd "$cat_bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')"
for lib in $cat_libs; do grep -qx "$lib" <<<"$expected" || fail "the host's cat needs $lib, which the image does not carry"; done
status_in() { # NNP FLAGS...: the status lines of a process started in the container with FLAGS
  run_in "$1" "${@:2}" --volume "$cat_bin:/test-only/cat:ro" "$container" /test-only/cat /proc/self/status
}
want_mask="$(mask_of "$agent_caps")"
check_status() { # WHAT STATUS: the chart's credentials, or the first line that differs
  local what="$1" status="$2" key want
  for key in Uid Gid CapEff CapPrm CapBnd CapInh CapAmb NoNewPrivs; do
    case "$key" in
      Uid) want="$(printf '%s\t%s\t%s\t%s' "$agent_uid" "$agent_uid" "$agent_uid" "$agent_uid")" ;;
      Gid) want="$(printf '%s\t%s\t%s\t%s' "$agent_gid" "$agent_gid" "$agent_gid" "$agent_gid")" ;;
      CapEff | CapPrm | CapBnd) want="$want_mask" ;;
      CapInh | CapAmb) want=0000000000000000 ;;
      NoNewPrivs) want="$agent_nnp" ;;
    esac
    if [[ "$(sed -n "s/^$key:\t//p" <<<"$status")" != "$want" ]]; then
      echo "$what: $key is '$(sed -n "s/^$key:\t//p" <<<"$status")', the chart declares '$want'"
      return 1
    fi
  done
}
status="$(status_in "$agent_nnp" "${agent_flags[@]}")" || fail "reading /proc/self/status in the container"
grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' <<<"$status" | sed 's/^/  /'
why="$(check_status "in the container" "$status")" || fail "$why"
pass "in the container: uid $agent_uid, CapEff = CapPrm = CapBnd = $want_mask ($agent_caps), no inheritable or ambient capability, NoNewPrivs $agent_nnp"
# The same read without the chart's credentials (buildah's defaults) must not pass.
if why="$(check_status "buildah's defaults" "$(status_in 0)")"; then
  fail "buildah's default credentials passed the credentials check: it cannot fail"
fi
pass "negative control: with buildah's default credentials the check fails ($why)"

step "3. install-cni from the image, with its own credentials"
mapfile -t init_env_flags < <(env_flags "${init_env[@]}")
run_in "$init_nnp" "${init_flags[@]}" "${init_env_flags[@]}" "$container" "${init_argv[@]}" >"$work/install.log" 2>&1 \
  || { cat "$work/install.log"; fail "install-cni (${init_argv[*]}) failed"; }
cmp -s "$node/cni-bin/aether-cni" "$mnt/usr/local/bin/aether-cni" || fail "the installed plugin is not the image's aether-cni"
[[ "$(stat -c %a "$node/cni-bin/aether-cni")" == 755 ]] || fail "the installed plugin's mode is $(stat -c %a "$node/cni-bin/aether-cni"), not 755"
[[ "$(ls -A "$node/cni-bin")" == aether-cni ]] || fail "install-cni left other files: $(ls -A "$node/cni-bin")"
CNI_COMMAND=VERSION "$node/cni-bin/aether-cni" </dev/null | grep -q supportedVersions || fail "the installed plugin does not answer VERSION"
pass "install-cni (${init_argv[*]}, uid $init_uid, caps '${init_caps:-none}'): $(cat "$work/install.log"); the image's plugin, 0755, answers VERSION"

step "4. the agent from the image, as the chart starts it, becomes the node's owner"
# The chart's metrics address is the node's loopback on a fixed port; another agent on
# this machine may hold it, so the same host with a free port.
port="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
for i in "${!agent_env[@]}"; do
  if [[ "${agent_env[$i]}" == AETHER_METRICS_ADDR=* ]]; then agent_env[i]="${agent_env[$i]%:*}:$port"; fi
done
echo "env: ${agent_env[*]}"
mapfile -t agent_env_flags < <(env_flags "${agent_env[@]}")
started="$(date +%s.%N)"
run_in "$agent_nnp" "${agent_flags[@]}" "${agent_env_flags[@]}" "$container" "${agent_argv[@]}" >"$work/agent.log" 2>&1 &
agent_run=$!
pids+=("$agent_run")
host_ready="$target/release/agent-ready"
role() { "$host_ready" --socket "$node/health/agent-health.sock" 2>/dev/null | grep -o '"role":"[a-z]*"' || true; }
is_owner() { [[ "$(role)" == '"role":"owner"' ]]; }
wait_until 60 is_owner || { tail -20 "$work/agent.log"; fail "the agent from the image did not become owner within 60 s"; }
took="$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')"
# The supervisor's pid on the host: the holder of the node lock among buildah's descendants.
descendants() { local p; for p in $(pgrep -P "$1" || true); do echo "$p"; descendants "$p"; done; }
agent_sup=""
for p in $(descendants "$agent_run"); do [[ "$(cat "/proc/$p/comm" 2>/dev/null)" == aether-supervis* ]] && agent_sup="$p" && break; done
[[ -n "$agent_sup" ]] || fail "no aether-supervisor among the processes of buildah run ($agent_run)"
pass "owner in ${took} s (buildah run included): /ready on the mounted health socket says owner (supervisor pid $agent_sup)"
accepts() { "$py" -c 'import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])' "$1"; }
for s in xds.sock cni.sock; do accepts "$node/run/$s" || fail "$node/run/$s does not accept"; done
pass "the run folder's xds.sock and cni.sock accept connections from the host"
wait_until 30 grep -q '"aether-cni"' "$node/net.d/10-ptp.conflist" || fail "the owner did not chain aether-cni into the mounted conflist"
pass "the owner chained aether-cni into the mounted CNI conf folder's conflist"
# The installed plugin as a container runtime runs it, on a host without any glibc: a
# root that holds nothing but the plugin and the node's run folder (bind-mounted in a
# mount namespace of its own). Its ADD reaches the image's agent, which stores the pod's
# record and, with no proxy here to ACK it, answers after its 2 s ACK bound.
bare="$work/bare-root"
mkdir -p "$bare/opt/cni/bin" "$bare/run/aether"
bare_add() { # PLUGIN: an ADD, on stdin, by PLUGIN run as the bare root's /opt/cni/bin/aether-cni
  cp "$1" "$bare/opt/cni/bin/aether-cni"
  env -i CNI_COMMAND=ADD CNI_CONTAINERID=image-test-c1 CNI_NETNS=/var/run/netns/image-test CNI_IFNAME=eth0 \
    CNI_ARGS='K8S_POD_NAMESPACE=default;K8S_POD_NAME=image-test;K8S_POD_UID=image-test-uid' CNI_PATH=/opt/cni/bin \
    unshare --mount /bin/bash -c 'mount --bind "$1" "$2/run/aether" && exec chroot "$2" /opt/cni/bin/aether-cni' _ "$node/run" "$bare" <<EOF
{"cniVersion":"1.0.0","name":"pods","type":"aether-cni","agentSocket":"/run/aether/cni.sock",
 "prevResult":{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/image-test"}],
               "ips":[{"address":"10.88.0.7/16","interface":0}]}}
EOF
}
# Negative control: the dynamically linked release build cannot even start there (no
# loader, no libc).
if out="$(bare_add "$target/release/aether-cni" 2>&1)"; then
  fail "the dynamically linked plugin ran in a root without glibc: the bare-root check cannot fail ($out)"
fi
add_out="$(bare_add "$node/cni-bin/aether-cni" 2>&1)" || fail "the installed plugin's ADD from a bare root failed: $add_out"
grep -q '"10.88.0.7/16"' <<<"$add_out" || fail "the installed plugin's ADD did not print its prevResult: $add_out"
[[ -n "$(find "$node/state" -name image-test-uid.json)" ]] || fail "the agent holds no record of the pod that the plugin added"
pass "the installed plugin, in a root holding nothing but itself and the run folder, added a pod through the image's agent (record stored); the dynamic build cannot start there"
metrics="$(curl -s --max-time 5 "http://127.0.0.1:$port/metrics" || true)"
grep -q '^aether_' <<<"$metrics" || fail "no aether_ metric on 127.0.0.1:$port/metrics (hostNetwork)"
pass "/metrics answers on the node's loopback ($(grep -c '^aether_' <<<"$metrics") aether_ samples)"
# worker/build.rs names the commit the binaries were built from.
want_rev="$(git -C "$root" rev-parse HEAD)"
build_info="$(grep '^aether_build_info' <<<"$metrics" || true)"
[[ $build_info == *"revision=\"$want_rev"* ]] || fail "aether_build_info does not name the commit $want_rev: '$build_info'"
pass "aether_build_info names the commit: $build_info"
why="$(check_status "the supervisor (pid $agent_sup)" "$(cat "/proc/$agent_sup/status")")" || fail "$why"
worker="$(pgrep -P "$agent_sup" -x aether-worker | head -1 || true)"
[[ -n "$worker" ]] || fail "the supervisor has no aether-worker child"
w_status="$(cat "/proc/$worker/status")"
w_uid="$(sed -n 's/^Uid:\t\([0-9]*\).*/\1/p' <<<"$w_status")" w_eff="$(sed -n 's/^CapEff:\t//p' <<<"$w_status")" w_bnd="$(sed -n 's/^CapBnd:\t//p' <<<"$w_status")"
worker_user="$(printf '%s\n' "${agent_env[@]}" | sed -n 's/^AETHER_WORKER_USER=//p')"
[[ "$w_uid" == "${worker_user%%:*}" ]] || fail "the worker runs as uid $w_uid, not agent.workerUser's ${worker_user%%:*}"
[[ "$w_eff" == 0000000000000000 && "$w_bnd" == 0000000000000000 ]] || fail "the worker has capabilities: CapEff $w_eff CapBnd $w_bnd"
pass "the supervisor runs with the chart's credentials (its /proc status); its worker as uid $w_uid with no capability, bounding set empty"

step "4b. the socket keeper from the image, as the chart starts it, keeps the owner's sockets"
mapfile -t keeper_env_flags < <(env_flags "${keeper_env[@]}")
run_in "$keeper_nnp" "${keeper_flags[@]}" "${keeper_env_flags[@]}" "$container" "${keeper_argv[@]}" >"$work/keeper.log" 2>&1 &
keeper_run=$!
pids+=("$keeper_run")
wait_until 30 grep -q "keeping the owner's node sockets" "$work/keeper.log" \
  || { tail -20 "$work/keeper.log"; fail "the keeper from the image (${keeper_argv[*]}) did not fetch the owner's sockets within 30 s"; }
[[ -S "$node/run/keeper.sock" ]] || fail "the keeper bound no keeper.sock in the mounted run folder"
keeper_pid=""
for p in $(descendants "$keeper_run"); do [[ "$(cat "/proc/$p/comm" 2>/dev/null)" == aether-keeper ]] && keeper_pid="$p" && break; done
[[ -n "$keeper_pid" ]] || fail "no aether-keeper among the processes of buildah run ($keeper_run)"
pids+=("$keeper_pid")
k_status="$(cat "/proc/$keeper_pid/status")"
k_uid="$(sed -n 's/^Uid:\t\([0-9]*\).*/\1/p' <<<"$k_status")" k_eff="$(sed -n 's/^CapEff:\t//p' <<<"$k_status")"
k_bnd="$(sed -n 's/^CapBnd:\t//p' <<<"$k_status")" k_nnp="$(sed -n 's/^NoNewPrivs:\t//p' <<<"$k_status")"
[[ "$k_uid" == "$keeper_uid" && "$k_eff" == 0000000000000000 && "$k_bnd" == 0000000000000000 && "$k_nnp" == 1 ]] \
  || fail "the keeper does not run with the chart's credentials: Uid $k_uid CapEff $k_eff CapBnd $k_bnd NoNewPrivs $k_nnp"
pass "the keeper (${keeper_argv[*]}) holds the owner's sockets and offers them on keeper.sock, as uid $k_uid with no capability and no_new_privs"
kill -TERM "$keeper_pid"
wait "$keeper_run" || true

step "4c. aether-xds-relay from the image, as the chart's proxy pod starts it (proxy.relay.enabled)"
help_out="$(run_in 1 --user 65533:65533 "$container" aether-xds-relay --help 2>&1)" || fail "aether-xds-relay --help in the image failed: $help_out"
for flag in --listen --upstream --metrics-addr --upstream-grace --log-format; do
  grep -q -- "$flag" <<<"$help_out" || fail "aether-xds-relay --help does not name $flag: $help_out"
done
pass "aether-xds-relay --help from the image names --listen, --upstream, --metrics-addr, --upstream-grace, --log-format"
"$helm" template aether "$root/charts/aether-agent" --namespace aether-system --set proxy.enabled=true,proxy.relay.enabled=true >"$work/relay-chart.yaml"
eval "$("$py" "$check" --relay-creds "$work/relay-chart.yaml")"
# shellcheck disable=SC2154 # uid, gid, caps, nnp, argv come from --relay-creds
relay_uid="$uid" relay_gid="$gid" relay_nnp="$nnp"
[[ -z "$caps" && "$relay_nnp" == 1 ]] || fail "the test expects the relay with no capability and no_new_privs (got caps '$caps', nnp $relay_nnp)"
eval "relay_argv=($argv)"
relay_dir="$work/relay-dir"
mkdir -p "$relay_dir" && chmod 0777 "$relay_dir"
mapfile -t relay_flags < <(creds_for "$relay_uid" "$relay_gid" "")
run_in "$relay_nnp" "${relay_flags[@]}" --volume "$node/run:/run/aether:ro" --volume "$relay_dir:/var/run/aether-relay" \
  "$container" "${relay_argv[@]}" >"$work/relay.log" 2>&1 &
relay_run=$!
pids+=("$relay_run")
wait_until 30 test -S "$relay_dir/xds.sock" || { cat "$work/relay.log"; fail "the relay from the image (${relay_argv[*]}) bound no socket in the relay folder"; }
relay_pid=""
for p in $(descendants "$relay_run"); do [[ "$(cat "/proc/$p/comm" 2>/dev/null)" == aether-xds-rela* ]] && relay_pid="$p" && break; done
[[ -n "$relay_pid" ]] || fail "no aether-xds-relay among the processes of buildah run ($relay_run)"
pids+=("$relay_pid")
r_status="$(cat "/proc/$relay_pid/status")"
r_uid="$(sed -n 's/^Uid:\t\([0-9]*\).*/\1/p' <<<"$r_status")" r_eff="$(sed -n 's/^CapEff:\t//p' <<<"$r_status")"
r_prm="$(sed -n 's/^CapPrm:\t//p' <<<"$r_status")" r_nnp="$(sed -n 's/^NoNewPrivs:\t//p' <<<"$r_status")"
sock="$(stat -c '%a %u %g' "$relay_dir/xds.sock")"
# Its bounding set is buildah's to shape for a non-root user (1.28 keeps CAP_SETUID in it);
# with no permitted capability and no_new_privs none can be gained. scripts/test-chart.sh
# reads an empty bounding set under crun.
[[ "$r_uid" == "$relay_uid" && "$r_eff" == 0000000000000000 && "$r_prm" == 0000000000000000 && "$r_nnp" == 1 ]] \
  || fail "the relay does not run with the chart's credentials: Uid $r_uid CapEff $r_eff CapPrm $r_prm NoNewPrivs $r_nnp"
[[ "$sock" == "660 $relay_uid $relay_gid" ]] || fail "the relay's socket is '$sock', not '660 $relay_uid $relay_gid'"
[[ "$(stat -c %u "/proc/$relay_pid/environ")" == 0 ]] || fail "the relay is dumpable: its /proc files are uid $(stat -c %u "/proc/$relay_pid/environ")'s"
pass "the relay from the image (${relay_argv[*]}): socket $sock (mode, uid, gid), uid $r_uid with no effective or permitted capability, NoNewPrivs 1, not dumpable"
kill -TERM "$relay_pid"
wait "$relay_run" || true
[[ ! -e "$relay_dir/xds.sock" ]] || fail "the relay left its socket file at SIGTERM"
pass "on SIGTERM the relay exits and takes its socket file away"

step "5. the readiness probe inside the container, as the kubelet runs it"
probe_out="$(run_in "$agent_nnp" "${agent_flags[@]}" "$container" "${probe_argv[@]}" 2>&1)" \
  || fail "the probe (${probe_argv[*]}) under the chart's credentials failed: $probe_out"
grep -q '"role":"owner"' <<<"$probe_out" || fail "the probe passed without an owner's /ready: $probe_out"
pass "probe (${probe_argv[*]}) in the container: exit 0, $(grep -o '"role":"[a-z]*"' <<<"$probe_out")"
narrowed="$(tr ',' '\n' <<<"$agent_caps" | grep -vx -e setuid -e setgid | paste -sd, -)"
mapfile -t narrow_flags < <(creds_for "$agent_uid" "$agent_gid" "$narrowed"; volumes_for "${agent_mounts[@]}")
if out="$(run_in "$agent_nnp" "${narrow_flags[@]}" "$container" "${probe_argv[@]}" 2>&1)"; then
  fail "mutation probe-no-setuid: the probe passed without CAP_SETUID and CAP_SETGID: $out"
fi
pass "mutation probe-no-setuid -> the probe fails: $(head -1 <<<"$out")"
kill -TERM "$agent_sup"
wait "$agent_run" || true
agent_sup=""
if out="$(run_in "$agent_nnp" "${agent_flags[@]}" "$container" "${probe_argv[@]}" 2>&1)"; then
  fail "the probe exited 0 with the agent stopped: $out"
fi
pass "with the agent stopped (SIGTERM), the probe in the container exits non-zero: $(head -1 <<<"$out")"
