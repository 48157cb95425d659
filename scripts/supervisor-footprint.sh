#!/usr/bin/env bash
# The supervisor's two budgets (issue 16): its resident memory as a serving owner (at most
# 4 MiB) and its code (under 1,500 lines). Prints both; README.md, "Measured", records them.
#
#   scripts/supervisor-footprint.sh            # builds the release binaries first
#   AETHER_BIN_DIR=target/release scripts/supervisor-footprint.sh
#
# Memory: a release agent (embedded registry, no Envoy, no pods) is started in a temp folder
# and, once `agent-ready` says it serves as owner, the supervisor's VmRSS and VmHWM are read
# from /proc/<pid>/status. As root its worker runs as 65532, as deployed. bench-memory
# measures it with a real Envoy and 110 pods.
# Code: lines under supervisor/src that are neither blank, nor comments (`//`, `///`, `//!`),
# nor tests (`tests.rs` files and `#[cfg(test)]` items).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

bins="${AETHER_BIN_DIR:-}"
if [[ -z "$bins" ]]; then
  (cd "$root" && cargo build --release --bins -p aether-supervisor -p aether-worker -p agent-ready)
  bins="$root/target/release"
fi
dir="$(mktemp -d /var/tmp/aether-footprint.XXXXXX)"
chmod 755 "$dir"
"$bins/aether-supervisor" --run-dir "$dir/run" --state-dir "$dir/state" --health-dir "$dir/health" \
  --metrics-addr off >"$dir/agent.log" 2>&1 &
sup=$!
trap 'kill "$sup" 2>/dev/null || true; wait "$sup" 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 200); do
  "$bins/agent-ready" --socket "$dir/health/agent-health.sock" --timeout-ms 200 >"$dir/ready" 2>/dev/null \
    && grep -q '"owner"' "$dir/ready" && break
  sleep 0.05
done
grep -q '"owner"' "$dir/ready" || { cat "$dir/agent.log"; echo "the agent did not become a serving owner"; exit 1; }
read -r rss hwm < <(awk '/^VmRSS:/ {r=$2} /^VmHWM:/ {h=$2} END {print r, h}' "/proc/$sup/status")
printf 'supervisor memory (serving owner): VmRSS %.1f MiB, VmHWM %.1f MiB\n' "$(bc -l <<<"$rss/1024")" "$(bc -l <<<"$hwm/1024")"

python3 - "$root/supervisor/src" <<'EOF'
import os, re, sys

def code_lines(text):
    lines, n, i = text.split("\n"), 0, 0
    while i < len(lines):
        line = lines[i].strip()
        if line == "#[cfg(test)]":
            # Skip the item: up to its `;`, or its braces' end.
            j, depth, opened = i + 1, 0, False
            while j < len(lines) and lines[j].strip().startswith("#["):
                j += 1
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                opened = opened or "{" in lines[j]
                j += 1
                if (opened and depth <= 0) or (not opened and lines[j - 1].strip().endswith(";")):
                    break
            i = j
            continue
        if line and not line.startswith("//"):
            n += 1
        i += 1
    return n

total, files = 0, []
for d, _, names in os.walk(sys.argv[1]):
    for f in names:
        if f.endswith(".rs") and f != "tests.rs":
            n = code_lines(open(os.path.join(d, f), encoding="utf-8").read())
            total += n
            files.append((n, os.path.relpath(os.path.join(d, f), sys.argv[1])))
print(f"supervisor code: {total} lines (not blank, comments or tests) in {len(files)} files; largest: "
      + ", ".join(f"{p} {n}" for n, p in sorted(files, reverse=True)[:4]))
EOF
