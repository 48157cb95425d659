# shellcheck shell=bash
# Shared helpers for the scripts in this folder. Source it; it sets no shell options and
# defines only AETHER_-prefixed variables and the functions below, so a caller's own
# names (root, venv, ...) are left alone.
#
#   AETHER_ROOT   the workspace root (the folder holding Cargo.toml and scripts/)
#   AETHER_VENV   the project virtualenv, <root>/.venv unless already set
#   AETHER_TOOLS  project-local tools, <root>/.tools (git-ignored); binaries in bin/
#   AETHER_IMAGE_DIR   the image's build folder, <target>/image (build-image.sh, test-image.sh)
#   AETHER_IMAGE_BINS  the binaries the image carries (the Containerfile says why each)
#
# ensure_venv            create AETHER_VENV with `python3 -m venv` if it has no python
# host_triple            rustc's host target triple (x86_64-unknown-linux-gnu here)
# image_bin_source NAME  the built file that ships as NAME (in the image, and the plugin on
#                        the host): <target>/release/NAME, except aether-cni, which is
#                        the static build of build-cni-plugin.sh, <target>/<host>/cni-plugin/
# venv_pip_install ARGS  `pip install ARGS` into AETHER_VENV, one installer at a time
# aether_build_debug     the one debug build of the scripts: every binary and test target
#                        of the workspace with the test-only fault hooks, as scripts/test.sh
#                        builds and tests them
# aether_build_release   the one release build: every binary of the workspace, as it ships
#                        (e2e/agent-restart-gap.sh builds the same)
#
# Every build goes through these two, so that no script builds a crate with another feature
# set and a later build has nothing to redo.
#
# Several scripts (install-tools.sh, install-envoy.sh) install into the same .venv and may
# run at the same time; both helpers serialise on an flock so that two `python3 -m venv`
# or two pip runs never interleave in one environment.

AETHER_ROOT="${AETHER_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
AETHER_VENV="${AETHER_VENV:-$AETHER_ROOT/.venv}"
AETHER_TOOLS="${AETHER_TOOLS:-$AETHER_ROOT/.tools}"
AETHER_IMAGE_DIR="${CARGO_TARGET_DIR:-$AETHER_ROOT/target}/image"
AETHER_IMAGE_BINS=(aether-supervisor aether-worker aether-keeper aether-cni agent-ready aether-registrar aether-xds-relay)

host_triple() { rustc -vV | sed -n 's/^host: //p'; }

aether_build_debug() {
  (cd "$AETHER_ROOT" && cargo build --workspace --bins --tests \
    --features aether-supervisor/fault-hooks,aether-worker/fault-hooks "$@")
}

aether_build_release() { (cd "$AETHER_ROOT" && cargo build --release --workspace --bins "$@"); }

image_bin_source() {
  local target="${CARGO_TARGET_DIR:-$AETHER_ROOT/target}"
  if [[ "$1" == aether-cni ]]; then
    echo "$target/$(host_triple)/cni-plugin/aether-cni"
  else
    echo "$target/release/$1"
  fi
}

# Each helper runs in a subshell holding an exclusive flock on <tools>/venv.lock (the lock
# file lives in the git-ignored tools folder). Without flock(1) it runs unlocked.

ensure_venv() {
  mkdir -p "$AETHER_TOOLS" || return
  (
    if command -v flock >/dev/null 2>&1; then flock 9 || exit; fi
    if [[ -x "$AETHER_VENV/bin/python" ]]; then
      echo "venv: reusing $AETHER_VENV"
    else
      echo "venv: creating $AETHER_VENV"
      python3 -m venv "$AETHER_VENV" || exit
    fi
  ) 9>"$AETHER_TOOLS/venv.lock"
}

venv_pip_install() {
  mkdir -p "$AETHER_TOOLS" || return
  (
    if command -v flock >/dev/null 2>&1; then flock 9 || exit; fi
    "$AETHER_VENV/bin/python" -m pip install --disable-pip-version-check "$@"
  ) 9>"$AETHER_TOOLS/venv.lock"
}
