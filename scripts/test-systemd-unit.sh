#!/usr/bin/env bash
# deploy/systemd/aether-agent.service under a real systemd (issue 16, item 5): a restart
# keeps the pods' records readable and refuses no connect on xds.sock.
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
  (cd "$root" && cargo build --bins -p aether-supervisor -p aether-worker -p aether-cni -p agent-ready)
  bins="$root/target/debug"
fi
work="$(mktemp -d /var/tmp/aether-systemd.XXXXXX)"
chmod 755 "$work"
mkdir -p "$work"/{bin,varlib,units}
cp "$bins"/{aether-supervisor,aether-worker,aether-cni,agent-ready} "$work/bin/"
cp "$unit" "$work/units/aether-agent.service"
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
[[ "$(in_ns stat -c %i /run/aether/xds.sock)" == "$inode_before" ]] || fail "the restart rebound xds.sock"
grep -q "holding the node sockets systemd kept in its fd store" "$work/agent.log" || fail "the new start did not take the stored listeners"
pass "the new start took the listeners from the fd store (same inode)"
for i in 1 2 3; do cni CHECK "pod-$i" "10.89.0.$((i + 10))" || fail "CHECK pod-$i after the restart"; done
pass "the restarted worker holds every pod (its records were readable)"
owners="$(in_ns find /var/lib/aether/worker ! -name .aether-worker-state -printf '%u:%g\n' | sort -u)"
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
in_ns systemctl stop aether-agent.service
[[ "$(in_ns systemctl show -p Result --value aether-agent.service)" == success ]] || fail "stop: $(in_ns systemctl show -p Result --value aether-agent.service)"
pass "systemctl stop: the drain exits 0"
echo "all checks passed"
