#!/usr/bin/env bash
# The supervisor's budgets: its resident memory as a serving owner (at most 4 MiB) and its
# code by part (the pure lifecycle with its driver, sys/, and the rest of supervisor/src),
# each against its budget (BUDGETS below). Prints both and fails when a part is over its
# budget; README.md, "Measured", records them.
#
#   scripts/supervisor-footprint.sh            # builds the release binaries first
#   AETHER_BIN_DIR=target/release scripts/supervisor-footprint.sh
#   scripts/supervisor-footprint.sh --lines    # the code by part only
#   AETHER_SUPERVISOR_BUDGETS=sys=900 scripts/supervisor-footprint.sh --lines   # a lowered budget
#
# Memory: a release agent (embedded registry, no Envoy, no pods) is started in a temp folder
# and, once `agent-ready` says it serves as owner, the supervisor's VmRSS and VmHWM are read
# from /proc/<pid>/status. As root its worker runs as 65532, as deployed. bench-memory
# measures it with a real Envoy and 110 pods.
# Code: lines under supervisor/src that are neither blank, nor comments (`//`, `///`, `//!`),
# nor tests (`tests.rs` files and `#[cfg(test)]` items).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib.sh
source "$root/scripts/lib.sh"

# The code by part against its budgets; exits 1 naming each part over its budget.
code_lines() {
python3 - "$root/supervisor/src" "${AETHER_SUPERVISOR_BUDGETS:-}" <<'EOF'
import os, sys

# The budgets, in lines of code by part: the counts of 2026-12-04 (sys: of 2026-12-05,
# after the filters' raw install moved to shared_proto::seccomp; the lifecycle and the rest:
# after the handoff fetch became one, Taker::fetch; the rest then grew 6 lines for the
# worker's heap setting, GLIBC_TUNABLES). Growth needs a line in SECURITY.md saying why,
# and a new budget here.
BUDGETS = {"lifecycle+driver": 1032, "sys": 1088, "rest": 730}
# AETHER_SUPERVISOR_BUDGETS ("part=N,..."; the test lowers one to show the check fails).
for item in filter(None, sys.argv[2].split(",")):
    part, n = item.rsplit("=", 1)
    if part not in BUDGETS:
        sys.exit(f"AETHER_SUPERVISOR_BUDGETS: no part {part!r}; the parts are {', '.join(BUDGETS)}")
    BUDGETS[part] = int(n)

def part(path):
    if path.startswith("lifecycle/") or path == "supervise.rs":
        return "lifecycle+driver"
    if path.startswith("sys/"):
        return "sys"
    return "rest"

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

counts, files = {p: 0 for p in BUDGETS}, []
for d, _, names in os.walk(sys.argv[1]):
    for f in names:
        if f.endswith(".rs") and f != "tests.rs":
            rel = os.path.relpath(os.path.join(d, f), sys.argv[1])
            n = code_lines(open(os.path.join(d, f), encoding="utf-8").read())
            counts[part(rel)] += n
            files.append((n, rel))
print(f"supervisor code: {sum(counts.values())} lines (not blank, comments or tests) in {len(files)} files; largest: "
      + ", ".join(f"{p} {n}" for n, p in sorted(files, reverse=True)[:4]))
over = []
for p, budget in BUDGETS.items():
    flag = "  OVER BUDGET" if counts[p] > budget else ""
    print(f"  {p:<17} {counts[p]:>5} lines, budget {budget}{flag}")
    if flag:
        over.append(f"{p} ({counts[p]} lines, budget {budget})")
if over:
    sys.exit("supervisor code over its budget: " + ", ".join(over))
EOF
}

# --lines: the code count only (no build, no agent), as e2e/tests/supervisor_budget.rs runs it.
if [[ "${1:-}" == --lines ]]; then
  code_lines
  exit
fi

bins="${AETHER_BIN_DIR:-}"
if [[ -z "$bins" ]]; then
  aether_build_release
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

code_lines
