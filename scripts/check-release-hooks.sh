#!/usr/bin/env bash
# Fails if a release binary carries the test-only fault hooks (feature `fault-hooks`,
# shared-proto/src/fault.rs): every executable in target/release (aether-supervisor,
# aether-worker, aether-cni, agent-ready, aether-registrar, the harness's binaries) is
# searched for the hooks' variable name, which a binary built without them cannot contain.
#
# Usage: scripts/check-release-hooks.sh [DIR]   (DIR: target/release by default; build it
# first with `cargo build --release --workspace --bins`, as e2e/agent-restart-gap.sh does).
#
# A control: the debug binaries built with the tests (`cargo build --workspace --bins
# --tests`, scripts/test.sh) carry the hooks, so when present there the same search must
# find the name; otherwise the control is skipped and says so.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/target/release}"
marker=AETHER_FAULT_HOOK

checked=0
hooked=()
for f in "$dir"/*; do
  # Executables only: not the .d dependency files, not folders.
  [[ -f $f && -x $f && $(basename "$f") != *.* ]] || continue
  checked=$((checked + 1))
  if grep -qaF "$marker" "$f"; then
    hooked+=("$f")
  fi
done
if ((checked == 0)); then
  echo "check-release-hooks: no binaries in $dir; build them first: cargo build --release --workspace --bins" >&2
  exit 1
fi
if ((${#hooked[@]} > 0)); then
  echo "check-release-hooks: release binaries with the test-only fault hooks ($marker):" >&2
  printf '  %s\n' "${hooked[@]}" >&2
  echo "a release build must not enable the fault-hooks feature (it comes with the tests' dev-dependencies: build the release binaries without --tests)" >&2
  exit 1
fi
echo "check-release-hooks: $checked binaries in $dir, none carries $marker" >&2

control="$root/target/debug/aether-worker"
if [[ -x $control ]] && grep -qaF "$marker" "$control"; then
  echo "check-release-hooks: control: the search finds $marker in $control (built with the tests)" >&2
else
  echo "check-release-hooks: control skipped: $control is absent or built without the fault hooks" >&2
fi
