#!/usr/bin/env bash
# Installs the Python test clients into the project-local virtualenv (.venv, which git
# ignores) from PyPI, and prints the path of the virtualenv's python on stdout (everything
# else goes to stderr):
#
#   spiffe   the Python SPIFFE library (py-spiffe): an independent Workload API client
#            that e2e/tests/identity_provider.rs runs against the test identity provider
#   aioquic  a real HTTP/3 (QUIC) client, for the QUIC trials (e2e/trials/quic)
#
# Idempotent: with the pinned versions installed it only prints the path.
# Tests find it through AETHER_PYTHON, else in this virtualenv.
#
# Env: SPIFFE_PY_VERSION (default 0.3.2), AIOQUIC_VERSION (default 1.7.2),
#      AETHER_VENV (default <workspace>/.venv).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ -f "$root/scripts/lib.sh" ]]; then
  # shellcheck source=lib.sh
  source "$root/scripts/lib.sh"   # ensure_venv, venv_pip_install (serialised on a lock)
else
  AETHER_VENV="${AETHER_VENV:-$root/.venv}"
  ensure_venv() { [[ -x "$AETHER_VENV/bin/python" ]] || python3 -m venv "$AETHER_VENV"; }
  venv_pip_install() { "$AETHER_VENV/bin/python" -m pip install --disable-pip-version-check "$@"; }
fi

ensure_venv >&2
py="$AETHER_VENV/bin/python"

for pinned in "spiffe==${SPIFFE_PY_VERSION:-0.3.2}" "aioquic==${AIOQUIC_VERSION:-1.7.2}"; do
  package="${pinned%%==*}" version="${pinned#*==}"
  installed="$("$py" - "$package" <<'EOF' 2>/dev/null || true
import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass
EOF
)"
  if [[ "$installed" == "$version" ]]; then
    echo "install-pytools: $pinned already installed" >&2
  else
    echo "install-pytools: pip install $pinned${installed:+ (replacing $installed)}" >&2
    venv_pip_install --quiet "$pinned" >&2
  fi
done

# The import is the check: the package and its native dependencies (grpcio, cryptography)
# load in this python.
"$py" -c 'from spiffe import WorkloadApiClient; import aioquic.asyncio; import importlib.metadata as m; print("install-pytools: spiffe", m.version("spiffe"), "aioquic", m.version("aioquic"))' >&2
echo "$py"
