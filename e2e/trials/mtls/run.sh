#!/usr/bin/env bash
# Re-runs every mTLS trial from scratch on a real Envoy (see RESULTS.md): certificates
# under a temporary directory, an in-process SDS server, a "remote" Envoy (the mTLS server
# and plain backends) and the node Envoy under test, clients, a PASS/FAIL line per trial
# with what was observed, then everything it started is stopped by pid and removed.
#
# It runs in a private network namespace (unshare --net, so root), where the loopback
# addresses and ports are its own and iptables can REDIRECT the inbound trial's
# connections to the capture listener for real (original_dst needs conntrack's answer).
#
#   e2e/trials/mtls/run.sh          all trials
#   e2e/trials/mtls/run.sh q1|q2    one question
#
# Env: ENVOY_BIN (default: scripts/install-envoy.sh), TRIAL_KEEP=1 keeps the work dir,
#      TRIAL_ENVOY_LOG_LEVEL (default info).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"

if [[ -z "${TRIAL_IN_NETNS:-}" ]]; then
  if [[ "$(id -u)" != 0 ]]; then
    echo "run.sh: needs root: the trials run in a private network namespace with iptables" >&2
    exit 2
  fi
  for tool in unshare iptables ip openssl; do
    command -v "$tool" >/dev/null || { echo "run.sh: $tool not found" >&2; exit 2; }
  done
  ENVOY_BIN="${ENVOY_BIN:-$("$root/scripts/install-envoy.sh")}"
  # The SDS server needs grpcio, which the project's Python test clients bring.
  TRIAL_PYTHON="$("$root/scripts/install-pytools.sh")"
  export ENVOY_BIN TRIAL_PYTHON TRIAL_IN_NETNS=1
  exec unshare --net -- "$0" "$@"
fi

# In the namespace: loopback up, and the inbound capture. Connections to a pod's address
# and port 80 are redirected to a capture listener, as the CNI's rules do: 127.0.0.8's to
# 15016 (the capture listener that runs the tls_inspector itself), the others' to 15006.
ip link set lo up
iptables -t nat -A OUTPUT -p tcp -d 127.0.0.8 --dport 80 -j REDIRECT --to-ports 15016
iptables -t nat -A OUTPUT -p tcp -d 127.0.0.5,127.0.0.6,127.0.0.7,127.0.0.9 --dport 80 \
  -j REDIRECT --to-ports 15006
"$ENVOY_BIN" --version | grep -o 'version: .*' | sed 's/^/envoy /'
cd "$here"
PYTHONDONTWRITEBYTECODE=1 exec "$TRIAL_PYTHON" -u "$here/trials.py" "$@"
