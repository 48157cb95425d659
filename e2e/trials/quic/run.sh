#!/usr/bin/env bash
# Re-runs every QUIC trial from scratch on a real Envoy with a real HTTP/3 client (aioquic;
# see RESULTS.md): certificates under a temporary directory, the mTLS trials' in-process
# SDS server, the node Envoy under test with its listeners and clusters from files, a
# PASS/FAIL line per trial with what was observed, then everything it started is stopped
# by pid and removed.
#
# It runs in a private network namespace (unshare --net, so root): the node address
# 127.0.0.30 and every UDP port are its own.
#
#   e2e/trials/quic/run.sh                 all trials
#   e2e/trials/quic/run.sh sni rotate      the trials whose names start so
#
# Env: ENVOY_BIN (default: scripts/install-envoy.sh), TRIAL_KEEP=1 keeps the work dir,
#      TRIAL_ENVOY_LOG_LEVEL (default info).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"

if [[ -z "${TRIAL_IN_NETNS:-}" ]]; then
  if [[ "$(id -u)" != 0 ]]; then
    echo "run.sh: needs root: the trials run in a private network namespace" >&2
    exit 2
  fi
  for tool in unshare ip openssl; do
    command -v "$tool" >/dev/null || { echo "run.sh: $tool not found" >&2; exit 2; }
  done
  ENVOY_BIN="${ENVOY_BIN:-$("$root/scripts/install-envoy.sh")}"
  # grpcio (the SDS server) and aioquic (the HTTP/3 client) come with the test clients.
  TRIAL_PYTHON="$("$root/scripts/install-pytools.sh")"
  export ENVOY_BIN TRIAL_PYTHON TRIAL_IN_NETNS=1
  exec unshare --net -- "$0" "$@"
fi

ip link set lo up
"$ENVOY_BIN" --version | grep -o 'version: .*' | sed 's/^/envoy /'
cd "$here"
PYTHONDONTWRITEBYTECODE=1 exec "$TRIAL_PYTHON" -u "$here/trials.py" "$@"
