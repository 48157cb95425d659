#!/usr/bin/env bash
# Installs the Debian packages the build, the tests and the end-to-end harness need, when
# missing, idempotently (as root, where apt-get exists; otherwise it says what is missing):
#   protobuf-compiler           protoc, which the registrar's etcd client needs to build
#   etcd-server                 a real etcd for the registrar tests and the two-node harness
#   containernetworking-plugins the CNI reference plugins for the CNI chain test
#   iproute2, util-linux        network namespaces (ip) and setpriv for the probe test
#   nftables                    the redirect of the mTLS data-path tests (nft, in their
#                               own network namespaces)
#   faketime                    libfaketime, which jumps the agent's wall clock in the
#                               clock-jump test (e2e/tests/clock_jump.rs)
#   buildah                     builds and runs the agent's image without a daemon
#                               (scripts/build-image.sh, scripts/test-image.sh)
#   prometheus                  a real Prometheus and promtool for the dashboard and alert
#                               rules test (e2e/tests/dashboard.rs runs its own, on loopback)
#   crun                        an OCI runtime that runs the xDS relay in a container as the
#                               chart declares it (scripts/test-chart.sh), with the RuntimeDefault
#                               seccomp profile of golang-github-containers-common (buildah's
#                               dependency), /usr/share/containers/seccomp.json
set -euo pipefail

need=()
command -v protoc >/dev/null || need+=(protobuf-compiler)
command -v etcd >/dev/null || need+=(etcd-server)
[[ -x /usr/lib/cni/ptp || -x /usr/lib/cni/bridge ]] || need+=(containernetworking-plugins)
command -v ip >/dev/null || need+=(iproute2)
command -v setpriv >/dev/null || need+=(util-linux)
command -v nft >/dev/null || need+=(nftables)
command -v faketime >/dev/null || need+=(faketime)
command -v buildah >/dev/null || need+=(buildah)
command -v promtool >/dev/null || need+=(prometheus)
command -v crun >/dev/null || need+=(crun)
[[ -f /usr/share/containers/seccomp.json ]] || need+=(golang-github-containers-common)
# The registrar's TLS test in scripts/test-chart.sh makes its CA and certificate with it.
command -v openssl >/dev/null || need+=(openssl)

if ((${#need[@]} == 0)); then
  echo "install-deps: all present" >&2
  exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
  echo "install-deps: missing ${need[*]}; run as root on Debian, or install them yourself" >&2
  # protoc is needed to build at all; the rest only by some tests.
  command -v protoc >/dev/null || exit 1
  exit 0
fi
echo "install-deps: apt-get install ${need[*]}" >&2
# prometheus and etcd-server ship init scripts; nothing installed here may start a
# service. A policy-rc.d that refuses every start, for the install only (Debian's
# invoke-rc.d asks it), unless the host has its own.
policy=/usr/sbin/policy-rc.d
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\n# scripts/install-deps.sh: no service starts during its install\nexit 101\n' >"$policy"
  chmod 0755 "$policy"
  trap 'rm -f "$policy"' EXIT
fi
apt-get update -q >&2
DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >&2
