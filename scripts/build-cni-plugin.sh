#!/usr/bin/env bash
# Builds the CNI plugin as it ships: aether-cni linked statically (glibc included), with
# the `cni-plugin` profile (Cargo.toml). Prints the binary's path on its last line.
#
#   scripts/build-cni-plugin.sh        # target/<host triple>/cni-plugin/aether-cni
#
# Why static: the plugin is not run in the image. `aether-cni install` copies it into the
# host's CNI bin folder, and the container runtime runs it there, with the host's dynamic
# loader and the host's glibc. Linked dynamically against the build machine's glibc (2.36
# here) it needs symbols up to GLIBC_2.34, so it would not start on a host with an older
# glibc. Linked statically it needs nothing from the host but the kernel. It also starts
# faster: no loader, no library to map, no relocation against one. It is run once per pod
# on every ADD, so its start is part of each ADD's latency (README.md, "Mesh scale").
#
# crt-static is a target feature, which cargo only applies to every crate of a build: it
# is set here, for this one binary, with an explicit --target so that build scripts and
# proc macros (which cannot be static) stay on the host's default. The separate target
# folder costs one extra build of the plugin's dependencies (about a minute here).
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
triple="$(host_triple)"
[[ -n "$triple" ]] || { echo "build-cni-plugin: rustc -vV names no host triple" >&2; exit 1; }
case "$triple" in
  *-linux-gnu) ;;
  *) echo "build-cni-plugin: host $triple: only *-linux-gnu targets are built statically here" >&2; exit 1 ;;
esac

(cd "$AETHER_ROOT" && RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --profile cni-plugin --target "$triple" -p aether-cni --bin aether-cni >&2)
bin="$(image_bin_source aether-cni)"
[[ -x "$bin" ]] || { echo "build-cni-plugin: $bin is missing after the build" >&2; exit 1; }
# A static executable has no program interpreter (PT_INTERP): nothing for a loader to find.
if readelf -lW "$bin" | grep -q 'INTERP'; then
  readelf -lW "$bin" | grep -A1 INTERP >&2
  echo "build-cni-plugin: $bin names a program interpreter: it is not statically linked" >&2
  exit 1
fi
echo "$bin"
